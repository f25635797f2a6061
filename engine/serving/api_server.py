"""`kvpilot serve`: the OpenAI-compatible HTTP server over the AsyncEngine.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, and with --enable-lora
POST /v1/load_lora_adapter and /v1/unload_lora_adapter as vLLM's (behind the API key when one is
set); GET /health (process alive), GET /ready (model loaded and not draining), GET /metrics. A
request names a LoRA adapter as its `model`; /v1/models lists each beside the base model.

Errors are answered in OpenAI's shape (errors.py), responses are shaped in responses.py, and the
engine runs in its own thread behind async_engine.py. Shutdown drains: the first SIGTERM or SIGINT
turns readiness false and refuses new requests with 503, in-flight requests run to completion within
the grace period, then the process exits 0; a second signal exits at once.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager

import jinja2
import prometheus_client
import uvicorn
import uvloop
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvpilot.engine.contract.config import EMBEDDED_MODEL, EngineConfig, ServerConfig
from kvpilot.engine.core.sampling_params import SamplingParams
from kvpilot.engine.core.structured_output import StructuredOutput
from kvpilot.engine.lora.adapter import AdapterNotFoundError
from kvpilot.engine.lora.registry import UnknownAdapterError
from kvpilot.engine.serving.async_engine import (
    AsyncEngine,
    EngineUnavailableError,
    GenerationStream,
    QueueFullError,
    RequestFailedError,
    SequenceUpdate,
)
from kvpilot.engine.serving.errors import RETRY_AFTER_S, APIError, install_error_handlers
from kvpilot.engine.serving.metrics import ServingMetrics
from kvpilot.engine.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    UnloadLoRAAdapterRequest,
)
from kvpilot.engine.serving.responses import SSE_HEADERS, ChatCompletionFormat, CompletionFormat, Format, sse, usage

log = logging.getLogger(__name__)


class _ApiKeyMiddleware:
    """Bearer-token check on /v1/*, ahead of routing, so that no body is parsed for a stranger."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                error = APIError(
                    401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.", code="invalid_api_key"
                )
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _BodyLimitMiddleware:
    """413 for bodies over the limit, counted as they arrive (a missing or lying Content-Length
    does not help), before anything parses them."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._too_large().response()(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise StarletteHTTPException(413, self._too_large().message)
            return message

        await self.app(scope, limited_receive, send)

    def _too_large(self) -> APIError:
        return APIError(
            413, f"the request body is larger than max_request_body_bytes={self.limit}", code="request_too_large"
        )


class _StreamingResponse(StreamingResponse):
    """A stream whose client stops reading is aborted after `write_timeout` seconds of blocked
    writes, so its request's KV blocks and output do not wait on it forever."""

    def __init__(self, content: AsyncIterator[str], write_timeout: float, request_id: str) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self.write_timeout = write_timeout
        self.request_id = request_id

    async def stream_response(self, send: Send) -> None:
        async def timed_send(message: Message) -> None:
            # A deadline on this task, not wait_for's task per message: this runs for every token.
            try:
                async with asyncio.timeout(self.write_timeout):
                    await send(message)
            except TimeoutError:
                raise _ClientStalled from None

        try:
            await super().stream_response(timed_send)
        except _ClientStalled:
            log.warning(
                "event=stream_aborted id=%s reason=client_not_reading write_timeout_s=%g",
                self.request_id,
                self.write_timeout,
            )
            await self.body_iterator.aclose()  # type: ignore[attr-defined] - runs its finally: the engine drops the request


class _ClientStalled(Exception):
    pass


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next message the server can send is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---- the server ----------------------------------------------------------------------------------


class OpenAIServer:
    def __init__(self, config: EngineConfig, settings: ServerConfig) -> None:
        if settings.served_model_name is None:
            settings = settings.model_copy(update={"served_model_name": config.model or EMBEDDED_MODEL})
        self.settings = settings
        self.metrics = ServingMetrics(settings.served_model_name, settings.vllm_compatible_metrics)
        self.enable_lora = config.enable_lora
        if config.enable_lora:
            self.metrics.on_lora_enabled(config.max_loras)
        self.engine = AsyncEngine(config, self.metrics, settings.max_waiting_requests)
        self.engine.on_crash(self._on_engine_crash)
        self.draining = False
        self.exit_code = 0
        self.started = int(time.time())
        self._request_exit: Callable[[], None] = lambda: None
        self._background: set[asyncio.Task[None]] = set()

    # ---- lifecycle -------------------------------------------------------------------------

    def on_exit_requested(self, request_exit: Callable[[], None]) -> None:
        self._request_exit = request_exit

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._background.discard)

    def _on_engine_crash(self, error: BaseException) -> None:
        # Nothing in this process can bring the engine back: exit so that the pod restarts now,
        # rather than answering 503 until a liveness probe gives up.
        log.error("event=exit reason=engine_crashed error=%r", error)
        self.exit_code = 1
        self._request_exit()

    async def _watch_load(self) -> None:
        error = await self.engine.wait_loaded()
        if error is not None:
            log.error("event=exit reason=model_load_failed error=%r", error)
            self.exit_code = 1
            self._request_exit()

    def begin_drain(self) -> None:
        if not self.draining:
            self.draining = True
            self._spawn(self._drain())

    async def _drain(self) -> None:
        grace = self.settings.grace_period
        log.info("event=drain_start in_flight=%d grace_period_s=%g", self.engine.num_in_flight, grace)
        if not await self.engine.wait_idle(grace):
            log.warning("event=drain_timeout aborted=%d", self.engine.num_in_flight)
            self.engine.fail_in_flight(EngineUnavailableError("the server is shutting down"))
        log.info("event=drain_done")
        self._request_exit()

    @asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        self.engine.start()
        self._spawn(self._watch_load())
        yield
        await asyncio.to_thread(self.engine.stop)

    # ---- the app ---------------------------------------------------------------------------

    def build_app(self) -> FastAPI:
        prometheus_client.disable_created_metrics()  # `_created` series only double the scrape
        app = FastAPI(lifespan=self.lifespan, docs_url=None, redoc_url=None, openapi_url=None)
        install_error_handlers(app)
        if self.settings.api_key:
            app.add_middleware(_ApiKeyMiddleware, api_key=self.settings.api_key)
        # Added last, so it runs first: an oversized body is refused before anything reads it.
        app.add_middleware(_BodyLimitMiddleware, limit=self.settings.max_request_body_bytes)
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/ready", self.ready, methods=["GET"])
        app.add_api_route("/metrics", self.metrics_endpoint, methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_api_route("/v1/load_lora_adapter", self.load_lora_adapter, methods=["POST"])
        app.add_api_route("/v1/unload_lora_adapter", self.unload_lora_adapter, methods=["POST"])
        return app

    async def health(self) -> JSONResponse:
        if not self.engine.alive:
            return JSONResponse({"status": "engine failed"}, status_code=503)
        running = self.engine.step_seconds()
        if running is not None and running > self.settings.engine_step_timeout:
            return JSONResponse(
                {
                    "status": "engine stuck",
                    "step_seconds": round(running, 1),
                    "engine_step_timeout": self.settings.engine_step_timeout,
                },
                status_code=503,
            )
        return JSONResponse({"status": "ok"})

    async def ready(self) -> JSONResponse:
        if self.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not self.engine.ready:
            return JSONResponse({"status": "loading" if self.engine.alive else "engine failed"}, status_code=503)
        return JSONResponse({"status": "ready"})

    async def metrics_endpoint(self) -> Response:
        return Response(
            prometheus_client.generate_latest(self.metrics.registry), media_type=prometheus_client.CONTENT_TYPE_LATEST
        )

    async def models(self) -> ModelList:
        max_len = self.engine.max_model_len if self.engine.ready else None
        base = self.settings.served_model_name
        adapters = [
            ModelCard(id=name, created=self.started, root=path, parent=base, max_model_len=max_len)
            for name, path in self.engine.adapters.items()
        ]
        return ModelList(data=[ModelCard(id=base, created=self.started, max_model_len=max_len), *adapters])

    async def load_lora_adapter(self, body: LoadLoRAAdapterRequest) -> Response:
        """As vLLM's: 404 for no adapter at the path, 400 for one that cannot serve or a name taken."""
        name = body.lora_name
        self._check_lora_route()
        if name == self.settings.served_model_name:
            raise APIError(400, f"an adapter cannot take the base model's name {name!r}", param="lora_name")
        if name in self.engine.adapters and not body.load_inplace:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        try:
            await self.engine.load_lora(name, body.lora_path, replace=body.load_inplace)
        except AdapterNotFoundError as err:
            raise APIError(404, str(err), param="lora_path", code="adapter_not_found") from err
        except ValueError as err:
            raise APIError(400, str(err), param="lora_path", code="invalid_adapter") from err
        log.info("event=lora_adapter_loaded name=%s path=%s", name, body.lora_path)
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    async def unload_lora_adapter(self, body: UnloadLoRAAdapterRequest) -> Response:
        self._check_lora_route()
        try:
            await self.engine.unload_lora(body.lora_name)
        except UnknownAdapterError as err:
            raise APIError(404, str(err), param="lora_name", code="adapter_not_found") from err
        log.info("event=lora_adapter_unloaded name=%s", body.lora_name)
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")

    def _check_lora_route(self) -> None:
        if not self.enable_lora:
            raise APIError(400, "this server serves no LoRA adapters: start it with --enable-lora")
        if self.draining or not self.engine.ready:
            raise APIError(503, "the server is not ready to load adapters", retry_after=RETRY_AFTER_S)

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        self._check_request(body)
        prompt = body.prompt
        if isinstance(prompt, str):
            texts_or_ids: list[str | list[int]] = [prompt]
        elif isinstance(prompt[0], int):
            texts_or_ids = [prompt]
        else:
            texts_or_ids = list(prompt)
        self._check_sizes(len(texts_or_ids), body, "prompt")
        for p in texts_or_ids:
            if isinstance(p, str):
                self._check_chars(len(p), "prompt")
        prompts = await asyncio.to_thread(lambda: [self.engine.tokenize(p) for p in texts_or_ids])
        echo_texts = first_tokens = None
        if body.echo:
            echo_texts, first_tokens = await asyncio.to_thread(
                lambda: (
                    [p if isinstance(p, str) else self.engine.detokenize(p) for p in texts_or_ids],
                    [self.engine.detokenize(ids[:1]) for ids in prompts],
                )
            )
        fmt = CompletionFormat(
            f"cmpl-{uuid.uuid4().hex}",
            body.model,
            n=body.n,
            echo_texts=echo_texts,
            first_tokens=first_tokens,
        )
        return await self._generate(request, body, prompts, body.max_tokens, "prompt", fmt, arrival)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        self._check_request(body)
        self._check_sizes(1, body, "messages")
        messages = [m.for_template() for m in body.messages]
        self._check_chars(sum(len(m["content"]) for m in messages), "messages")
        try:
            ids = await asyncio.to_thread(self.engine.apply_chat_template, messages)
        except jinja2.TemplateError as err:  # the template's own words about a conversation it refuses
            raise APIError(
                400, f"the model's chat template refuses this conversation: {err}", param="messages"
            ) from err
        except Exception as err:
            log.warning("event=chat_template_failed error=%r", err)
            raise APIError(
                400, "the conversation cannot be rendered with the model's chat template", param="messages"
            ) from err
        fmt = ChatCompletionFormat(f"chatcmpl-{uuid.uuid4().hex}", body.model)
        return await self._generate(request, body, [ids], body.requested_max_tokens, "messages", fmt, arrival)

    # ---- shared request path -----------------------------------------------------------------

    def _check_request(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down; retry on another replica", retry_after=RETRY_AFTER_S)
        if not self.engine.ready:
            raise APIError(
                503,
                "the model is not loaded" + ("" if self.engine.alive else ": the engine failed"),
                retry_after=RETRY_AFTER_S,
            )
        if body.model != self.settings.served_model_name and body.model not in self.engine.adapters:
            raise APIError(
                404,
                f"The model `{body.model}` does not exist; this server serves `{self.settings.served_model_name}`"
                + "".join(f", `{name}`" for name in self.engine.adapters)
                + ".",
                param="model",
                code="model_not_found",
            )
        unsupported = body.unsupported_field()
        if unsupported:
            raise APIError(
                400, f"`{unsupported}` is not supported by this server", param=unsupported, code="unsupported_parameter"
            )

    def _check_sizes(
        self, num_prompts: int, body: CompletionRequest | ChatCompletionRequest, prompt_param: str
    ) -> None:
        """Limits that need no tokenizing, checked before any: sequences and stop strings."""
        limits = self.settings
        sequences = num_prompts * body.n
        if sequences > limits.max_waiting_requests:
            # It could never be admitted: a client error, not a reason to retry.
            raise APIError(
                400,
                f"{num_prompts} prompt(s) x n={body.n} is {sequences} sequences, more than "
                f"max_waiting_requests={limits.max_waiting_requests}",
                param="n" if body.n > 1 else prompt_param,
                code="too_many_sequences",
            )
        stops = body.stop_strings
        if len(stops) > limits.max_stop_strings:
            raise APIError(
                400, f"{len(stops)} stop strings, more than max_stop_strings={limits.max_stop_strings}", param="stop"
            )
        longest = max(map(len, stops), default=0)
        if longest > limits.max_stop_string_chars:
            raise APIError(
                400,
                f"a stop string of {longest} characters, more than max_stop_string_chars="
                f"{limits.max_stop_string_chars}",
                param="stop",
            )

    def _check_chars(self, num_chars: int, prompt_param: str) -> None:
        if num_chars > self.settings.max_prompt_chars:
            raise APIError(
                400,
                f"the {prompt_param} has {num_chars} characters, more than max_prompt_chars="
                f"{self.settings.max_prompt_chars}",
                param=prompt_param,
                code="prompt_too_long",
            )

    def _sampling_params(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        prompts: list[list[int]],
        max_tokens: int | None,
        prompt_param: str,
        structured: StructuredOutput | None,
    ) -> list[SamplingParams]:
        max_len = self.engine.max_model_len
        sequences = []
        for prompt in prompts:
            # Without max_tokens, the rest of the context (at least one token, so a full prompt fails).
            wanted = max_tokens if max_tokens is not None else max(max_len - len(prompt), 1)
            if len(prompt) + wanted > max_len:
                raise APIError(
                    400,
                    f"This model's maximum context length is {max_len} tokens. However, you requested "
                    f"{len(prompt) + wanted} tokens ({len(prompt)} in the {prompt_param}, "
                    f"{wanted} for the completion). "
                    f"Please reduce the length of the {prompt_param} or max_tokens.",
                    param="max_tokens" if max_tokens is not None and len(prompt) < max_len else prompt_param,
                    code="context_length_exceeded",
                )
            try:
                params = SamplingParams(
                    max_tokens=wanted,
                    temperature=body.temperature,
                    top_k=body.top_k,
                    top_p=body.top_p,
                    seed=body.seed,
                    stop=body.stop_strings,
                    stop_token_ids=list(body.stop_token_ids or []),
                    ignore_eos=body.ignore_eos,
                    n=body.n,
                    min_tokens=min(body.min_tokens, wanted),
                    presence_penalty=body.presence_penalty,
                    frequency_penalty=body.frequency_penalty,
                    repetition_penalty=body.repetition_penalty,
                    min_p=body.min_p,
                    logprobs=body.num_logprobs,
                    prompt_logprobs=body.num_logprobs if isinstance(body, CompletionRequest) and body.echo else None,
                    structured=structured,
                )
            except ValueError as err:
                raise APIError(400, str(err)) from err
            sequences += params.per_sequence()
        return sequences

    async def _generate(
        self,
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        prompts: list[list[int]],
        max_tokens: int | None,
        prompt_param: str,
        fmt: Format,
        arrival: float,
    ) -> Response:
        structured, structured_param = body.structured_output()
        params = self._sampling_params(body, prompts, max_tokens, prompt_param, structured)
        if structured is not None:
            try:
                # Off the event loop and the engine thread; the engine finds it in the cache.
                await asyncio.to_thread(self.engine.compile_grammar, structured)
            except ValueError as err:
                raise APIError(400, str(err), param=structured_param, code="invalid_structured_output") from err
        sequences = [(prompts[i // body.n], p) for i, p in enumerate(params)]
        lora = None if body.model == self.settings.served_model_name else body.model
        try:
            stream = await self.engine.submit(
                fmt.request_id, sequences, arrival, cache_salt=body.cache_salt, lora_name=lora
            )
        except UnknownAdapterError as err:  # unloaded since _check_request saw it
            raise APIError(404, str(err), param="model", code="model_not_found") from err
        except QueueFullError as err:
            raise APIError(429, str(err), code="queue_full", retry_after=RETRY_AFTER_S) from err
        except EngineUnavailableError as err:
            raise APIError(503, str(err), retry_after=RETRY_AFTER_S) from err
        except ValueError as err:
            raise APIError(400, str(err), param=prompt_param) from err
        log.debug(
            "event=request id=%s prompts=%d prompt_tokens=%d n=%d stream=%s",
            fmt.request_id,
            len(prompts),
            sum(map(len, prompts)),
            body.n,
            body.stream,
        )
        if body.stream:
            events = self._stream_events(stream, fmt, prompts, body)
            return _StreamingResponse(events, self.settings.stream_write_timeout, fmt.request_id)
        return await self._complete(request, stream, fmt, prompts, body.n)

    async def _stream_events(
        self,
        stream: GenerationStream,
        fmt: Format,
        prompts: list[list[int]],
        body: CompletionRequest | ChatCompletionRequest,
    ) -> AsyncIterator[str]:
        finals: list[SequenceUpdate] = []
        try:
            try:
                for chunk in fmt.preamble(len(stream.engine_ids)):
                    yield sse(chunk)
                async for update in stream:
                    finished = update.finish_reason is not None
                    if finished:
                        finals.append(update)
                    if update.text or finished or update.logprobs:
                        yield sse(fmt.chunk(update))
                if body.include_usage:
                    yield sse(fmt.usage_chunk(usage(prompts, finals, body.n)))
            except EngineUnavailableError as err:
                # Headers are sent already: the error travels as an event, as OpenAI's API does.
                yield sse(APIError(503, str(err)).body())
            except RequestFailedError as err:
                yield sse(APIError(500, str(err)).body())
            yield "data: [DONE]\n\n"
        finally:
            # However the stream ends (done, client gone, server cancelling), free the KV blocks now.
            stream.close()

    async def _complete(
        self, request: Request, stream: GenerationStream, fmt: Format, prompts: list[list[int]], n: int
    ) -> Response:
        async def collect() -> list[SequenceUpdate]:
            finals = []
            whole: dict[int, SequenceUpdate] = {}
            async for update in stream:
                earlier = whole.get(update.index)
                whole[update.index] = update if earlier is None else earlier.then(update)
                if update.finish_reason is not None:
                    finals.append(whole[update.index])
            return finals

        result = asyncio.ensure_future(collect())
        disconnect = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({result, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnect.cancel()
            if not result.done():
                result.cancel()
            stream.close()
        if not result.done() or result.cancelled():
            log.debug("event=client_gone id=%s", fmt.request_id)
            return Response(status_code=499)  # nobody reads it; nginx's code for "client closed"
        try:
            finals = sorted(result.result(), key=lambda u: u.index)
        except EngineUnavailableError as err:
            raise APIError(503, str(err)) from err
        except RequestFailedError as err:
            raise APIError(500, str(err)) from err
        return JSONResponse(fmt.response(finals, usage(prompts, finals, n)).model_dump())


class _DrainingServer(uvicorn.Server):
    """uvicorn stops at once on SIGTERM; a pod must drain first. The first SIGTERM or SIGINT
    starts the drain (which sets should_exit when done), a second one exits at once."""

    def __init__(self, config: uvicorn.Config, on_first_signal: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_first_signal = on_first_signal
        self._signalled = False

    def handle_exit(self, sig: int, frame: object) -> None:
        # Not recording the signal keeps uvicorn from re-raising it after shutdown: exit code 0.
        if self._signalled:
            self.should_exit = self.force_exit = True
            return
        self._signalled = True
        self._on_first_signal()


def serve(config: EngineConfig, settings: ServerConfig) -> int:
    server = OpenAIServer(config, settings)
    settings = server.settings
    app = server.build_app()
    uv_config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=5,
        lifespan="on",
        # httptools (C) rather than h11 (pure Python): with uvloop, the event loop parses and writes
        # in C, CPU per streamed token it would otherwise take from the engine's threads
        # (bench/history/2026-12-02-serving-cpu-decode.md, "Where a served token's host time goes").
        http="httptools",
    )
    uv_server: _DrainingServer

    def begin_drain() -> None:
        # Called from a signal handler: hand over to the event loop.
        loop.call_soon_threadsafe(server.begin_drain)

    def request_exit() -> None:
        uv_server.should_exit = True

    uv_server = _DrainingServer(uv_config, begin_drain)
    server.on_exit_requested(request_exit)
    loop = uvloop.new_event_loop()
    log.info(
        "event=start model=%s host=%s port=%d api_key=%s max_waiting_requests=%d",
        settings.served_model_name,
        settings.host,
        settings.port,
        "set" if settings.api_key else "unset",
        settings.max_waiting_requests,
    )
    try:
        loop.run_until_complete(uv_server.serve())
    finally:
        loop.close()
    log.info("event=exit code=%d", server.exit_code)
    return server.exit_code
