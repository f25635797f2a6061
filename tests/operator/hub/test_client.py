"""The operator's Hub client against the Hub stand-in (e2e/hub_server.py) on 127.0.0.1: what it
asks, what it keeps, and the hub's own words when it refuses."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from e2e.hub_server import HubServer
from kvpilot.operator.hub.client import HubClient, HubError
from tests.operator.hub.checkpoints import write_sharded

REPO, TOKEN = "acme/tiny-chat", "hf_test_token"
CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64}


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    return tmp_path


def test_the_config_is_read_with_the_token_once_per_repository_and_revision(folder: Path) -> None:
    with HubServer(REPO, folder, token=TOKEN, gated=True) as hub:
        client = HubClient(hub.url)
        assert client.config(REPO, "main", TOKEN) == CONFIG
        assert client.config(REPO, "main", TOKEN) == CONFIG
        (asked,) = hub.file_requests("config.json")
        assert asked.path == f"/{REPO}/resolve/main/config.json" and asked.headers["Authorization"] == f"Bearer {TOKEN}"
        # Another revision is another file.
        client.config(REPO, hub.commit, TOKEN)
        assert len(hub.file_requests("config.json")) == 2


def test_a_refusal_carries_the_hubs_words_and_is_asked_again(folder: Path) -> None:
    with HubServer(REPO, folder, token=TOKEN, gated=True) as hub:
        client = HubClient("http://127.0.0.1:9")  # the service's endpoint wins over the operator's
        with pytest.raises(HubError) as gated:
            client.config(REPO, "main", None, endpoint=hub.url)
        assert gated.value.status == 401 and "restricted" in gated.value.message
        with pytest.raises(HubError) as wrong:
            client.config(REPO, "main", "hf_wrong", endpoint=hub.url)
        assert wrong.value.status == 401 and "Invalid credentials" in wrong.value.message
        with pytest.raises(HubError) as missing:
            client.config(REPO, "no-such-branch", TOKEN, endpoint=hub.url)
        assert missing.value.status == 404 and "Invalid rev id: no-such-branch" in missing.value.message
        # Refusals are not kept: with the token the same read succeeds.
        assert client.config(REPO, "main", TOKEN, endpoint=hub.url) == CONFIG
        assert len(hub.file_requests("config.json")) == 4  # every refusal was asked, then the success


def test_no_answer_and_no_config_are_errors_too(folder: Path) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with pytest.raises(HubError) as unreachable:
        HubClient(f"http://127.0.0.1:{port}").config(REPO, "main", None)
    assert unreachable.value.status is None and "no answer" in unreachable.value.message
    with pytest.raises(HubError, match="not an http"):
        HubClient("file:///etc").config(REPO, "main", None)
    (folder / "config.json").write_text("[1, 2]")
    with HubServer(REPO, folder) as hub, pytest.raises(HubError, match="not a JSON object"):
        HubClient(hub.url).config(REPO, "main", None)


def test_the_weights_bytes_are_the_index_s_total_or_a_single_file_s_header_never_the_weights(folder: Path) -> None:
    tensors = {"embed.weight": torch.zeros(64, 32, dtype=torch.bfloat16), "norm.weight": torch.ones(32)}
    save_file(tensors, str(folder / "model.safetensors"))
    stored = 64 * 32 * 2 + 32 * 4
    with HubServer(REPO, folder, token=TOKEN) as hub:
        client = HubClient(hub.url)
        assert client.weights(REPO, "main", TOKEN, 1) == (stored, 0)
        assert client.weights(REPO, "main", TOKEN, 1) == (stored, 0)  # kept
        # No index: asked once; the single file's header read by two ranges, its tensors never.
        assert len(hub.file_requests("model.safetensors.index.json")) == 1
        single = hub.file_requests("model.safetensors")
        assert [r.headers["Range"] for r in single][0] == "bytes=0-7" and len(single) == 2
        # The length and the header, not a byte of the tensors. The server counts a body once its
        # handler thread has written it, which may be just after the client has read it.
        header_bytes = (folder / "model.safetensors").stat().st_size - stored
        deadline = time.monotonic() + 5.0
        while hub.body_bytes.get("model.safetensors") != header_bytes and time.monotonic() < deadline:
            time.sleep(0.01)
        assert hub.body_bytes["model.safetensors"] == header_bytes
    index = {
        "metadata": {"total_size": 16_060_522_496},
        "weight_map": {"embed.weight": "model-00001-of-00004.safetensors"},
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with HubServer(REPO, folder, token=TOKEN) as hub:
        assert HubClient(hub.url).weights(REPO, "main", TOKEN, 1) == (16_060_522_496, 0)
        assert hub.file_requests("model.safetensors") == []
    (folder / "model.safetensors.index.json").unlink()
    (folder / "model.safetensors").unlink()
    with HubServer(REPO, folder, token=TOKEN) as hub:
        # Weights in another format (pytorch_model.bin): nothing to read, not an error.
        assert HubClient(hub.url).weights(REPO, "main", TOKEN, 1) is None
        with pytest.raises(HubError) as refused:
            HubClient(hub.url).weights(REPO, "main", "hf_wrong", 1)
        assert refused.value.status == 401


def test_the_mtp_modules_are_read_from_the_headers_of_their_shards_alone(folder: Path) -> None:
    # DeepSeek-V3's layout, two decoder layers long: its MTP layer (2) in the last shard.
    shards = {
        "model-00001-of-00003.safetensors": {"model.embed_tokens.weight": 4096, "model.layers.0.mlp.weight": 1000},
        "model-00002-of-00003.safetensors": {"model.layers.1.mlp.weight": 1000, "lm_head.weight": 4096},
        "model-00003-of-00003.safetensors": {"model.layers.2.mlp.weight": 1000, "model.layers.2.eh_proj.weight": 64},
    }
    total = write_sharded(folder, shards)
    with HubServer(REPO, folder, token=TOKEN) as hub:
        client = HubClient(hub.url)
        assert client.weights(REPO, "main", TOKEN, 2) == (total, 1064)
        assert client.weights(REPO, "main", TOKEN, 2) == (total, 1064)  # kept
        # The index, then the MTP shard's header by two ranges; the other shards never.
        assert len(hub.file_requests("model.safetensors.index.json")) == 1
        last = hub.file_requests("model-00003-of-00003.safetensors")
        assert [r.headers["Range"] for r in last][0] == "bytes=0-7" and len(last) == 2
        assert hub.file_requests("model-00001-of-00003.safetensors") == []
        assert hub.file_requests("model-00002-of-00003.safetensors") == []
    # A shard the index names but the hub does not hold: the hub's 404, for the service's status.
    (folder / "model-00003-of-00003.safetensors").unlink()
    with HubServer(REPO, folder, token=TOKEN) as hub:
        with pytest.raises(HubError) as missing:
            HubClient(hub.url).weights(REPO, "main", TOKEN, 2)
        assert missing.value.status == 404 and "model-00003-of-00003.safetensors" in missing.value.message
