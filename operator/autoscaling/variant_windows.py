"""A mixed pool's latency and traffic per GPU type (pure).

The autoscaler scales a mixed pool on its merged signals: one p95 over every pod, whatever its
type. Whether each type's plan holds is another question, and a merged p95 hides the answer: an
L4 variant twice as slow as planned is a tail in the pool's histogram that the H100s' requests
dilute. So each period also keeps each variant's share of the increases (its pods' histograms,
by their variant label), and the window gives each variant its own p95s and the requests behind
them: status.planAccuracy.variants sets them beside that type's predictions, and its share of
the requests beside its share of the pool's planned capacity (the gateway's split, measured).
Shown, not acted on.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

from kvpilot.operator.autoscaling.metrics import Histogram, histogram_quantile, merge


class _Data(BaseModel):
    # As the autoscaler's state it is part of (decisions._Data): camelCase, frozen.
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, frozen=True)


class VariantWindow(_Data):
    """One period's increase of one variant's pods' histograms."""

    ttft: Histogram | None = None
    tpot: Histogram | None = None


class VariantSignals(_Data):
    """One variant's p95s over the window, and the requests behind each (first tokens: requests started)."""

    ttft_p95_seconds: float | None = None
    tpot_p95_seconds: float | None = None
    ttft_observations: int = 0
    tpot_observations: int = 0


# (variant label value, its TTFT increase, its TPOT increase): one pod's period.
PodIncrease = tuple[str, Histogram | None, Histogram | None]


def period_by_variant(increases: Sequence[PodIncrease]) -> dict[str, VariantWindow]:
    """This period's increases merged per variant (pods with no variant label are not listed)."""
    variants = sorted({variant for variant, _, _ in increases if variant})
    return {
        name: VariantWindow(
            ttft=merge(ttft for variant, ttft, _ in increases if variant == name and ttft is not None),
            tpot=merge(tpot for variant, _, tpot in increases if variant == name and tpot is not None),
        )
        for name in variants
    }


def variant_signals(periods: Iterable[Mapping[str, VariantWindow]], quantile: float) -> dict[str, VariantSignals]:
    """Each variant's p95s over the window's periods."""
    periods = list(periods)
    found: dict[str, VariantSignals] = {}
    for name in sorted({name for period in periods for name in period}):
        ttft = merge(p[name].ttft for p in periods if name in p and p[name].ttft is not None)
        tpot = merge(p[name].tpot for p in periods if name in p and p[name].tpot is not None)
        found[name] = VariantSignals(
            ttft_p95_seconds=histogram_quantile(quantile, ttft) if ttft else None,
            tpot_p95_seconds=histogram_quantile(quantile, tpot) if tpot else None,
            ttft_observations=int(ttft.count) if ttft else 0,
            tpot_observations=int(tpot.count) if tpot else 0,
        )
    return found
