"""The autoscaler's decision rules, one test each (operator/autoscaling/decisions.py)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from kvpilot.engine.serving.metrics import LATENCY_BUCKETS
from kvpilot.operator.api.names import VARIANT_LABEL
from kvpilot.operator.api.spec import InferenceServiceSpec
from kvpilot.operator.api.status import InferenceServiceStatus
from kvpilot.operator.autoscaling.decisions import (
    MIN_OBSERVATIONS,
    TREND_POINTS,
    AutoscalerState,
    Decision,
    Observation,
    PodRead,
    Policy,
    TrendPoint,
    projected_growth,
    scaled,
    step,
)
from kvpilot.operator.autoscaling.loop import replica_capacity, with_variants
from kvpilot.operator.autoscaling.metrics import EngineReading, Histogram

PERIOD = 15.0
SLO_TTFT = 2.0  # seconds, the Policy default
SLO_TPOT = 0.1


class Pod:
    """An engine's cumulative metrics, as successive reads of its /metrics would show them."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.ttft: list[float] = []
        self.tpot: list[float] = []
        self.waiting = 0.0
        self.kv = 0.1
        self.running = 0.0  # an engine runs requests while it serves some, and none when idle
        self.created: float | None = None  # the series' _created: when the engine started

    def serve(self, n: int, ttft: float, tpot: float = 0.03) -> Pod:
        self.ttft += [ttft] * n
        self.tpot += [tpot] * n
        return self

    def read(self) -> PodRead:
        def histogram(values: list[float]) -> Histogram:
            return Histogram(
                bounds=LATENCY_BUCKETS,
                count=float(len(values)),
                created=self.created,
                counts=tuple(float(sum(v <= b for v in values)) for b in LATENCY_BUCKETS),
            )

        return PodRead(
            name=self.name,
            reading=EngineReading(
                ttft=histogram(self.ttft),
                tpot=histogram(self.tpot),
                waiting=self.waiting,
                running=self.running,
                kv_usage=self.kv,
            ),
        )


class Loop:
    """Drives step() every PERIOD seconds with pods the test controls; replicas follow decisions
    and (unless told otherwise) all pods are ready."""

    def __init__(self, policy: Policy, replicas: int, state: AutoscalerState | None = None) -> None:
        self.policy, self.replicas, self.now = policy, replicas, 1_000_000.0
        self.state = state or AutoscalerState()
        self.pods = [Pod(f"p{i}") for i in range(replicas)]
        self.ready: int | None = None  # None: every replica is ready
        self.broken: set[str] = set()

    def tick(
        self,
        ttft: float | None = 0.2,
        n: int = 20,
        waiting: float = 0.0,
        kv: float = 0.1,
        tpot: float = 0.03,
        running: float | None = None,
    ) -> Decision:
        self.now += PERIOD
        while len(self.pods) < self.replicas:
            self.pods.append(Pod(f"p{len(self.pods)}"))
        del self.pods[self.replicas :]
        ready = self.replicas if self.ready is None else self.ready
        reads = []
        for pod in self.pods[:ready]:
            if ttft is not None:
                pod.serve(n, ttft, tpot)
            pod.waiting, pod.kv = waiting, kv
            pod.running = running if running is not None else 1.0 if ttft is not None and n else 0.0
            reads.append(PodRead(name=pod.name, error="connection refused") if pod.name in self.broken else pod.read())
        obs = Observation(now=self.now, replicas=self.replicas, ready_replicas=ready, pods=tuple(reads))
        self.state, decision = step(self.policy, self.state, obs)
        self.replicas = decision.replicas
        return decision


def test_over_the_slo_scales_up_in_proportion_bounded_by_max_step() -> None:
    loop = Loop(Policy(max_replicas=10, max_step=3), replicas=2)
    loop.tick(ttft=0.2)  # first read: an empty window
    d = loop.tick(ttft=4.5)  # p95 ~4.5 s against 2 s: ratio ~2.2 -> ceil(2 x 2.2) = 5 = 2 + 3
    assert d.action == "up" and d.replicas == 5
    assert d.signals.limiting == "TTFT"
    assert "p95 TTFT" in d.reason and "SLO 2000 ms" in d.reason and "2 -> 5" in d.reason
    loop = Loop(Policy(max_replicas=10, max_step=1), replicas=2)
    loop.tick()
    assert loop.tick(ttft=4.5).replicas == 3


def test_a_slightly_high_ratio_adds_at_least_one_replica() -> None:
    loop = Loop(Policy(max_replicas=8), replicas=4)
    d = loop.tick(ttft=None, waiting=4 * 1.15)  # 1.15x: ceil(4 x 1.15) = 5
    assert (d.action, d.replicas) == ("up", 5)
    loop = Loop(Policy(), replicas=1)
    d = loop.tick(ttft=None, waiting=4 * 1.15)  # ceil(1.15) = 2
    assert (d.action, d.replicas) == ("up", 2)


