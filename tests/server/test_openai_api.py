"""The official `openai` client against a real server: answers equal the offline engine's."""

from __future__ import annotations

import asyncio

import httpx

from kvpilot.engine import LLM, SamplingParams
from tests.server.conftest import MODEL, Server, wait_until

PROMPT = "The three primary colors are"
CHAT = [{"role": "user", "content": "Name a fruit that is yellow."}]


def greedy(max_tokens: int, **kwargs: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)


def test_health_ready_and_models(server: Server) -> None:
    assert server.http.get("/health").json() == {"status": "ok"}
    assert server.http.get("/ready").json() == {"status": "ready"}
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_equals_offline(server: Server, llm: LLM) -> None:
    ref = llm.generate(PROMPT, greedy(12))[0]
    out = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert out.object == "text_completion" and out.model == MODEL
    assert [c.text for c in out.choices] == [ref.outputs[0].text]
    assert out.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_completion_stream_equals_offline(server: Server, llm: LLM) -> None:
    ref = llm.generate(PROMPT, greedy(12))[0].outputs[0]
    chunks = list(
        server.client().completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 1, "a 12-token answer must arrive in several chunks"
    assert "".join(c.choices[0].text for c in text_chunks) == ref.text
    assert [c.choices[0].finish_reason for c in text_chunks] == [None] * (len(text_chunks) - 1) + [ref.finish_reason]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == len(ref.token_ids)


def test_completion_token_id_and_batch_prompts(server: Server, llm: LLM) -> None:
    prompts = [PROMPT, "Water boils at"]
    refs = llm.generate(prompts, greedy(6))
    ids = llm.tokenizer.encode(prompts[1], add_special_tokens=False)
    out = server.client().completions.create(
        model=MODEL, prompt=[prompts[0]] + [prompts[1]], max_tokens=6, temperature=0
    )
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [r.outputs[0].text for r in refs]
    by_ids = server.client().completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == refs[1].outputs[0].text


def test_chat_equals_offline(server: Server, llm: LLM) -> None:
    ref = llm.chat(CHAT, greedy(12))[0].outputs[0]
    client = server.client()
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.text
    assert out.usage.completion_tokens == len(ref.token_ids)

    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason


def test_chat_max_completion_tokens_and_content_parts(server: Server, llm: LLM) -> None:
    ref = llm.chat(CHAT, greedy(5))[0].outputs[0]
    parts = [{"role": "user", "content": [{"type": "text", "text": CHAT[0]["content"]}]}]
    out = server.client().chat.completions.create(model=MODEL, messages=parts, max_completion_tokens=5, temperature=0)
    assert out.choices[0].message.content == ref.text
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 5


def test_stop_string_cuts_and_never_leaks(server: Server, llm: LLM) -> None:
    full = llm.generate(PROMPT, greedy(16, ignore_eos=True))[0].outputs[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 4]
    assert stop.strip(), f"pick a visible stop string from {full!r}"
    expected = full[: full.find(stop)]
    client = server.client()
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop, "never-there"]
    )
    assert out.choices[0].text == expected
    assert out.choices[0].finish_reason == "stop"
    chunks = list(
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=stop, stream=True)
    )
    streamed = [c.choices[0].text for c in chunks]
    assert "".join(streamed) == expected
    # No prefix of the stop string was sent early and then "taken back".
    assert all(stop not in "".join(streamed[: i + 1]) for i in range(len(streamed)))
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_n2_with_seed_is_reproducible_and_equals_offline(server: Server, llm: LLM) -> None:
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=7, n=2)
    ref = [o.text for o in llm.generate(PROMPT, params)[0].outputs]
    client = server.client()
    first = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=7, n=2)
    again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=7, n=2)
    assert sorted(c.index for c in first.choices) == [0, 1]
    assert [c.text for c in first.choices] == ref
    assert [c.text for c in again.choices] == ref
    assert first.usage.prompt_tokens == len(llm.tokenizer.encode(PROMPT, add_special_tokens=False))
    assert first.usage.completion_tokens == 12

    chunks = list(
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=7, n=2, stream=True)
    )
    streamed = ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(2)]
    assert streamed == ref


def test_32_concurrent_streams_each_get_their_own_answer(server: Server, llm: LLM) -> None:
    prompts = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(32)]
    refs = [o.outputs[0].text for o in llm.generate(prompts, greedy(6))]

    async def one(client, prompt: str) -> str:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, stream=True)
        pieces = [chunk.choices[0].text async for chunk in stream]
        return "".join(pieces)

    async def run_all() -> list[str]:
        async with server.async_client() as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    answers = asyncio.run(run_all())
    mismatched = [(i, a, r) for i, (a, r) in enumerate(zip(answers, refs)) if a != r]
    assert not mismatched, f"streams answered wrongly (index, got, want): {mismatched}"


def test_client_disconnect_frees_kv_blocks(server: Server) -> None:
    aborts_before = server.metric("kvpilot_request_success_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: ")).startswith("data: {")
            wait_until(lambda: server.metric("kvpilot_num_requests_running") == 1, 30, "the request to be running")
            assert server.metric("kvpilot_kv_cache_usage_ratio") > 0
        # Leaving the block closes the connection mid-stream.
    wait_until(lambda: server.metric("kvpilot_num_requests_running") == 0, 30, "running to return to 0")
    wait_until(lambda: server.metric("kvpilot_kv_cache_usage_ratio") == 0, 30, "KV usage to return to 0")
    assert server.metric("kvpilot_request_success_total", finished_reason="abort") == aborts_before + 1


def test_non_streaming_client_that_gives_up_frees_kv_blocks(server: Server) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "temperature": 0}

    async def give_up() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            request = asyncio.create_task(http.post("/v1/completions", json=body))
            while (await http.get("/metrics")).text.count(f'kvpilot_num_requests_running{{model="{MODEL}"}} 1.0') == 0:
                assert not request.done(), "the request ended before it could be abandoned"
                await asyncio.sleep(0.05)
            request.cancel()  # closes the connection before the answer

    asyncio.run(give_up())
    wait_until(lambda: server.metric("kvpilot_num_requests_running") == 0, 30, "running to return to 0")
    wait_until(lambda: server.metric("kvpilot_kv_cache_usage_ratio") == 0, 30, "KV usage to return to 0")
