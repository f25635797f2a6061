"""The engine behind the server: one thread owns the LLMEngine, asyncio handlers talk to it by queue.

LLMEngine is not thread-safe, and its step() blocks for the whole forward pass, so it runs in a
dedicated thread. Handlers hand it work through a thread-safe inbox (submit a group of sequences,
abort them, load or unload a LoRA adapter, stop); the thread drains the inbox between steps and
sends each step's outputs back to the event loop with one call_soon_threadsafe per step, into one
asyncio queue per HTTP request.

Admission control lives here too: sequences submitted but not yet scheduled are counted, and a
submission that would take that count past max_waiting_requests is refused at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from kvpilot.engine.contract.config import EngineConfig
from kvpilot.engine.core.request import Request
from kvpilot.engine.core.sampling_params import SamplingParams
from kvpilot.engine.core.scheduler import SchedulerStats
from kvpilot.engine.core.structured_output import StructuredOutput
from kvpilot.engine.llm_engine import LLMEngine
from kvpilot.engine.outputs import PositionLogprobs
from kvpilot.engine.serving.metrics import ServingMetrics

log = logging.getLogger(__name__)


class QueueFullError(Exception):
    """The waiting queue is full: the client should retry later (HTTP 429)."""


class EngineUnavailableError(Exception):
    """The engine cannot take requests: the model is loading, failed to load, or the engine crashed."""


class RequestFailedError(Exception):
    """Serving this request raised an error; the engine dropped the request and serves the others."""


@dataclass(frozen=True)
class SequenceUpdate:
    """What one sequence gained since its previous update (immutable: it crosses threads)."""

    index: int  # the sequence's place in its group: the OpenAI choice index
    text: str  # new text since the previous update (concatenated, the whole output text)
    num_output_tokens: int
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    num_cached_tokens: int  # prompt tokens served by the prefix cache
    logprobs: list[PositionLogprobs] | None = None  # one per new token, when asked for
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # on the first update, when asked for

    def then(self, later: SequenceUpdate) -> SequenceUpdate:
        """This update followed by a later one of the same sequence, as one update."""
        logprobs = self.logprobs if later.logprobs is None else (self.logprobs or []) + later.logprobs
        return dataclasses.replace(
            later,
            text=self.text + later.text,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs,
        )


@dataclass
class _Submit:
    stream: GenerationStream
    sequences: list[tuple[list[int], SamplingParams]]
    arrival_time: float
    accepted: asyncio.Future[None]
    cache_salt: str | None = None
    lora_name: str | None = None  # the LoRA adapter the sequences run with (None: the base model)


@dataclass
class _Call:
    """Run `fn` on the engine thread between steps (what changes the engine's adapters)."""

    fn: Callable[[LLMEngine], object]
    done: asyncio.Future[None]


@dataclass
class _Abort:
    stream: GenerationStream


_STOP = object()


class GenerationStream:
    """The updates of one HTTP request's sequences, in order.

    close() must be called when the consumer is done, however it ends: it aborts the sequences
    that have not finished (freeing their KV blocks at once) and stops counting the request as
    in flight. Iterating to the end closes it too.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, num_sequences: int) -> None:
        self.request_id = request_id
        self.engine_ids = [f"{request_id}-{i}" for i in range(num_sequences)]
        self._engine = engine
        # Updates not yet taken, merged per sequence: a consumer that falls behind (a slow client)
        # finds one update per sequence, not one per step, so memory does not grow with steps.
        self._pending: dict[int, SequenceUpdate] = {}
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self._unfinished = num_sequences
        self._closed = False

    async def __aiter__(self) -> AsyncIterator[SequenceUpdate]:
        try:
            while self._unfinished:
                await self._ready.wait()
                self._ready.clear()
                updates, self._pending = list(self._pending.values()), {}
                for update in updates:
                    if update.finish_reason is not None:
                        self._unfinished -= 1
                    yield update
                if self._error is not None:
                    raise self._error
        finally:
            self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._unfinished:
            self._engine._inbox.put(_Abort(self))
        self._engine._forget(self)

    def _put(self, item: SequenceUpdate | BaseException) -> None:
        if isinstance(item, BaseException):
            self._error = item
        else:
            earlier = self._pending.get(item.index)
            self._pending[item.index] = item if earlier is None else earlier.then(item)
        self._ready.set()


class AsyncEngine:
    def __init__(self, config: EngineConfig, metrics: ServingMetrics, max_waiting_requests: int) -> None:
        self.config = config
        self.metrics = metrics
        self.max_waiting_requests = max_waiting_requests
        self._inbox: queue.Queue[_Submit | _Abort | object] = queue.Queue()
        self._loaded = threading.Event()
        self._error: BaseException | None = None  # why the engine cannot serve: a failed load or a crash
        self._load_error: BaseException | None = None
        self._engine: LLMEngine | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # Sequences submitted and not yet scheduled; guarded because both threads change it.
        self._lock = threading.Lock()
        self._num_queued = 0
        # Engine thread only: engine request id -> its stream, and its index in the stream.
        self._streams: dict[str, GenerationStream] = {}
        self._index: dict[str, int] = {}
        self._in_hand: list[_Submit | _Abort | object] = []  # commands taken from the inbox this round
        # Event-loop side: requests in flight, for the drain on shutdown.
        self._active: set[GenerationStream] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._on_crash: Callable[[BaseException], None] | None = None
        # When the step in progress began (engine thread writes, the watchdog on /health reads).
        self._step_started: float | None = None
        # Event-loop side: the LoRA adapters served, name -> path (the engine thread's registry
        # holds the weights; this copy answers /v1/models and routes requests by model name).
        self.adapters: dict[str, str] = {}

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Load the model and run the loop in the engine thread; call from the event loop."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def on_crash(self, callback: Callable[[BaseException], None]) -> None:
        """Call `callback` on the event loop if the engine loop dies (the server exits non-zero)."""
        self._on_crash = callback

    def step_seconds(self) -> float | None:
        """How long the step in progress has been running; None between steps."""
        started = self._step_started
        return None if started is None else time.monotonic() - started

    def stop(self) -> None:
        if self._thread is not None:
            self._inbox.put(_STOP)
            self._thread.join()

    async def wait_loaded(self) -> BaseException | None:
        """Wait for the model to load; the error if it failed."""
        await asyncio.to_thread(self._loaded.wait)
        return self._load_error

    @property
    def ready(self) -> bool:
        return self._loaded.is_set() and self._error is None

    @property
    def alive(self) -> bool:
        return self._error is None

    @property
    def llm_engine(self) -> LLMEngine:
        """The loaded engine. Only its read-only facts and its tokenizer are used outside the engine
        thread (the tokenizer is safe to encode with while the engine thread decodes)."""
        if self._error is not None:
            raise EngineUnavailableError(str(self._error))
        if self._engine is None or not self._loaded.is_set():
            raise EngineUnavailableError("the model is still loading")
        return self._engine

    @property
    def max_model_len(self) -> int:
        return self.llm_engine.max_model_len

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self.llm_engine.tokenize(prompt)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        return self.llm_engine.apply_chat_template(messages)

    def compile_grammar(self, structured: StructuredOutput) -> None:
        """Compile (and cache) a structured output's grammar; ValueError for one that cannot be.
        Called from a worker thread, so that the engine thread finds it compiled."""
        self.llm_engine.grammars.compile(structured)

    def detokenize(self, token_ids: list[int]) -> str:
        return self.llm_engine.tokenizer.decode(token_ids, skip_special_tokens=True)

    # ---- the asyncio side --------------------------------------------------------------------

    async def submit(
        self,
        request_id: str,
        sequences: list[tuple[list[int], SamplingParams]],
        arrival_time: float,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> GenerationStream:
        """Queue sequences for generation. Raises QueueFullError, or ValueError for input the
        engine refuses (its message is meant for the client)."""
        if not self.ready:
            raise EngineUnavailableError(str(self._error) if self._error else "the model is still loading")
        with self._lock:
            if self._num_queued + len(sequences) > self.max_waiting_requests:
                self.metrics.on_rejected()
                raise QueueFullError(
                    f"the waiting queue is full ({self._num_queued} sequences waiting, "
                    f"max_waiting_requests={self.max_waiting_requests})"
                )
            self._num_queued += len(sequences)
        assert self._loop is not None
        stream = GenerationStream(self, request_id, len(sequences))
        accepted: asyncio.Future[None] = self._loop.create_future()
        self._inbox.put(_Submit(stream, sequences, arrival_time, accepted, cache_salt, lora_name))
        try:
            # Resolves right after add_request, before the step that first schedules the request.
            await asyncio.shield(accepted)
        except asyncio.CancelledError:
            stream.close()
            raise
        self._active.add(stream)
        self._idle.clear()
        return stream

    async def load_lora(self, name: str, path: str, replace: bool = False) -> None:
        """Serve the adapter at `path` as model `name`: read and checked in a worker thread (an
        AdapterError for one that cannot serve), then registered on the engine thread between steps.
        `replace`: in place of the adapter served as `name`, which serves on if the new one fails."""
        engine = self.llm_engine
        adapter = await asyncio.to_thread(engine.read_adapter, name, path)

        def register(e: LLMEngine) -> None:
            if replace and name in e.loras.names():
                e.remove_lora(name)
            e.add_lora(name, path, adapter)

        await self._on_engine_thread(register)
        self.adapters[name] = path

    async def unload_lora(self, name: str) -> None:
        """Stop serving adapter `name` (UnknownAdapterError if it is not served); its requests in
        flight finish with it."""
        await self._on_engine_thread(lambda e: e.remove_lora(name))
        self.adapters.pop(name, None)

    async def _on_engine_thread(self, fn: Callable[[LLMEngine], object]) -> None:
        if not self.ready:
            raise EngineUnavailableError(str(self._error) if self._error else "the model is still loading")
        assert self._loop is not None
        done: asyncio.Future[None] = self._loop.create_future()
        self._inbox.put(_Call(fn, done))
        await done

    @property
    def num_in_flight(self) -> int:
        return len(self._active)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight; False if some still are after `timeout` seconds."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def fail_in_flight(self, error: BaseException) -> None:
        """End every request in flight with `error` (their consumers see it) and free their blocks."""
        for stream in list(self._active):
            stream._put(error)
            stream.close()

    def _forget(self, stream: GenerationStream) -> None:
        self._active.discard(stream)
        if not self._active:
            self._idle.set()

    def _deliver(self, items: list[tuple[GenerationStream, SequenceUpdate | BaseException]]) -> None:
        for stream, item in items:
            stream._put(item)

    def _resolve(self, future: asyncio.Future[None], error: BaseException | None) -> None:
        if future.done():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    # ---- the engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._engine = LLMEngine(self.config)
        except BaseException as err:
            if not isinstance(err, ValueError):  # a ValueError is a bad setting, its message says all
                log.exception("event=engine_load_failed")
            self._error = self._load_error = err
            self._loaded.set()
            return
        # Loading leaves ~500k objects the collector tracks (torch's and transformers' modules), none
        # of them garbage later: a full collection over them holds the GIL ~0.3 s (twice that on a slow
        # machine), stalling /health and a decode step alike. Keep them out of every collection.
        gc.collect()
        gc.freeze()
        self.adapters = self._engine.loras.names()  # --lora-modules, loaded with the model
        self._publish_state(self._engine.stats(), {})
        self.metrics.on_engine_loaded(
            self.config.block_size, self._engine.runner.num_blocks, self.config.enable_prefix_caching
        )
        self._loaded.set()
        log.info(
            "event=engine_loaded model=%s max_model_len=%d kv_blocks=%d",
            self._engine.model_name,
            self._engine.max_model_len,
            self._engine.runner.num_blocks,
        )
        try:
            self._loop_forever(self._engine)
        except BaseException as err:
            log.exception("event=engine_crashed")
            self._error = err
            self._fail_everything(EngineUnavailableError(f"the engine crashed: {err!r}"))
            if self._on_crash is not None:
                self._call(self._on_crash, err)

    def _fail_everything(self, error: EngineUnavailableError) -> None:
        """Tell every stream and every pending submission; later submissions are refused by submit()."""
        failed: list[tuple[GenerationStream, SequenceUpdate | BaseException]] = [
            (s, error) for s in set(self._streams.values())
        ]
        commands = self._in_hand
        self._drain_inbox(commands)
        for command in commands:
            if isinstance(command, _Submit):
                self._call(self._resolve, command.accepted, error)  # a no-op for those already answered
            elif isinstance(command, _Call):
                self._call(self._resolve, command.done, error)
        if failed:
            self._call(self._deliver, failed)

    def _drain_inbox(self, commands: list[_Submit | _Abort | object]) -> None:
        """Move every command waiting in the inbox onto `commands`, without blocking."""
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return

    def _loop_forever(self, engine: LLMEngine) -> None:
        unscheduled: dict[str, Request] = {}
        while True:
            block = not engine.has_unfinished()
            commands = self._in_hand = [self._inbox.get()] if block else []
            self._drain_inbox(commands)
            for command in commands:
                if command is _STOP:
                    for stream in set(self._streams.values()):
                        self._abort(engine, stream, unscheduled)
                    return
                if isinstance(command, _Submit):
                    self._add(engine, command, unscheduled)
                elif isinstance(command, _Abort):
                    self._abort(engine, command.stream, unscheduled)
                elif isinstance(command, _Call):
                    self._run_call(engine, command)
            if engine.has_unfinished():
                self._step(engine, unscheduled)
            self._publish_state(engine.stats(), unscheduled)

    def _run_call(self, engine: LLMEngine, command: _Call) -> None:
        """A failed call is its caller's error (an adapter that cannot serve), not the engine's:
        it changed nothing that the steps use, so the engine serves on."""
        try:
            command.fn(engine)
        except Exception as err:
            if not isinstance(err, ValueError):  # a ValueError's message says all
                log.exception("event=engine_call_failed")
            self._call(self._resolve, command.done, err)
            return
        self._call(self._resolve, command.done, None)

    def _add(self, engine: LLMEngine, command: _Submit, unscheduled: dict[str, Request]) -> None:
        stream = command.stream
        added: list[Request] = []
        try:
            for engine_id, (prompt, params) in zip(stream.engine_ids, command.sequences):
                # Queue time and TTFT start when the server received the request, not when this
                # thread got round to it (it may have been busy with a step).
                added.append(
                    engine.add_request(
                        prompt,
                        params,
                        engine_id,
                        arrival_time=command.arrival_time,
                        cache_salt=command.cache_salt,
                        lora_name=command.lora_name,
                    )
                )
        except ValueError as err:
            for request in added:
                engine.abort(request.request_id)
            self._unqueue(len(command.sequences))
            self._call(self._resolve, command.accepted, err)
            return
        for index, request in enumerate(added):
            self._streams[request.request_id] = stream
            self._index[request.request_id] = index
            unscheduled[request.request_id] = request
            self.metrics.on_admitted(request.num_prompt_tokens, request.lora.name if request.lora else None)
        self._call(self._resolve, command.accepted, None)

    def _abort(self, engine: LLMEngine, stream: GenerationStream, unscheduled: dict[str, Request]) -> None:
        now = time.monotonic()
        for engine_id in stream.engine_ids:
            if self._streams.pop(engine_id, None) is None:
                continue  # finished already, or never admitted
            self._index.pop(engine_id, None)
            if unscheduled.pop(engine_id, None) is not None:
                self._unqueue(1)
            last = engine.abort(engine_id)
            if last is not None:
                self.metrics.on_finished(last, now, by_client=True)

    def _step(self, engine: LLMEngine, unscheduled: dict[str, Request]) -> None:
        self._step_started = time.monotonic()
        try:
            outputs = engine.step()
        finally:
            self._step_started = None
        now = time.monotonic()
        outbox: list[tuple[GenerationStream, SequenceUpdate | BaseException]] = []
        for output in outputs:
            engine_id = output.request_id
            stream = self._streams.get(engine_id)
            if stream is None:
                continue
            if output.new_token_ids:
                self.metrics.on_tokens(output, now)
            if output.error is not None:
                outbox.append((stream, RequestFailedError(output.error)))
            else:
                outbox.append(
                    (
                        stream,
                        SequenceUpdate(
                            index=self._index[engine_id],
                            text=output.text_delta,
                            num_output_tokens=output.num_output_tokens,
                            finish_reason=output.finish_reason,
                            num_cached_tokens=output.num_cached_tokens,
                            logprobs=output.logprobs,
                            prompt_logprobs=output.prompt_logprobs,
                        ),
                    )
                )
            if output.finished:
                self.metrics.on_finished(output, now)
                del self._streams[engine_id], self._index[engine_id]
        if outbox:
            self._call(self._deliver, outbox)

    def _publish_state(self, stats: SchedulerStats, unscheduled: dict[str, Request]) -> None:
        for engine_id, queued_s in stats.first_scheduled:
            if unscheduled.pop(engine_id, None) is not None:
                self._unqueue(1)
                self.metrics.on_scheduled(queued_s)
        self.metrics.set_state(stats)

    def _unqueue(self, n: int) -> None:
        with self._lock:
            self._num_queued -= n

    def _call(self, fn: Callable[..., object], *args: object) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the event loop has closed: nobody is left to tell
