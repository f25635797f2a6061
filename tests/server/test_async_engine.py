"""The engine thread's failure path: a crash ends every stream with an error, never a hang."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvpilot.engine.serving.async_engine import AsyncEngine, EngineUnavailableError
from kvpilot.engine.config import EngineConfig
from kvpilot.engine.serving.metrics import ServingMetrics
from kvpilot.engine.core.sampling_params import SamplingParams
from tests.server.conftest import KV_BYTES


def test_engine_crash_fails_streams_and_later_submissions() -> None:
    async def scenario() -> None:
        engine = AsyncEngine(EngineConfig(kv_cache_memory_bytes=KV_BYTES), ServingMetrics("m"), max_waiting_requests=8)
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
