"""A server with LoRA adapters, through the official openai client: an adapter is a model name,
listed by /v1/models beside the base model; adapters load and unload at runtime as vLLM's do, a bad
one is refused with a 4xx while the others keep serving; vllm:lora_requests_info is exported."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import openai
import pytest

from tests.engine.lora_fixtures import SPECS, make_adapter
from tests.engine.oracle import greedy_reference
from tests.server.conftest import MODEL, Server, start_server

SPEC = {spec.name: spec for spec in SPECS}


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory) -> dict[str, tuple[Path, object]]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: (root / name, make_adapter(model_dir, spec, root / name)) for name, spec in SPEC.items()}


@pytest.fixture(scope="module")
def lora_server(adapters, tmp_path_factory):
    srv = start_server(
        tmp_path_factory.mktemp("serve-lora"),
        "--enable-lora",
        "--max-loras",
        "2",
        "--lora-modules",
        f"alpha={adapters['alpha'][0]}",
    )
    yield srv
    code = srv.terminate()
    assert code == 0, f"kvpilot serve exited with {code} on SIGTERM:\n{srv.log()}"


def expected_text(model, tokenizer, prompt: list[int], max_tokens: int) -> str:
    """HF's (+ PEFT's) greedy continuation, as the server's text."""
    return tokenizer.decode(greedy_reference(model, prompt, max_tokens).tokens, skip_special_tokens=True)


def complete(client: openai.OpenAI, model: str, prompt: list[int], max_tokens: int = 10) -> str:
    out = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0)
    assert out.model == model
    return out.choices[0].text


def first_logprob(client: openai.OpenAI, model: str, prompt: list[int]) -> float:
    out = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0.0, logprobs=1)
    assert out.choices[0].logprobs is not None and out.choices[0].logprobs.token_logprobs
    return float(out.choices[0].logprobs.token_logprobs[0])


def test_an_adapter_is_a_model_name(lora_server: Server, adapters, hf_model, tokenizer):
    client = lora_server.client()
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {MODEL, "alpha"}
    alpha = models["alpha"].model_dump()
    assert alpha["parent"] == MODEL and alpha["root"] == str(adapters["alpha"][0])
    prompt = tokenizer.encode("The scheduler runs one step at a time:", add_special_tokens=False)
    with_adapter = complete(client, "alpha", prompt)
    assert with_adapter == expected_text(adapters["alpha"][1], tokenizer, prompt, 10)
    assert complete(client, MODEL, prompt) == expected_text(hf_model, tokenizer, prompt, 10)
    # The adapter changes the model: the first token's log-probability differs from the base model's
    # (whether ten greedy tokens change depends on PEFT's random lora_A: a run where they did not failed).
    assert abs(first_logprob(client, "alpha", prompt) - first_logprob(client, MODEL, prompt)) > 1e-4
    chat = client.chat.completions.create(
        model="alpha", messages=[{"role": "user", "content": "Hi!"}], max_tokens=5, temperature=0.0
    )
    assert chat.model == "alpha" and chat.choices[0].message.content
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        complete(client, "gamma", prompt)


def test_load_and_unload_at_runtime_while_a_request_streams(lora_server: Server, adapters, tokenizer):
    client = lora_server.client()
    prompt = tokenizer.encode("Rivers carve valleys over millions of years;", add_special_tokens=False)
    streamed: list[str] = []

    def stream_alpha() -> None:
        chunks = client.completions.create(model="alpha", prompt=prompt, max_tokens=40, temperature=0.0, stream=True)
        streamed.extend(c.choices[0].text for c in chunks if c.choices)

    running = threading.Thread(target=stream_alpha)
    running.start()
    loaded = lora_server.http.post(
        "/v1/load_lora_adapter", json={"lora_name": "beta", "lora_path": str(adapters["beta"][0])}
    )
    assert loaded.status_code == 200, loaded.text
    assert "added successfully" in loaded.text
    assert complete(client, "beta", prompt) == expected_text(adapters["beta"][1], tokenizer, prompt, 10)
    assert {m.id for m in client.models.list().data} == {MODEL, "alpha", "beta"}
    running.join(timeout=120)
    assert "".join(streamed) == expected_text(adapters["alpha"][1], tokenizer, prompt, 40)
    unloaded = lora_server.http.post("/v1/unload_lora_adapter", json={"lora_name": "beta"})
    assert unloaded.status_code == 200, unloaded.text
    with pytest.raises(openai.NotFoundError):
        complete(client, "beta", prompt)
    again = lora_server.http.post("/v1/unload_lora_adapter", json={"lora_name": "beta"})
    assert again.status_code == 404 and "cannot be found" in again.json()["error"]["message"]


