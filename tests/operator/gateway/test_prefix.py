"""PrefixHash routing (routing.strategy: PrefixHash): consistent hashing with bounded loads over a
service's engines, keyed by the beginning of the first user message or the prompt."""

from __future__ import annotations

import collections
from typing import Any

import aiohttp

from kvpilot.operator.gateway import routing
from kvpilot.operator.gateway.body import PREFIX_CHARS, read_body

from .harness import POD_IPS, Engine, Indexes, Recorder, run, serving, url

URLS = [(f"p{i}", f"http://10.0.0.{i}:8000") for i in range(3)]


def test_the_key_is_the_beginning_of_the_first_user_message_or_the_prompt() -> None:
    chat = b'{"model": "m", "messages": [{"role": "system", "content": "be brief"}, '
    chat += b'{"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]}]}'
    assert read_body(chat) == ("m", "hello there")
    assert read_body(b'{"model": "m", "prompt": ["first", "second"]}').prefix == "first"
    long = "x" * (PREFIX_CHARS + 50)
    assert read_body(f'{{"model": "m", "prompt": "{long}"}}'.encode()).prefix == "x" * PREFIX_CHARS
    assert read_body(b'{"model": "m", "prompt": [1, 2, 3]}').prefix == ""


def test_a_prefix_keeps_its_engine_and_keys_spread_over_all() -> None:
    idle = routing.Engines()
    keys = [f"conversation {i}: tell me about topic {i}" for i in range(600)]
    chosen = {key: routing.choose_by_prefix(URLS, idle, 10, 0.0, key) for key in keys}
    assert all(routing.choose_by_prefix(URLS, idle, 10, 0.0, key) == chosen[key] for key in keys)
    spread = collections.Counter(chosen.values())
    assert set(spread) == {u for _, u in URLS} and min(spread.values()) > 120, spread
    # An engine goes: only its keys move; the others keep their engine (and its cache).
    without = URLS[:2]
    moved = [
        k for k in keys if chosen[k] != URLS[2][1] and routing.choose_by_prefix(without, idle, 10, 0.0, k) != chosen[k]
    ]
    assert moved == []


def test_a_busy_engine_passes_its_keys_on_within_the_load_bound() -> None:
    key = "the same conversation"
    home = routing.choose_by_prefix(URLS, routing.Engines(), 100, 0.0, key)
    assert home is not None
    # Loads 4, 2, 2 and this one: bound ceil(1.25 * 9 / 3) = 4, and home would go to 5, over it.
    busy = routing.Engines(in_flight={home: 4, **{u: 2 for _, u in URLS if u != home}})
    assert routing.choose_by_prefix(URLS, busy, 100, 0.0, key) not in (home, None)
    # Loads 3, 2, 2: bound ceil(1.25 * 8 / 3) = 4, and home goes to 4: it keeps the key.
    slightly = routing.Engines(in_flight={home: 3, **{u: 2 for _, u in URLS if u != home}})
    assert routing.choose_by_prefix(URLS, slightly, 100, 0.0, key) == home
    backed_off = routing.Engines()
    backed_off.failed(home, now=0.0)
    assert routing.choose_by_prefix(URLS, backed_off, 100, 0.0, key) not in (home, None)


def test_prefix_hash_sends_each_conversation_to_one_engine() -> None:
    async def scenario(ix: Indexes, rec: Recorder, base: str, http: aiohttp.ClientSession) -> None:
        ix.put(*serving(POD_IPS, status={"plan": {"maxNumSeqs": 8}}))
        (body,) = ix.services[("team", "chat")]
        ix.put({**body, "kind": "InferenceService", "spec": {**body["spec"], "routing": {"strategy": "PrefixHash"}}})
        engines = [await Engine(f"e{i}", chunks=1, delay=0.01).start(ip) for i, ip in enumerate(POD_IPS)]

        async def turn(conversation: int, n: int) -> str:
            messages: list[dict[str, Any]] = [{"role": "user", "content": f"conversation {conversation} begins"}]
            messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": f"turn {n}"}] * n
            body = {"model": "SmolLM2", "messages": messages, "stream": True}
            async with http.post(url(base, path="chat/completions"), json=body) as r:
                assert r.status == 200
                return r.headers["X-Engine"]

        try:
            served = {c: [await turn(c, n) for n in range(4)] for c in range(12)}
        finally:
            for e in engines:
                await e.stop()
        assert all(len(set(names)) == 1 for names in served.values()), served
        assert len({names[0] for names in served.values()}) > 1  # conversations spread over engines

    run(scenario)
