"""The serving baseline: plain HuggingFace transformers behind HTTP, one request at a time.

What a team gets by wrapping `model.generate()` in a web server: no batching, no paged KV, each
request waits for the one before it. It speaks just enough of /v1/completions (token-id or text
prompt, max_tokens, ignore_eos, greedy, streaming with usage) for `python -m bench.serve`.

    python -m bench.hf_server --port 8001 [--model PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator

import torch
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from kvpilot.engine.contract.config import EMBEDDED_MODEL
from kvpilot.engine.model.loader import load_tokenizer, resolve_model
from kvpilot.engine.serving.protocol import CompletionChoice, CompletionResponse, Usage


class BaselineRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    prompt: str | list[int]
    max_tokens: int = Field(16, ge=1)
    ignore_eos: bool = False
    stream: bool = False


class _QueueStreamer(BaseStreamer):
    """Hands each generated token to the event loop; generate() calls put() with the prompt first."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[int | None]) -> None:
        self._loop, self._queue, self._seen_prompt = loop, queue, False

    def put(self, value: torch.Tensor) -> None:
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        for token in value.flatten().tolist():
            self._loop.call_soon_threadsafe(self._queue.put_nowait, token)

    def end(self) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, None)


class _Cancelled(StoppingCriteria):
    def __init__(self, cancelled: threading.Event) -> None:
        self._cancelled = cancelled

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: object) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self._cancelled.is_set(), dtype=torch.bool)


def build_app(model_path: str | None) -> FastAPI:
    path = resolve_model(model_path)
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    name = model_path or EMBEDDED_MODEL
    one_at_a_time = asyncio.Lock()
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    async def tokens(body: BaselineRequest, cancelled: threading.Event) -> AsyncIterator[int]:
        ids = body.prompt if isinstance(body.prompt, list) else tokenizer.encode(body.prompt, add_special_tokens=False)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[int | None] = asyncio.Queue()

        def generate() -> None:
            with torch.inference_mode():
                model.generate(
                    torch.tensor([ids]),
                    max_new_tokens=body.max_tokens,
                    min_new_tokens=body.max_tokens if body.ignore_eos else 0,
                    do_sample=False,
                    pad_token_id=tokenizer.eos_token_id,
                    streamer=_QueueStreamer(loop, queue),
                    stopping_criteria=StoppingCriteriaList([_Cancelled(cancelled)]),
                )

        async with one_at_a_time:
            worker = asyncio.ensure_future(asyncio.to_thread(generate))
            while (token := await queue.get()) is not None:
                yield token
            await worker

    async def events(body: BaselineRequest, request_id: str, num_prompt: int) -> AsyncIterator[str]:
        cancelled = threading.Event()
        created, count = int(time.time()), 0
        try:
            async for token in tokens(body, cancelled):
                count += 1
                finish = "length" if count == body.max_tokens else None
                chunk = CompletionResponse(
                    id=request_id,
                    created=created,
                    model=name,
                    choices=[CompletionChoice(index=0, text=tokenizer.decode([token]), finish_reason=finish)],
                )
                yield f"data: {chunk.model_dump_json()}\n\n"
            usage = Usage(prompt_tokens=num_prompt, completion_tokens=count, total_tokens=num_prompt + count)
            final = CompletionResponse(id=request_id, created=created, model=name, choices=[], usage=usage)
            yield f"data: {final.model_dump_json()}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            cancelled.set()  # a client that left stops the generation at its next token

    @app.post("/v1/completions")
    async def completions(body: BaselineRequest) -> Response:
        request_id = f"cmpl-{uuid.uuid4().hex}"
        num_prompt = (
            len(body.prompt)
            if isinstance(body.prompt, list)
            else len(tokenizer.encode(body.prompt, add_special_tokens=False))
        )
        if body.stream:
            return StreamingResponse(events(body, request_id, num_prompt), media_type="text/event-stream")
        out = [t async for t in tokens(body, threading.Event())]
        response = CompletionResponse(
            id=request_id,
            model=name,
            choices=[
                CompletionChoice(
                    index=0,
                    text=tokenizer.decode(out),
                    finish_reason="length" if len(out) == body.max_tokens else "stop",
                )
            ],
            usage=Usage(prompt_tokens=num_prompt, completion_tokens=len(out), total_tokens=num_prompt + len(out)),
        )
        return JSONResponse(response.model_dump())

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--model", default=None, help="a local HF folder (default: the embedded model)")
    args = parser.parse_args()
    uvicorn.run(build_app(args.model), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