def test_each_decision_names_its_cause_in_one_word() -> None:
    """The operator's decisions counter groups by it: an up by the signal over the band, a hold or
    down by the rule that decided."""

    def causes(loop: Loop, *ticks: dict[str, float | None]) -> list[tuple[str, str]]:
        return [(d.action, d.cause) for d in (loop.tick(**tick) for tick in ticks)]

    assert causes(Loop(Policy(max_replicas=10), replicas=2), {}, {"ttft": 4.5}) == [("hold", "blind"), ("up", "ttft")]
    assert causes(Loop(Policy(max_replicas=2), replicas=2), {}, {"ttft": 4.5})[1] == ("hold", "max_replicas")
    assert causes(Loop(Policy(max_replicas=8), replicas=2), {"ttft": None, "kv": 1.0}) == [("up", "kv")]
    assert causes(Loop(Policy(scale_down_stabilization_seconds=30), replicas=3), *[{"ttft": 0.1}] * 4) == [
        ("hold", "blind"),
        ("hold", "scale_down_window"),
        ("down", "under_band"),
        ("hold", "min_replicas"),
    ]


@pytest.mark.parametrize("waiting_ratio", [0.95, 1.0, 1.09])
def test_tolerance_band_moves_nothing(waiting_ratio: float) -> None:
    loop = Loop(Policy(scale_down_stabilization_seconds=0), replicas=3)
    for _ in range(10):
        d = loop.tick(waiting=4 * waiting_ratio)
        assert (d.action, d.replicas) == ("hold", 3)
    assert "tolerance band" in d.reason


def test_queue_per_replica_scales_up_while_ttft_still_looks_fine() -> None:
    """Requests stuck in the queue have no TTFT yet: the queue is the early signal."""
    loop = Loop(Policy(), replicas=2)
    loop.tick()
    d = loop.tick(ttft=0.3, waiting=10)
    assert d.action == "up" and d.signals.limiting == "waiting"
    assert d.signals.ttft_p95_seconds < SLO_TTFT


def test_tpot_over_its_slo_scales_up() -> None:
    loop = Loop(Policy(), replicas=1)
    loop.tick()
    d = loop.tick(ttft=0.3, tpot=0.3)
    assert d.action == "up" and d.signals.limiting == "TPOT"


def test_full_kv_cache_scales_up() -> None:
    loop = Loop(Policy(), replicas=1)
    assert loop.tick(ttft=None, kv=0.99).action == "hold"  # 0.99 / 0.9 = 1.10: the band's edge
    d = loop.tick(ttft=None, kv=1.0)  # 1.11x
    assert d.action == "up" and d.signals.limiting == "KV"


def test_scale_up_waits_for_its_stabilization_window() -> None:
    # A window of one read, so that the queue signal is this read's alone.
    loop = Loop(Policy(scale_up_stabilization_seconds=30, window_seconds=PERIOD), replicas=1)
    assert loop.tick(ttft=None, waiting=10).action == "hold"  # over for 0 s
    assert loop.tick(ttft=None, waiting=10).action == "hold"  # 15 s
    assert loop.tick(ttft=None, waiting=0).action == "hold"  # back in: the run restarts
    assert loop.tick(ttft=None, waiting=10).action == "hold"
    assert loop.tick(ttft=None, waiting=10).action == "hold"
    assert loop.tick(ttft=None, waiting=10).action == "up"  # over for 30 s


def test_no_new_scale_up_while_pods_of_the_last_one_are_pending() -> None:
    loop = Loop(Policy(max_replicas=10, max_step=2), replicas=2)
    assert loop.tick(ttft=None, waiting=10).replicas == 4
    loop.ready = 2  # the two new pods are not ready
    for _ in range(5):
        d = loop.tick(ttft=None, waiting=10)
        assert (d.action, d.replicas) == ("hold", 4)
    assert "last scale-up to 4 has 2 ready" in d.reason
    loop.ready = None
    assert loop.tick(ttft=None, waiting=10).replicas == 6


def test_a_pod_that_fails_later_does_not_hold_scale_up() -> None:
    """Pending means pods of the last scale-up not ready yet, not any unready pod forever."""
    loop = Loop(Policy(max_replicas=10), replicas=2)
    assert loop.tick(ttft=None, waiting=10).replicas == 4
    loop.tick(ttft=None, waiting=2)  # all 4 ready: the scale-up is done
    loop.ready = 3  # one crashes afterwards
    assert loop.tick(ttft=None, waiting=10).action == "up"


def test_scale_down_only_after_the_stabilization_window() -> None:
    loop = Loop(Policy(scale_down_stabilization_seconds=300, min_replicas=1), replicas=3)
    decisions = [loop.tick(ttft=0.1, n=1, waiting=0, kv=0.05) for _ in range(25)]
    downs = [i for i, d in enumerate(decisions) if d.action == "down"]
    # The first step starts observing; the 21st (300 s later) may scale down.
    assert downs[0] == 20
    assert all(d.action == "hold" for d in decisions[:20])
    assert "scale-down window" in decisions[5].reason


def test_scale_down_takes_the_largest_recommendation_of_the_window() -> None:
    policy = Policy(scale_down_stabilization_seconds=150, max_step=4, max_replicas=8, window_seconds=PERIOD)
    loop = Loop(policy, replicas=8)
    for i in range(10):
        # One period with a burst that needs 6 of 8 (0.6 / 0.9 x 8 = 5.3 -> 6); otherwise 4 would
        # do (idle enough for 1, but at most max_step fewer).
        d = loop.tick(waiting=4 * (0.6 if i == 5 else 0.05), kv=0.01)
        assert d.action == "hold"
    d = loop.tick(waiting=0.2, kv=0.01)  # 150 s observed
    assert (d.action, d.replicas) == ("down", 6)