def test_load_inplace_replaces_an_adapter(lora_server: Server, adapters, tokenizer):
    client, http = lora_server.client(), lora_server.http
    prompt = tokenizer.encode("Glaciers leave lakes behind them.", add_special_tokens=False)
    first = {"lora_name": "gamma", "lora_path": str(adapters["beta"][0])}
    assert http.post("/v1/load_lora_adapter", json=first).status_code == 200
    assert complete(client, "gamma", prompt) == expected_text(adapters["beta"][1], tokenizer, prompt, 10)
    swap = {"lora_name": "gamma", "lora_path": str(adapters["alpha"][0]), "load_inplace": True}
    assert http.post("/v1/load_lora_adapter", json=swap).status_code == 200
    # A new registration: alpha's weights, and none of the KV cached under beta's.
    assert complete(client, "gamma", prompt) == expected_text(adapters["alpha"][1], tokenizer, prompt, 10)
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "gamma"}).status_code == 200


def test_bad_adapters_are_refused_while_the_others_keep_serving(lora_server: Server, adapters, tokenizer, tmp_path):
    dora = tmp_path / "dora"
    dora.mkdir()
    (dora / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "use_dora": True})
    )
    cases = [
        ({"lora_name": "gone", "lora_path": str(tmp_path / "nowhere")}, 404, "No adapter found"),
        ({"lora_name": "dora", "lora_path": str(dora)}, 400, "use_dora=True is not supported"),
        ({"lora_name": "alpha", "lora_path": str(adapters["alpha"][0])}, 400, "already been loaded"),
        ({"lora_name": MODEL, "lora_path": str(adapters["beta"][0])}, 400, "base model's name"),
        ({"lora_name": "x"}, 400, "lora_path"),
    ]
    for body, status, message in cases:
        response = lora_server.http.post("/v1/load_lora_adapter", json=body)
        assert response.status_code == status, (body, response.text)
        assert message in response.json()["error"]["message"], response.text
    prompt = tokenizer.encode("Mix, rest for an hour, then bake", add_special_tokens=False)
    assert complete(lora_server.client(), "alpha", prompt) == expected_text(adapters["alpha"][1], tokenizer, prompt, 10)
    assert {m.id for m in lora_server.client().models.list().data} == {MODEL, "alpha"}


def test_lora_metrics(lora_server: Server, tokenizer):
    prompt = tokenizer.encode("Photosynthesis turns light", add_special_tokens=False)
    complete(lora_server.client(), "alpha", prompt, max_tokens=4)
    metrics = lora_server.metrics()
    info = [labels for (name, labels) in metrics if name == "vllm:lora_requests_info"]
    assert info and all(dict(labels)["max_lora"] == "2" for labels in info), info
    assert set(dict(info[0])) == {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}
    # The series whose time is the latest holds now: nothing runs between requests.
    latest = max(info, key=lambda labels: metrics["vllm:lora_requests_info", labels])
    assert dict(latest)["running_lora_adapters"] == "", dict(latest)
    assert any(dict(labels)["running_lora_adapters"] == "alpha" for labels in info), info
    assert lora_server.metric("kvpilot_lora_requests_total", lora_name="alpha") >= 1
    assert lora_server.metric("kvpilot_lora_generation_tokens_total", lora_name="alpha") >= 4


def test_a_server_without_lora_refuses_adapter_routes(server: Server):
    response = server.http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
    assert response.status_code == 400 and "--enable-lora" in response.json()["error"]["message"]
