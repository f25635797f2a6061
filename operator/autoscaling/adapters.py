"""Which LoRA adapters to load and unload on an engine pod, and what status.adapters says: pure
functions over what the pods were read to hold (adapter_sync.py does the reading and the calls).

A pod holds exactly spec.adapters: each under its name, from the path its source has inside the
pod (`api/model_paths.source_path`), as the engine's /v1/models lists it (an adapter's `root`). A load that failed
is tried again on that pod only after a backoff that doubles with each failure in a row, so a
malformed adapter costs one request per backoff, not one per period, and never stops the others.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from kvpilot.operator.api.model_paths import source_path
from kvpilot.operator.api.names import ADAPTERS_LOADED_CONDITION
from kvpilot.operator.api.spec import AdapterSpec
from kvpilot.operator.kube.events import iso

# The first retry of a failed load waits this long (about one autoscaler period), doubling with
# each failure in a row up to the maximum.
RETRY_SECONDS = 15.0
MAX_RETRY_SECONDS = 600.0
# An engine's error message is cut to this many characters in the status.
MAX_MESSAGE = 1024


def wanted(adapters: Sequence[AdapterSpec]) -> dict[str, str]:
    """name -> path in the pod, of the adapters every pod must hold."""
    return {adapter.name: source_path(adapter.source) for adapter in adapters}


class Step(NamedTuple):
    """One call to an engine: load an adapter (`reload`: in place of the one served under that
    name from another path, which serves on if the new one fails), or unload one."""

    action: Literal["load", "reload", "unload"]
    name: str
    path: str | None = None


def steps(want: Mapping[str, str], held: Mapping[str, str]) -> list[Step]:
    """The calls that make a pod holding `held` (name -> path) hold exactly `want`: unloads
    first (they free slots), then loads, each by name."""
    unloads = [Step("unload", name) for name in sorted(held) if name not in want]
    loads = [
        Step("load" if name not in held else "reload", name, path)
        for name, path in sorted(want.items())
        if held.get(name) != path
    ]
    return unloads + loads


class Failure(NamedTuple):
    message: str
    at: float  # when it failed (epoch seconds)
    count: int  # failures in a row (0: the pod could not be read, nothing was tried)
    until: float  # not tried again before
    # The engine answered the load with a refusal (not a 503 "not ready yet", not a lost connection):
    # the adapter is bad there, and the pod is not held back for it.
    refused: bool = False


@dataclass
class Failures:
    """The failed loads of one service, by (pod, adapter name)."""

    by_key: dict[tuple[str, str], Failure] = field(default_factory=dict)

    def due(self, pod: str, name: str, now: float) -> bool:
        failure = self.by_key.get((pod, name))
        return failure is None or now >= failure.until

    def failed(self, pod: str, name: str, now: float, message: str, refused: bool = True) -> None:
        count = self.by_key[(pod, name)].count + 1 if (pod, name) in self.by_key else 1
        wait = min(RETRY_SECONDS * 2 ** (count - 1), MAX_RETRY_SECONDS)
        self.by_key[(pod, name)] = Failure(message[:MAX_MESSAGE], now, count, now + wait, refused)

    def unread(self, pod: str, names: Sequence[str], now: float, message: str) -> None:
        """A pod whose adapters could not be read: said on each adapter (since when, so the
        status does not change every period), without delaying its loads once it answers."""
        for name in names:
            before = self.by_key.get((pod, name))
            since = before.at if before is not None and before.message == message[:MAX_MESSAGE] else now
            self.by_key[(pod, name)] = Failure(message[:MAX_MESSAGE], since, 0, now)

    def keep_only(self, want: Mapping[str, str], held: Mapping[str, Mapping[str, str] | None]) -> None:
        """Forget the failures of pods no longer ready, of adapters no longer wanted, and of
        adapters a pod now holds from the wanted path (`held`: None for a pod not read)."""
        for pod, name in list(self.by_key):
            names = held.get(pod, {})
            if pod not in held or name not in want or (names is not None and names.get(name) == want[name]):
                del self.by_key[(pod, name)]


def adapter_rows(
    adapters: Sequence[AdapterSpec], held: Mapping[str, Mapping[str, str] | None], failures: Failures
) -> list[dict[str, Any]]:
    """status.adapters: for each adapter of the spec, the pods holding it from its source's path
    (`held`: per ready pod read, what it holds; None for a pod that could not be read) and, while
    some pod does not, the latest failure there."""
    rows = []
    for adapter in adapters:
        path = source_path(adapter.source)
        loaded = sorted(pod for pod, names in held.items() if names is not None and names.get(adapter.name) == path)
        row: dict[str, Any] = {"name": adapter.name, "source": adapter.source, "loadedOn": loaded, "pods": len(held)}
        missing = [
            (failure.at, pod, failure)
            for (pod, name), failure in failures.by_key.items()
            if name == adapter.name and pod not in loaded
        ]
        if missing:
            at, pod, failure = max(missing)
            row["error"] = {"pod": pod, "message": failure.message, "time": iso(at)}
        rows.append(row)
    return rows


# The readiness gate's condition as the adapter sync writes it (its reason tells it from one any
# other writer set).
GATE_REASON = "AdaptersLoaded"


def gate_condition(
    pod: str, want: Mapping[str, str], held: Mapping[str, str] | None, failures: Failures, now: float
) -> dict[str, Any] | None:
    """The pod's readiness-gate condition once every adapter of the spec was tried there: held
    from its path, or refused by the engine (an error on that adapter, not a pod kept out of
    service for it); None while the pod could not be read or an adapter is still to be loaded
    (not tried, or the engine was not ready for it)."""
    if held is None:
        return None
    refused = sorted(
        name
        for name in want
        if held.get(name) != want[name] and (failure := failures.by_key.get((pod, name))) and failure.refused
    )
    loaded = [name for name in want if held.get(name) == want[name]]
    if len(loaded) + len(refused) < len(want):
        return None
    message = f"holds {len(loaded)} of {len(want)} adapters" + (f"; refused: {', '.join(refused)}" if refused else "")
    return {
        "type": ADAPTERS_LOADED_CONDITION,
        "status": "True",
        "reason": GATE_REASON,
        "message": message,
        "lastTransitionTime": iso(now),
    }


def gate_written(pod: Mapping[str, Any]) -> bool:
    """Whether the sync already set `pod`'s gate (it is never taken back: an adapter added later
    is loaded while the pod serves, not by taking it out of the Service)."""
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(
        c.get("type") == ADAPTERS_LOADED_CONDITION and c.get("status") == "True" and c.get("reason") == GATE_REASON
        for c in conditions
    )