def test_scale_down_only_if_one_fewer_replica_would_still_meet_the_target() -> None:
    """At 2 replicas and half the queue target, 1 replica would sit at 1.0x: not comfortable."""
    loop = Loop(Policy(scale_down_stabilization_seconds=60, window_seconds=PERIOD), replicas=2)
    for _ in range(20):
        d = loop.tick(waiting=4 * 0.5)
        assert (d.action, d.replicas) == ("hold", 2)
    assert "1 replicas would not be" in d.reason and "x1.00" in d.reason
    # 1 replica: 0.8x, under 0.9; down once the last 2-replica recommendation is 60 s old.
    decisions = [loop.tick(waiting=4 * 0.4) for _ in range(5)]
    assert [(d.action, d.replicas) for d in decisions] == [("hold", 2)] * 3 + [("down", 1), ("hold", 1)]


def test_a_p95_of_too_few_requests_over_the_slo_blocks_a_scale_down() -> None:
    """Overloaded engines on a slow CPU finish fewer than MIN_OBSERVATIONS requests per window, so
    their p95 is not acted on; KV and batch then read nearly empty. That is no ground to scale down
    (e2e on an AVX2 Zen 3: 4 -> 3 at p95 TTFT 1075 ms of 17 against a 20 ms SLO, then back up)."""
    policy = Policy(scale_down_stabilization_seconds=30, window_seconds=PERIOD, max_replicas=4)
    few = MIN_OBSERVATIONS // 10  # per pod and period: 4 pods finish 8 requests a window
    slow = Loop(policy, replicas=4)
    decisions = [slow.tick(ttft=3 * SLO_TTFT, n=few, kv=0.01) for _ in range(8)]
    assert all((d.action, d.replicas) == ("hold", 4) for d in decisions), [d.reason for d in decisions]
    last = decisions[-1]
    assert last.cause == "few_observations" and f"TTFT of {few * 4} requests (fewer than" in last.reason, last
    # Never a scale-up on them either, and the same few requests under the SLO do let it go down.
    assert not [d for d in decisions if d.action == "up"]
    fast = Loop(policy, replicas=4)
    assert "down" in [fast.tick(ttft=0.1 * SLO_TTFT, n=few, kv=0.01).action for _ in range(8)]


def test_scale_down_moves_at_most_max_step_per_window() -> None:
    loop = Loop(Policy(scale_down_stabilization_seconds=60, max_step=2, max_replicas=8), replicas=8)
    replicas = [loop.tick(ttft=None, waiting=0, kv=0).replicas for _ in range(30)]
    assert replicas[4] == 6  # 60 s observed
    changes = [i for i in range(1, 30) if replicas[i] != replicas[i - 1]]
    # 8 -> 6 -> 4 -> 2 -> 1, each a full window after the one before.
    assert [replicas[i] for i in changes] == [6, 4, 2, 1]
    assert all(b - a >= 4 for a, b in zip(changes, changes[1:]))


def test_replicas_stay_within_min_and_max() -> None:
    policy = Policy(min_replicas=2, max_replicas=3, scale_down_stabilization_seconds=0)
    assert Loop(policy, replicas=5).tick().replicas == 3  # someone set 5
    assert Loop(policy, replicas=1).tick().replicas == 2  # someone set 1
    loop = Loop(policy, replicas=3)
    d = loop.tick(ttft=None, waiting=40)
    assert (d.action, d.replicas) == ("hold", 3) and "maxReplicas 3" in d.reason
    loop = Loop(policy, replicas=2)
    assert all(loop.tick(ttft=None, waiting=0).replicas == 2 for _ in range(5))


def test_zero_replicas_stay_zero() -> None:
    """Scaled to zero (by hand, or idle with minReplicas 0): no engine reports, nothing moves,
    even below minReplicas, as an HPA leaves a target scaled to zero alone."""
    loop = Loop(Policy(min_replicas=1), replicas=0)
    for _ in range(5):
        d = loop.tick(ttft=None)
        assert (d.action, d.replicas) == ("hold", 0)
    assert "0 replicas" in d.reason


def test_a_pod_that_does_not_report_is_unknown_and_does_not_block_the_rest() -> None:
    loop = Loop(Policy(max_replicas=6), replicas=3)
    loop.broken = {"p1"}
    loop.tick()
    d = loop.tick(ttft=5.0)
    assert d.action == "up" and d.replicas == 5
    assert d.signals.unknown == ("p1",) and d.signals.reporting == 2
    assert "unknown: 1 (p1)" in d.reason


def test_no_pod_reporting_holds() -> None:
    loop = Loop(Policy(), replicas=2)
    loop.broken = {"p0", "p1"}
    d = loop.tick(ttft=5.0)
    assert (d.action, d.replicas) == ("hold", 2) and "no pod reported" in d.reason


@pytest.mark.parametrize("mode", ["external", "off"])
def test_external_and_off_never_change_replicas(mode: str) -> None:
    loop = Loop(Policy(mode=mode, min_replicas=2, max_replicas=4), replicas=7)
    loop.tick()
    for _ in range(30):
        d = loop.tick(ttft=9.0, waiting=50)
        assert (d.action, d.replicas) == ("hold", 7)
    assert f"mode is {mode}" in d.reason
    # The signals are still there for the status.
    assert d.signals.ttft_p95_seconds > SLO_TTFT


