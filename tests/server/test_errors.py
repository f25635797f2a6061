"""Bad input of every kind: the right status, an OpenAI-format error, and a server left intact."""

from __future__ import annotations

import openai
import pytest

from tests.server.conftest import MODEL, Server

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]

# (label, method, path, body (dict, or str sent raw), status, expected param, expected code)
CASES = [
    ("malformed JSON", "POST", COMPLETIONS, '{"model": "x", "prompt": ', 400, None, "invalid_json"),
    ("body is not an object", "POST", COMPLETIONS, "[1, 2]", 400, None, None),
    ("missing prompt", "POST", COMPLETIONS, {"model": MODEL}, 400, "prompt", None),
    ("prompt of the wrong type", "POST", COMPLETIONS, {"model": MODEL, "prompt": 5}, 400, "prompt", None),
    (
        "max_tokens as a string",
        "POST",
        COMPLETIONS,
        {"model": MODEL, "prompt": "a", "max_tokens": "8"},
        400,
        "max_tokens",
        None,
    ),
    ("max_tokens 0", "POST", COMPLETIONS, {"model": MODEL, "prompt": "a", "max_tokens": 0}, 400, "max_tokens", None),
    ("n 0", "POST", COMPLETIONS, {"model": MODEL, "prompt": "a", "n": 0}, 400, "n", None),
    ("n 129", "POST", COMPLETIONS, {"model": MODEL, "prompt": "a", "n": 129}, 400, "n", None),
    (
        "temperature -1",
        "POST",
        COMPLETIONS,
        {"model": MODEL, "prompt": "a", "temperature": -1},
        400,
        "temperature",
        None,
    ),
    ("top_p 0", "POST", COMPLETIONS, {"model": MODEL, "prompt": "a", "top_p": 0}, 400, "top_p", None),
    ("negative seed", "POST", COMPLETIONS, {"model": MODEL, "prompt": "a", "seed": -3}, 400, "seed", None),
    (
        "empty stop string",
        "POST",
        COMPLETIONS,
        {"model": MODEL, "prompt": "a", "stop": [""]},
        400,
        "stop",
        "string_too_short",
    ),
    ("stream not a bool", "POST", COMPLETIONS, {"model": MODEL, "prompt": "a", "stream": "yes"}, 400, "stream", None),
    ("unknown model", "POST", COMPLETIONS, {"model": "gpt-4", "prompt": "a"}, 404, "model", "model_not_found"),
    ("empty prompt", "POST", COMPLETIONS, {"model": MODEL, "prompt": ""}, 400, "prompt", None),
    (
        "token id outside the vocabulary",
        "POST",
        COMPLETIONS,
        {"model": MODEL, "prompt": [1, 10**9]},
        400,
        "prompt",
        None,
    ),
    (
        "prompt + max_tokens over max_model_len",
        "POST",
        COMPLETIONS,
        {"model": MODEL, "prompt": [1] * 100, "max_tokens": 10**6},
        400,
        "max_tokens",
        "context_length_exceeded",
    ),
    (
        "prompt alone over max_model_len",
        "POST",
        COMPLETIONS,
        {"model": MODEL, "prompt": [1] * 5000, "max_tokens": 1},
        400,
        "prompt",
        "context_length_exceeded",
    ),
    (
        "logit_bias asked for",
        "POST",
        COMPLETIONS,
        {"model": MODEL, "prompt": "a", "logit_bias": {"5": 10}},
        400,
        "logit_bias",
        "unsupported_parameter",
    ),
    ("missing messages", "POST", CHAT, {"model": MODEL}, 400, "messages", None),
    ("empty messages", "POST", CHAT, {"model": MODEL, "messages": []}, 400, "messages", None),
    (
        "unknown role",
        "POST",
        CHAT,
        {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]},
        400,
        "messages",
        "literal_error",
    ),
    (
        "content of the wrong type",
        "POST",
        CHAT,
        {"model": MODEL, "messages": [{"role": "user", "content": 3}]},
        400,
        "messages",
        None,
    ),
    (
        "chat over max_model_len",
        "POST",
        CHAT,
        {"model": MODEL, "messages": MSG, "max_completion_tokens": 10**6},
        400,
        "max_tokens",
        "context_length_exceeded",
    ),
    ("chat unknown model", "POST", CHAT, {"model": "nope", "messages": MSG}, 404, "model", "model_not_found"),
    ("unknown route", "GET", "/v1/embeddings", None, 404, None, None),
    ("wrong method", "GET", COMPLETIONS, None, 405, None, None),
]


@pytest.mark.parametrize(
    ("label", "method", "path", "body", "status", "param", "code"), CASES, ids=[c[0] for c in CASES]
)
def test_bad_input_gets_openai_error(
    server: Server, label: str, method: str, path: str, body: object, status: int, param: str | None, code: str | None
) -> None:
    if isinstance(body, str):
        response = server.http.request(method, path, content=body, headers={"content-type": "application/json"})
    else:
        response = server.http.request(method, path, json=body)
    assert response.status_code == status, f"{label}: {response.status_code} {response.text}"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and isinstance(error["type"], str)
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error


def test_context_overflow_message_has_the_numbers(server: Server) -> None:
    max_len = server.client().models.list().data[0].model_extra["max_model_len"]
    with pytest.raises(openai.BadRequestError) as err:
        server.client().completions.create(model=MODEL, prompt=[1] * 100, max_tokens=max_len)
    message = err.value.body["message"]
    assert f"maximum context length is {max_len} tokens" in message
    assert f"requested {100 + max_len} tokens (100 in the prompt, {max_len} for the completion)" in message


def test_sdk_raises_its_usual_exceptions(server: Server) -> None:
    client = server.client(max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=MSG)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="a", max_tokens=0)


def test_bad_input_leaves_no_blocks_and_server_serves(server: Server) -> None:
    # The table above ran first (pytest keeps file order): nothing may be left running or holding KV.
    assert server.metric("kvpilot_num_requests_running") == 0
    assert server.metric("kvpilot_num_requests_waiting") == 0
    assert server.metric("kvpilot_kv_cache_usage_ratio") == 0
    assert server.http.get("/health").status_code == 200
    out = server.client().completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    assert out.usage.completion_tokens >= 1
