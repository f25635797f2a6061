"""The engine thread's failure path: a crash ends every stream with an error, never a hang."""

from __future__ import annotations

import asyncio
import gc
import json
import time

import pytest

from kvpilot.engine.contract.config import EngineConfig, ServerConfig
from kvpilot.engine.core.sampling_params import SamplingParams
from kvpilot.engine.serving.api_server import OpenAIServer
from kvpilot.engine.serving.async_engine import AsyncEngine, EngineUnavailableError
from kvpilot.engine.serving.metrics import ServingMetrics
from tests.server.conftest import DTYPE, KV_BYTES


def test_engine_crash_fails_streams_and_later_submissions() -> None:
    async def scenario() -> None:
        engine = AsyncEngine(
            EngineConfig(kv_cache_memory_bytes=KV_BYTES, dtype=DTYPE), ServingMetrics("m"), max_waiting_requests=8
        )
        engine.start()
        assert await engine.wait_loaded() is None

        def broken_step() -> list:
            raise RuntimeError("device lost")

        engine.llm_engine.step = broken_step  # the next step the engine thread runs fails
        sequence = ([1, 2, 3], SamplingParams(max_tokens=4))
        stream = await engine.submit("r1", [sequence], time.monotonic())
        with pytest.raises(EngineUnavailableError, match="device lost"):
            async with asyncio.timeout(30):
                [u async for u in stream]
        assert not engine.alive and not engine.ready
        with pytest.raises(EngineUnavailableError):
            await engine.submit("r2", [sequence], time.monotonic())
        assert engine.num_in_flight == 0
        engine.stop()

    asyncio.run(scenario())


def test_a_loaded_engine_keeps_its_start_up_objects_out_of_the_collector() -> None:
    """A full collection scans only what serving allocates, not the ~500k objects of the load: a
    0.3-0.7 s GIL pause (a stalled /health, a slow decode step) otherwise."""

    async def scenario() -> None:
        engine = AsyncEngine(
            EngineConfig(kv_cache_memory_bytes=KV_BYTES, dtype=DTYPE), ServingMetrics("f"), max_waiting_requests=8
        )
        engine.start()
        try:
            assert await engine.wait_loaded() is None
            frozen, scanned = gc.get_freeze_count(), len(gc.get_objects())
            assert frozen > 100_000 and scanned < frozen / 4, (frozen, scanned)
        finally:
            engine.stop()
            gc.unfreeze()

    asyncio.run(scenario())


def test_engine_crash_makes_the_server_exit_non_zero() -> None:
    async def scenario() -> None:
        server = OpenAIServer(EngineConfig(kv_cache_memory_bytes=KV_BYTES, dtype=DTYPE), ServerConfig())
        exits: list[int] = []
        server.on_exit_requested(lambda: exits.append(server.exit_code))
        async with server.lifespan(server.build_app()):
            assert await server.engine.wait_loaded() is None

            def broken_step() -> list:
                raise RuntimeError("device lost")

            server.engine.llm_engine.step = broken_step
            stream = await server.engine.submit("r1", [([1, 2, 3], SamplingParams(max_tokens=4))], time.monotonic())
            with pytest.raises(EngineUnavailableError):
                async with asyncio.timeout(30):
                    [u async for u in stream]
            async with asyncio.timeout(10):
                while not exits:
                    await asyncio.sleep(0.01)
            assert exits == [1]
            assert (await server.health()).status_code == 503

    asyncio.run(scenario())


def test_a_stuck_engine_step_is_reported_by_health() -> None:
    async def scenario() -> None:
        server = OpenAIServer(
            EngineConfig(kv_cache_memory_bytes=KV_BYTES, dtype=DTYPE), ServerConfig(engine_step_timeout=0.5)
        )
        async with server.lifespan(server.build_app()):
            assert await server.engine.wait_loaded() is None
            engine = server.engine.llm_engine
            real_step = engine.step

            def slow_step() -> list:
                time.sleep(2.0)  # a hung kernel, a deadlock: the loop makes no progress
                return real_step()

            engine.step = slow_step
            stream = await server.engine.submit("r1", [([1, 2, 3], SamplingParams(max_tokens=2))], time.monotonic())
            await asyncio.sleep(1.0)
            stuck = await server.health()
            assert stuck.status_code == 503 and json.loads(stuck.body)["status"] == "engine stuck"
            engine.step = real_step
            async with asyncio.timeout(30):
                [u async for u in stream]
            assert (await server.health()).status_code == 200

    asyncio.run(scenario())