def test_gauges_are_averaged_over_the_window() -> None:
    """One read of a queue is a sample: a burst in one of four reads is a quarter as much."""
    loop = Loop(Policy(window_seconds=60, max_replicas=8), replicas=2)
    for waiting in (0, 0, 0, 10):
        d = loop.tick(ttft=None, waiting=waiting)
    assert (d.action, d.signals.waiting_per_replica) == ("hold", 2.5)
    loop = Loop(Policy(window_seconds=PERIOD, max_replicas=8), replicas=2)
    for waiting in (0, 0, 0, 10):
        d = loop.tick(ttft=None, waiting=waiting)
    assert d.action == "up"


def test_rate_per_replica_where_the_slo_broke_bounds_scale_down() -> None:
    """Latency does not grow in proportion to load (queueing is convex), so a projection from
    latency alone would scale down into a broken SLO. Where the SLO broke, in requests per second
    per replica (which does grow in proportion), is remembered and not planned past again."""

    def run(overloaded_first: bool) -> tuple[Loop, list[Decision]]:
        # A scale-up window as long as the metrics window: one replica overloaded long enough to learn.
        loop = Loop(
            Policy(
                window_seconds=60,
                scale_up_stabilization_seconds=60,
                scale_down_stabilization_seconds=60,
                max_replicas=4,
            ),
            replicas=1,
        )
        if overloaded_first:
            for _ in range(6):  # 2 req/s on one replica, steady for a whole window: TTFT 3 s
                loop.tick(ttft=3.0, n=30)
            assert loop.replicas == 2
        return loop, [loop.tick(ttft=0.2, n=15, tpot=0.03) for _ in range(30)]  # 1 req/s per replica

    loop, decisions = run(overloaded_first=True)
    assert loop.state.knee == pytest.approx(2.0)
    assert all(d.replicas == 2 for d in decisions)
    assert "1 replicas would not be (x1.00)" in decisions[-1].reason  # 2 req/s: where it broke
    assert "1.00 req/s per replica (over the band at 2.00)" in decisions[-1].reason
    loop, decisions = run(overloaded_first=False)
    assert loop.state.knee is None and decisions[-1].replicas == 1  # nothing learned: latency says 1 will do


def test_the_knee_rises_when_a_higher_rate_is_comfortable() -> None:
    loop = Loop(Policy(window_seconds=60, min_replicas=1, max_replicas=1), replicas=1)
    for _ in range(6):
        loop.tick(ttft=3.0, n=30)
    assert loop.state.knee == pytest.approx(2.0)
    for _ in range(3):
        loop.tick(ttft=0.2, n=45)  # 3 req/s, comfortable, but the window still holds the slow ones
    assert loop.state.knee == pytest.approx(2.0)
    for _ in range(3):
        loop.tick(ttft=0.2, n=45)
    assert loop.state.knee == pytest.approx(3.0)


def test_nothing_is_learned_from_a_backlog() -> None:
    """While a pod's queue is past its target, or its requests are still being served, the rate
    per replica is what the pods manage, not where the load breaks them."""
    policy = Policy(window_seconds=60, min_replicas=1, max_replicas=1)
    loop = Loop(policy, replicas=1)
    for _ in range(8):
        loop.tick(ttft=30.0, n=10, waiting=20)
    assert loop.state.knee is None
    for _ in range(4):  # the queue is gone, but the window still holds periods that had it
        loop.tick(ttft=30.0, n=10, waiting=0)
    assert loop.state.knee is None
    loop.tick(ttft=30.0, n=10, waiting=0)
    assert loop.state.knee == pytest.approx(10 / PERIOD)


def test_after_a_scale_up_is_ready_the_old_window_is_no_reason_for_another() -> None:
    loop = Loop(Policy(max_replicas=10), replicas=2)
    loop.tick()
    assert loop.tick(ttft=6.0).replicas == 4
    # The new pods are ready; the requests served now are fast. The slow ones of before are
    # still within 60 s, but they do not count once the scale-up is done.
    d = loop.tick(ttft=0.2)
    assert d.action == "hold" and d.signals.ttft_p95_seconds < 0.3


def test_window_forgets_what_is_older_than_it() -> None:
    loop = Loop(Policy(window_seconds=60, max_replicas=1, min_replicas=1), replicas=1)
    loop.tick()
    assert loop.tick(ttft=5.0).signals.ttft_p95_seconds > 4
    for _ in range(3):
        d = loop.tick(ttft=0.2)
    assert d.signals.ttft_p95_seconds > 4  # the slow period is still inside the 60 s
    d = loop.tick(ttft=0.2)
    assert d.signals.ttft_p95_seconds < 0.3


def test_idle_window_has_no_latency_and_a_restarted_pod_counts_from_its_new_read() -> None:
    loop = Loop(Policy(max_replicas=1), replicas=1)
    loop.tick(ttft=0.2, n=500)
    assert loop.tick(ttft=None).signals.ttft_p95_seconds is None  # nothing new in the window...
    for _ in range(4):
        d = loop.tick(ttft=None)
    assert d.signals.ttft_p95_seconds is None  # ...and then nothing at all
    loop.pods[0] = Pod("p0").serve(3, 6.0)  # same pod name, new process: counts went down
    d = loop.tick(ttft=None)
    assert d.signals.ttft_p95_seconds > 5


