"""A bounded open-loop load generator for engines on loopback.

Requests arrive at `rate` per second whatever the engines do (open loop: a slow engine does not slow
the arrivals, as with real users), each a streamed completion sent round-robin to the engines
`targets()` returns at that moment (what a Service would balance over). At most `max_in_flight`
are outstanding: an arrival beyond that is counted as shed, so the generator itself stays bounded.
Every request records when it started, its engine, its TTFT, and its error if any.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from e2e.polling import Background


@dataclass(frozen=True)
class Result:
    start: float  # time.monotonic()
    target: str
    ttft_s: float | None
    error: str | None = None
    # The stream's finish_reason: "length" for one served whole (ignore_eos, max_tokens); None for
    # one cut short, "abort" or an error event for one the engine gave up on.
    finish_reason: str | None = None


def p95(values: Sequence[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]


class Load(Background):
    """Use as a context manager; `rate` may change while it runs (0 stops the arrivals)."""

    def __init__(
        self,
        targets: Callable[[], Sequence[str]],
        model: str,
        rate: float,
        *,
        max_in_flight: int = 16,
        prompt: str = "Write a short story about a lighthouse keeper and a storm.",
        max_tokens: int = 32,
        api_key: str | None = None,
        unique_prompts: bool = False,
    ) -> None:
        super().__init__("load")
        self.targets, self.model, self.rate = targets, model, rate
        self.max_in_flight, self.prompt, self.max_tokens = max_in_flight, prompt, max_tokens
        # Each request's prompt opens with its own number, so that no two share a cached prefix.
        self._numbers = itertools.count() if unique_prompts else None
        self.results: list[Result] = []
        self.shed = 0
        self.no_target = 0
        self._in_flight = threading.Semaphore(max_in_flight)
        self._pool = ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix="load")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(timeout=120, trust_env=False, headers=headers)
        self._turn = itertools.count()
        self._lock = threading.Lock()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._http.close()

    def since(self, start: float) -> list[Result]:
        with self._lock:
            return [r for r in self.results if r.start >= start]

    def loop(self) -> None:
        next_at = time.monotonic()
        while not self.stopping.is_set():
            if self.rate <= 0:
                self.stopping.wait(0.1)
                next_at = time.monotonic()
                continue
            next_at += 1.0 / self.rate
            self.stopping.wait(max(0.0, next_at - time.monotonic()))
            targets = sorted(self.targets())
            if not targets:
                self.no_target += 1
                continue
            if not self._in_flight.acquire(blocking=False):
                self.shed += 1
                continue
            target = targets[next(self._turn) % len(targets)]
            self._pool.submit(self._one, target)

    def _one(self, target: str) -> None:
        start = time.monotonic()
        prompt = self.prompt if self._numbers is None else f"Request {next(self._numbers)}. {self.prompt}"
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": self.max_tokens,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0.8,
        }
        ttft = error = None
        finish_reason = None
        try:
            with self._http.stream("POST", f"{target}/v1/completions", json=body) as response:
                if response.status_code != 200:
                    error = f"HTTP {response.status_code}: {response.read()[:200]!r}"
                else:
                    for line in response.iter_lines():
                        if not line.startswith("data: {"):
                            continue
                        choices = json.loads(line[6:]).get("choices") or [{}]
                        if ttft is None and choices[0].get("text"):
                            ttft = time.monotonic() - start
                        finish_reason = choices[0].get("finish_reason") or finish_reason
        except httpx.HTTPError as err:
            error = f"{type(err).__name__}: {err}"
        finally:
            self._in_flight.release()
        with self._lock:
            self.results.append(
                Result(start=start, target=target, ttft_s=ttft, error=error, finish_reason=finish_reason)
            )
