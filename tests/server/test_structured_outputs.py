"""Structured outputs through the official openai client against real servers on the real model:
response_format (a pydantic model via parse(), json_object) and vLLM's structured_outputs (json,
regex, choice, grammar), under batching, preemption and speculative decoding; bad constraints are
a 400 that says why."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.conftest import MODEL, Server, start_server

KV_BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 4  # layers x KV heads x head dim x K and V x fp32
CITIES = ["Paris", "Tokyo", "Lima", "Oslo"]


class City(BaseModel):
    # Bounded fields: the small model, free to write a number, writes digits until max_tokens.
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    is_capital: bool


def ask(client: openai.OpenAI, city: str, **kwargs: object) -> City:
    completion = client.chat.completions.parse(
        model=MODEL,
        messages=[
            {"role": "system", "content": "You answer in JSON with name, country and is_capital."},
            {"role": "user", "content": f"Tell me about {city}."},
        ],
        response_format=City,
        max_tokens=60,
        **kwargs,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, City), choice.message.content
    return choice.message.parsed


def ask_all(server: Server, **kwargs: object) -> list[City]:
    """Every city at once, so that the server batches them."""
    client = server.client()
    with ThreadPoolExecutor(len(CITIES)) as pool:
        return list(pool.map(lambda c: ask(client, c, **kwargs), CITIES))


@pytest.fixture(scope="module")
def tight(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A pool of 10 blocks (160 tokens) for 4 requests of 60-70 tokens (4-5 blocks each) and a
    plain one of ~80, with n-gram speculation: any three of them running together preempt (with 16
    blocks, 1-3 preemptions per round of these requests, and once in CI none)."""
    srv = start_server(
        tmp_path_factory.mktemp("tight"),
        "--kv-cache-memory-bytes",
        str(10 * 16 * KV_BYTES_PER_TOKEN),
        "--max-model-len",
        "160",
        "--speculative",
        "ngram",
        "--speculative-max-batch-size",
        "64",
    )
    yield srv
    code = srv.terminate()
    assert code == 0, f"kvpilot serve exited with {code}:\n{srv.log()}"


def test_parse_under_batching(server: Server) -> None:
    cities = ask_all(server, temperature=0.0)
    assert [c.name.lower() for c in cities] == [c.lower() for c in CITIES]
    assert len(ask_all(server, temperature=1.0, top_p=0.9)) == len(CITIES)  # sampled answers parse too


def test_parse_under_preemption_and_speculation(tight: Server) -> None:
    """Structured requests do not speculate (docs/speculative-decoding.md): while they run, plain requests in the same
    batch still get drafts, and preemption recomputes a structured request without losing its place
    in the grammar."""
    client = tight.client()
    with ThreadPoolExecutor(2) as pool:
        plain = pool.submit(
            client.completions.create,
            model=MODEL,
            prompt="one two three four one two three four one two three four one two",
            max_tokens=60,
            temperature=0.0,
        )
        cities = pool.submit(ask_all, tight, temperature=0.0).result()
        plain.result()
    assert len(cities) == len(CITIES)
    assert tight.metric("kvpilot_num_preemptions_total") > 0, "the pool was meant to be too small"
    assert tight.metric("kvpilot_spec_decode_num_drafts_total") > 0, "plain requests were meant to speculate"


def test_json_object(server: Server) -> None:
    completion = server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Reply with a JSON object with the keys name and colour of a cat."}],
        response_format={"type": "json_object"},
        max_tokens=120,
        temperature=0.0,
    )
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(completion.choices[0].message.content), dict)


def test_regex_and_choice_on_completions_and_chat(server: Server) -> None:
    client = server.client()
    regex = r"\d{3}-[a-z]{2,5}"
    text = client.completions.create(
        model=MODEL,
        prompt="A code:",
        max_tokens=20,
        temperature=1.0,
        seed=1,
        extra_body={"structured_outputs": {"regex": regex}},
    ).choices[0]
    assert text.finish_reason == "stop" and re.fullmatch(regex, text.text), text
    choices = ["positive", "negative", "neither"]
    for temperature in (0.0, 1.0):
        answer = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Is 'I loved it' positive or negative?"}],
            max_tokens=10,
            temperature=temperature,
            extra_body={"structured_outputs": {"choice": choices}},
        ).choices[0]
        assert answer.message.content in choices
    grammar = 'root ::= "x" [0-9] [0-9] "y"'
    text = client.completions.create(
        model=MODEL,
        prompt="Anything:",
        max_tokens=10,
        extra_body={"structured_outputs": {"grammar": grammar}},
    ).choices[0]
    assert re.fullmatch(r"x\d\dy", text.text), text


def test_structured_outputs_json_on_completions(server: Server) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    text = (
        server.client()
        .completions.create(
            model=MODEL,
            prompt="Answer:",
            max_tokens=30,
            temperature=0.0,
            extra_body={"structured_outputs": {"json": schema}},
        )
        .choices[0]
        .text
    )
    assert isinstance(json.loads(text)["ok"], bool)


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "response_format",
            "nope",
        ),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "parenthesis"),
        ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs", '"x" is not defined'),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, None, "exactly one"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, None, "whitespace_pattern"),
        ({"response_format": {"type": "json_schema"}}, None, "json_schema"),
    ],
)
def test_bad_constraint_is_a_400(server: Server, body: dict[str, object], param: str | None, says: str) -> None:
    response = server.http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **body},
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert says in error["message"], error
    if param is not None:
        assert error["param"] == param