def test_scale_to_zero_only_when_idle() -> None:
    policy = Policy(min_replicas=0, scale_down_stabilization_seconds=60)
    loop = Loop(policy, replicas=1)
    loop.tick()
    loop.broken = {"p0"}  # not reporting (an engine still loading): it may be busy
    assert all(loop.tick(ttft=None, waiting=0, kv=0).replicas == 1 for _ in range(10))
    loop.broken = set()
    # A trickle of requests, too thin for a p95, while every gauge reads 0 between them: 1 stays.
    assert all(loop.tick(ttft=0.2, n=1, waiting=0, kv=0).replicas == 1 for _ in range(10))
    decisions = [loop.tick(ttft=None, waiting=0, kv=0) for _ in range(10)]
    assert decisions[-1].replicas == 0
    assert min(i for i, d in enumerate(decisions) if d.replicas == 0) >= 4  # the window emptied first


def test_scale_to_zero_waits_at_least_one_cold_start() -> None:
    """Idle for the 60 s window, but a replica takes 150 s to come back: zero only after 150 s
    without a request (10 periods of 15 s, not 4); scaling 2 -> 1 keeps the 60 s window."""

    def first(replicas: int, cold_start: float, wanted: int, **tick: float) -> tuple[int, str]:
        policy = Policy(min_replicas=0, scale_down_stabilization_seconds=60, cold_start_seconds=cold_start)
        loop = Loop(policy, replicas=replicas)
        decisions = [loop.tick(**tick) for _ in range(14)]  # type: ignore[arg-type]
        at = next(i for i, d in enumerate(decisions) if d.replicas == wanted)
        return at, decisions[at - 1].reason

    idle = {"ttft": None, "waiting": 0, "kv": 0}
    assert first(1, 0, 0, **idle)[0] == 4
    at, reason = first(1, 150, 0, **idle)
    assert at == 10 and "for 135 s of the 150 s scale-down window (to zero: at least one cold start)" in reason
    assert first(2, 150, 1, ttft=0.2, n=20, waiting=0, kv=0.01)[0] == 4


def test_a_rising_load_scales_up_one_cold_start_ahead() -> None:
    """The lead time: the request rate rises steadily (3 more requests every 15 s) while the
    signals sit under the band (KV 0.78x its target). With a 120 s cold start, the replicas are
    asked for when the rate's trend says the load will be over the band by the time they are
    ready; without one, nothing moves until it is."""

    def decisions(cold_start: float) -> list[Decision]:
        loop = Loop(Policy(max_replicas=10, cold_start_seconds=cold_start), replicas=2)
        return [loop.tick(n=10 + 3 * i, kv=0.7) for i in range(TREND_POINTS + 2)]

    assert all(d.action == "hold" for d in decisions(0))
    ups = [d for d in decisions(120) if d.action == "up"]
    assert ups and ups[0].cause == "trend" and ups[0].signals.ratio < 1  # not over the band yet
    assert "heading over the SLO band" in ups[0].reason and "in one cold start" in ups[0].reason


def test_the_trend_is_a_rate_rising_clear_of_its_noise() -> None:
    rising = [TrendPoint(at=15.0 * i, rate=2.0 + 0.1 * i) for i in range(TREND_POINTS)]
    # 3.1 req/s at the last point, +0.1 every 15 s: 3.9 two minutes on.
    assert projected_growth(rising, 120) == pytest.approx(3.9 / 3.1)
    assert projected_growth(rising, 0) is None  # no cold start known: no lead time
    assert projected_growth(rising[1:], 120) is None  # too few periods to call it a trend
    assert projected_growth([p.model_copy(update={"rate": 2.0}) for p in rising], 120) is None
    assert projected_growth([p.model_copy(update={"rate": 4.0 - p.rate}) for p in rising], 120) is None
    # The same rise under noise as large as the rise itself: not clear of it.
    noisy = [p.model_copy(update={"rate": p.rate + (1.2 if i % 2 else -1.2)}) for i, p in enumerate(rising)]
    assert projected_growth(noisy, 120) is None


def test_a_mixed_pool_scales_in_capacity_not_in_replicas() -> None:
    """Two H100 replicas of 10 req/s each come first, then L4s of 2: 3 replicas serve 22 req/s.
    1.2x that is 26.4, which takes three more L4s, not the one a count of replicas would add; and
    a load a third of it is served by the two H100s alone."""
    pool = (10.0, 10.0) + (2.0,) * 6
    assert scaled(Policy(max_replicas=8, replica_capacity=pool), 3, 1.2) == 6
    assert scaled(Policy(max_replicas=8), 3, 1.2) == 4  # every replica alike
    assert scaled(Policy(max_replicas=8, replica_capacity=pool), 5, 0.4 / 0.9) == 2
    assert scaled(Policy(max_replicas=8), 5, 0.4 / 0.9) == 3
    loop = Loop(Policy(max_replicas=8, max_step=4, replica_capacity=pool), replicas=3)
    loop.tick(ttft=None, waiting=0, kv=0.1)
    d = loop.tick(ttft=None, waiting=0, kv=0.9 * 1.2 * 2 - 0.1 * 1)  # window mean: 1.2x the KV target
    assert (d.action, d.replicas) == ("up", 6), d.reason


def test_a_mixed_pool_s_replica_capacities_follow_its_fill_order() -> None:
    status = InferenceServiceStatus.model_validate(
        {
            "variants": [
                {"gpu": "L4", "capacityRps": 2.0, "maxReplicas": 3, "schedulableReplicas": 1},
                {"gpu": "H100-80GB", "capacityRps": 10.0, "maxReplicas": 2},
                {"gpu": "T4", "capacityRps": 0.0, "maxReplicas": 2},  # misses the SLO: filled last
            ]
        }
    )
    # The L4s' full nodes hold one; then the H100s; then the T4s, which count for no capacity; past
    # every maximum the overflow goes to the first.
    assert replica_capacity(status, 8) == (2.0, 10.0, 10.0, 0.0, 0.0, 2.0, 2.0, 2.0)
    none_meets = [{"gpu": gpu, "capacityRps": 0.0, "maxReplicas": 2} for gpu in ("L4", "T4")]
    assert replica_capacity(InferenceServiceStatus.model_validate({"variants": none_meets}), 4) == ()
    one = InferenceServiceStatus.model_validate({"variants": [{"gpu": "L4", "capacityRps": 2.0, "maxReplicas": 3}]})
    assert replica_capacity(one, 6) == ()


def test_each_pod_s_batch_occupancy_is_over_its_own_gpu_type_s_max_num_seqs() -> None:
    # A mixed pool whose status.plan (the policy's limit) is its first type's: an L4's 24; the H100s' 96.
    status = InferenceServiceStatus.model_validate(
        {"variants": [{"gpu": "L4", "maxNumSeqs": 24}, {"gpu": "H100-80GB", "maxNumSeqs": 96}]}
    )
    pods = [
        {"metadata": {"name": "l4-0", "labels": {VARIANT_LABEL: "l4"}}},
        {"metadata": {"name": "h100-0", "labels": {VARIANT_LABEL: "h100-80gb"}}},
        {"metadata": {"name": "stray", "labels": {}}},
    ]

    def read(name: str, running: float) -> PodRead:
        return PodRead(name=name, reading=EngineReading(waiting=0.0, running=running, kv_usage=0.1))

    reads = with_variants([read("l4-0", 12.0), read("h100-0", 48.0)], pods, status)
    assert [r.max_num_seqs for r in reads] == [24, 96]
    assert [r.variant for r in reads] == ["l4", "h100-80gb"]
    # Both half full: 50 %. By the L4's limit the H100 would read 200 % and the mean 125 %: a scale-up.
    policy = Policy(max_num_seqs=24, max_replicas=8)
    obs = Observation(now=1_000_000.0, replicas=2, ready_replicas=2, pods=tuple(reads))
    _, decision = step(policy, AutoscalerState(), obs)
    assert decision.signals.batch_occupancy == 0.5 and decision.action != "up", decision.reason
    by_first_type = Observation(
        now=1_000_000.0, replicas=2, ready_replicas=2, pods=(read("l4-0", 12.0), read("h100-0", 48.0))
    )
    assert step(policy, AutoscalerState(), by_first_type)[1].signals.batch_occupancy == 1.25
    # A pod of no known type is counted by the policy's limit; a pool of one type keeps its reads.
    (stray,) = with_variants([read("stray", 12.0)], pods, status)
    assert stray.max_num_seqs is None
    assert with_variants(reads, pods, InferenceServiceStatus()) == reads
    # An L4 variant on spot nodes (label l4-spot) has its own row and limit.
    spot = InferenceServiceStatus.model_validate(
        {"variants": [{"gpu": "L4", "maxNumSeqs": 24}, {"gpu": "L4", "capacityClass": "spot", "maxNumSeqs": 8}]}
    )
    spot_pod = {"metadata": {"name": "l4-spot-0", "labels": {VARIANT_LABEL: "l4-spot"}}}
    (read_spot,) = with_variants([read("l4-spot-0", 4.0)], [spot_pod], spot)
    assert (read_spot.variant, read_spot.max_num_seqs) == ("l4-spot", 8)


def test_a_mixed_pool_s_window_keeps_each_gpu_type_s_p95s_apart() -> None:
    """The pool scales on one merged p95, where the H100's many fast requests hide the L4s' slow
    ones; each type's own p95s (over its pods' increases, by their variant label) are kept beside."""
    l4, h100 = Pod("l4-0"), Pod("h100-0")
    state, now = AutoscalerState(), 1_000_000.0
    for _ in range(3):
        now += PERIOD
        l4.serve(4, ttft=1.5, tpot=0.09)
        h100.serve(96, ttft=0.1, tpot=0.01)
        reads = (
            l4.read().model_copy(update={"variant": "l4"}),
            h100.read().model_copy(update={"variant": "h100-80gb"}),
        )
        obs = Observation(now=now, replicas=2, ready_replicas=2, pods=reads)
        state, decision = step(Policy(max_replicas=4), state, obs)
    signals = decision.signals
    # Two periods of increases (the first read is a baseline): 8 and 192 requests.
    slow, fast = signals.variants["l4"], signals.variants["h100-80gb"]
    assert (slow.ttft_observations, fast.ttft_observations, signals.ttft_observations) == (8, 192, 200)
    assert slow.ttft_p95_seconds is not None and slow.ttft_p95_seconds > 1.0
    assert fast.ttft_p95_seconds is not None and fast.ttft_p95_seconds < 0.2
    assert signals.ttft_p95_seconds is not None and signals.ttft_p95_seconds < 1.0  # merged: the L4s hidden
    assert slow.tpot_p95_seconds is not None and slow.tpot_p95_seconds > 0.05 > (fast.tpot_p95_seconds or 1)
    # They live in the saved state's window, and come back from it as written.
    assert AutoscalerState.model_validate(state.model_dump(mode="json", by_alias=True)) == state
    # A service of one type keeps no per-variant window.
    one = step(Policy(), AutoscalerState(), Observation(now=now, replicas=1, ready_replicas=1, pods=(l4.read(),)))
    assert one[0].window[-1].variants == {} and one[1].signals.variants == {}


def test_replicas_set_by_someone_else_start_a_new_regime() -> None:
    """The gateway scales from zero (or a person scales by hand): the scale-down recommendations
    made before are not a reason to undo it at once; a full stabilization window must pass."""
    policy = Policy(min_replicas=0, scale_down_stabilization_seconds=60)
    loop = Loop(policy, replicas=1)
    decisions = [loop.tick(ttft=None, waiting=0, kv=0) for _ in range(8)]
    assert decisions[-1].replicas == 0
    loop.replicas = 1  # the gateway, for a request that arrived
    after = [loop.tick(ttft=None, waiting=0, kv=0) for _ in range(6)]
    assert [d.replicas for d in after[:4]] == [1, 1, 1, 1]  # 60 s = 4 periods of 15 s
    assert after[-1].replicas == 0  # idle for a whole window again


def test_state_survives_a_restart_through_json() -> None:
    """Persist the state (as the status does) every step, or not at all: same decisions."""

    def run(persist: bool) -> list[tuple[str, int]]:
        loop = Loop(Policy(scale_down_stabilization_seconds=60, max_replicas=6), replicas=2)
        loads = [0.2] * 2 + [5.0] * 3 + [0.2] * 15
        out = []
        for i, ttft in enumerate(loads):
            loop.ready = loop.replicas - 1 if i == 3 else None  # one step with a pending pod
            d = loop.tick(ttft=ttft)
            out.append((d.action, d.replicas))
            if persist:
                text = json.dumps(loop.state.model_dump(mode="json", by_alias=True), allow_nan=False)
                loop.state = AutoscalerState.model_validate(json.loads(text))
        return out

    uninterrupted, restarted = run(False), run(True)
    assert restarted == uninterrupted
    assert {a for a, _ in uninterrupted} == {"up", "down", "hold"}


def test_status_form_is_camel_case() -> None:
    loop = Loop(Policy(), replicas=1)
    loop.tick()
    dumped = loop.state.model_dump(mode="json", by_alias=True)
    assert {"baselines", "window", "lastDecision", "observedSince"} <= set(dumped)
    assert "waitingPerReplica" in dumped["lastDecision"]["signals"]


def test_policy_from_spec() -> None:
    spec = InferenceServiceSpec.model_validate(
        {
            "model": {"name": "m"},
            "slo": {"ttftP95Ms": 500, "tpotP95Ms": 40},
            "autoscaling": {
                "mode": "external",
                "minReplicas": 0,
                "maxReplicas": 9,
                "maxStep": 3,
                "tolerance": 0.2,
                "scaleDownStabilizationSeconds": 120,
            },
        }
    )
    policy = Policy.from_spec(spec)
    assert (policy.ttft_p95_seconds, policy.tpot_p95_seconds) == (0.5, 0.04)
    assert (policy.mode, policy.min_replicas, policy.max_replicas, policy.max_step) == ("external", 0, 9, 3)
    assert (policy.tolerance, policy.scale_down_stabilization_seconds) == (0.2, 120)
    assert Policy.from_spec(InferenceServiceSpec.model_validate({"model": {"name": "m"}})).mode == "slo"


def test_the_policy_takes_its_settings_from_the_spec() -> None:
    """One declaration of each autoscaling setting: the policy's bounds and defaults are the spec's."""
    from kvpilot.operator.api.spec import AutoscalingSpec

    shared = set(Policy.model_fields) & set(AutoscalingSpec.model_fields)
    assert len(shared) == 9
    for name in shared:
        ours, spec = Policy.model_fields[name], AutoscalingSpec.model_fields[name]
        assert (ours.annotation, ours.default, ours.metadata) == (spec.annotation, spec.default, spec.metadata), name
    with pytest.raises(ValidationError, match="less than or equal to 0.5"):
        Policy(tolerance=0.6)  # the spec's bound (the policy once had its own, < 1)


@pytest.mark.parametrize("busy", [{"waiting": 1.0}, {"running": 3.0}, {"waiting": 0.5, "running": 1.0}])
def test_a_window_in_which_busy_engines_finish_nothing_never_scales_down(busy: dict[str, float]) -> None:
    """Issue 24, item 6: under sustained overload (or reads too slow to show it) a window can hold
    no first token and no finished request while the engines run and queue requests: that is
    never idleness. Before, the queue and KV read as low and replicas went 4 -> 3 -> 2."""
    loop = Loop(Policy(scale_down_stabilization_seconds=30, max_replicas=4), replicas=4)
    for _ in range(12):
        d = loop.tick(ttft=None, kv=0.05, **busy)
        assert (d.action, d.replicas) == ("hold", 4), d.reason
    assert "none got a first token or finished in the window" in d.reason
    # Once requests finish again and the load is low, the 30 s scale-down window starts from there.
    decisions = [loop.tick(kv=0.05, waiting=0.0) for _ in range(2)]
    assert [d.action for d in decisions] == ["hold", "down"]


def test_an_idle_hour_does_not_dilute_the_next_period_s_rate() -> None:
    """Issue 24, item 4: an idle service writes no state, so the saved last decision is an hour
    old when 150 requests arrive in 15 s: 10 req/s per replica, not 0.042."""
    loop = Loop(Policy(), replicas=1)
    loop.tick(ttft=None)
    loop.now += 3600 - PERIOD
    d = loop.tick(n=150)
    assert d.signals.rate_per_replica == pytest.approx(150 / PERIOD)


def test_a_service_woken_from_zero_is_not_scaled_back_while_its_engine_loads() -> None:
    """Issue 24, item 1: the gateway woke it (0 -> 1); the engine took 6 minutes to load (longer
    than the 300 s scale-down window) and served the 3 requests that woke it before the first read.
    Before: down 1 -> 0 at that first read."""
    policy = Policy(min_replicas=0, scale_down_stabilization_seconds=300)
    loop = Loop(policy, replicas=0)
    assert loop.tick(ttft=None).action == "hold"  # asleep
    loop.replicas, loop.ready = 1, 0  # the gateway's scale; the pod is loading
    for _ in range(24):  # 6 minutes
        d = loop.tick(ttft=None)
        assert (d.action, d.replicas) == ("hold", 1)
    loop.ready = None
    loop.pods[0].created = loop.now  # the engine started this period: its series are new
    d = loop.tick(n=3)
    assert (d.action, d.replicas) == ("hold", 1) and d.signals.ttft_observations == 3
    # Idle from then on: zero follows once the 300 s scale-down window holds no period that needed
    # the replica (the requests stay in the 60 s signal window for 4 periods, then 20 more periods).
    decisions = [loop.tick(ttft=None, kv=0) for _ in range(23)]
    assert [d.action for d in decisions] == ["hold"] * 22 + ["down"] and decisions[-1].replicas == 0


def test_the_state_in_the_status_is_compact_and_reads_back_the_same() -> None:
    """Issue 24, item 11: each pod's baseline carried its histograms' 42 bucket bounds twice (1,246
    bytes a pod; 400 pods, half a megabyte of status): the bounds are listed once per state and
    whole counts go as per-bucket integers."""
    from kvpilot.operator.autoscaling.decisions import BOUNDS_KEY

    loop = Loop(Policy(max_replicas=400), replicas=40)
    for _ in range(5):
        loop.tick()
    dumped = loop.state.model_dump(mode="json", by_alias=True)
    per_pod = len(json.dumps(dumped["baselines"])) / 40
    assert per_pod < 500, per_pod
    assert len(dumped[BOUNDS_KEY]) == 1 and dumped["baselines"]["p0"]["ttft"]["bounds"] == 0
    assert AutoscalerState.model_validate(json.loads(json.dumps(dumped))) == loop.state
    # A state written before the compact form (bounds in every histogram) still reads.
    verbose = json.loads(json.dumps(loop.state.model_dump(mode="json", by_alias=True, round_trip=True)))
    verbose = _expanded(verbose)
    assert AutoscalerState.model_validate(verbose) == loop.state
    # Counts that are not whole (a rate from an exporter that averages) keep their cumulative form.
    pod = loop.pods[0]
    pod.ttft = [0.2] * 3
    fractional = loop.state.model_copy(
        update={
            "baselines": {
                "p0": loop.state.baselines["p0"].model_copy(
                    update={"ttft": pod.read().reading.ttft.model_copy(update={"count": 2.5})}
                )
            }
        }
    )
    again = AutoscalerState.model_validate(json.loads(json.dumps(fractional.model_dump(mode="json", by_alias=True))))
    assert again == fractional


def _expanded(state: dict) -> dict:
    """A dumped state in the form an older operator wrote: every histogram with its own bounds."""
    from kvpilot.operator.autoscaling.decisions import BOUNDS_KEY, _unshare_bounds

    return _unshare_bounds({k: v for k, v in state.items() if k != BOUNDS_KEY}, state[BOUNDS_KEY])


def test_the_signals_carry_the_fewest_kv_blocks_an_engine_allocated() -> None:
    def read(name: str, blocks: int | None) -> PodRead:
        return PodRead(name=name, reading=EngineReading(waiting=0.0, running=0.0, kv_blocks=blocks))

    reads = (read("a", 9_000), read("b", 8_700), read("c", None), PodRead(name="d", error="connection refused"))
    obs = Observation(now=1_000_000.0, replicas=4, ready_replicas=4, pods=reads)
    _, decision = step(Policy(), AutoscalerState(), obs)
    assert decision.signals.kv_blocks == 8_700
    silent = Observation(now=1_000_000.0, replicas=1, ready_replicas=1, pods=(read("c", None),))
    assert step(Policy(), AutoscalerState(), silent)[1].signals.kv_blocks is None
