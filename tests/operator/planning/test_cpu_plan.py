"""accelerator.type cpu: a CPU node type planned from its device profile (planning/cpus.py)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from kvpilot.engine.contract.device_profile import DeviceProfile, SchemeSteps
from kvpilot.operator.api.spec import InferenceServiceSpec
from kvpilot.operator.controller import render
from kvpilot.operator.controller.reconcile import device_profiles
from kvpilot.operator.planning import cpus, sizing
from kvpilot.operator.planning.models import find_model
from kvpilot.operator.planning.plan import PlanContext, plan
from tests.operator.planning.profiles import faster

BUILTIN = "amd-epyc-zen5-2c"
MODEL = "SmolLM2-135M-Instruct"


def spec(profile: str = BUILTIN, **fields: Any) -> InferenceServiceSpec:
    body: dict[str, Any] = {
        "model": {"name": MODEL},
        "accelerator": {"type": "cpu", "profile": profile},
        "serving": {"speculative": "off", "maxContextLength": 2048},
        "load": {"requestsPerSecond": 1, "meanPromptTokens": 200, "meanOutputTokens": 100},
        "slo": {"ttftP95Ms": 2000, "tpotP95Ms": 100},
        "autoscaling": {"maxReplicas": 16},
    }
    for key, value in fields.items():
        body[key] = {**body.get(key, {}), **value} if isinstance(value, dict) else value
    return InferenceServiceSpec.model_validate(body)


def builtin() -> DeviceProfile:
    return cpus.builtin_profiles()[BUILTIN]


def test_a_builtin_profile_plans_a_cpu_replica_and_renders_its_pod() -> None:
    s = spec()
    p = plan(s)
    assert p.fits and p.meets_slo and (p.gpu, p.device_profile, p.cpus) == ("cpu", BUILTIN, builtin().threads)
    bandwidth = builtin().memory_bandwidth_bytes_per_s / 1e9
    assert f"profile {BUILTIN} (AMD EPYC, 2 threads, {bandwidth:.0f} GB/s" in p.reasons["gpu"]
    assert "on a CPU the batch is capped at" in p.reasons["kvCache"]
    pod = render.deployment("chat", "ml", "uid", s, p)["spec"]["template"]["spec"]
    engine = pod["containers"][0]
    resources = engine["resources"]
    # Guaranteed: the engine runs one thread per CPU of its quota, as the profile was measured.
    assert resources["requests"] == resources["limits"] and resources["requests"]["cpu"] == "2"
    memory_gib = int(resources["requests"]["memory"].removesuffix("Gi"))
    assert (p.weight_bytes + p.kv_pool_bytes) / 1024**3 < memory_gib <= 4
    assert not any("gpu" in key for key in resources["requests"])
    assert pod["nodeSelector"] == {} and pod["tolerations"] == []
    args = engine["args"]
    assert args[args.index("--device") + 1] == "cpu"
    assert int(args[args.index("--kv-cache-memory-bytes") + 1]) == p.kv_pool_bytes
    assert int(args[args.index("--max-num-seqs") + 1]) == p.max_num_seqs


def _steps(profile: DeviceProfile, quantization: str) -> SchemeSteps:
    assert profile.engine is not None
    steps = profile.engine.scheme(quantization)
    assert steps is not None
    return steps


@pytest.mark.parametrize("quantization", ["none", "int8", "int4", "w8a8"])
def test_at_batch_one_the_plan_predicts_the_step_the_profile_measured(quantization: str) -> None:
    # Nearly no load: one sequence at a time, at the context the profile's steps ran at. The
    # prediction is then the profile's own batch-1 step of this model with this scheme, which a
    # wrong formula, unit or scheme would miss (the schemes' steps differ by 10-40 %).
    measured = _steps(builtin(), quantization).decode[0]
    context = round(measured.context_tokens)
    load = {"requestsPerSecond": 0.001, "meanPromptTokens": context - 8, "meanOutputTokens": 16}
    p = plan(spec(load=load, serving={"quantization": quantization}))
    assert p.quantization == quantization
    assert p.predicted_tpot_ms == pytest.approx(measured.seconds * 1000, rel=0.03, abs=1)  # whole ms
    # The first token: the measured step that computes a prompt of that length (between two
    # measured lengths, on the segment between them), then a decode step.
    short, longer = _steps(builtin(), quantization).prefill[:2]
    step_ms = measured.seconds * 1000
    middle = (short.tokens + longer.tokens) // 2
    for tokens, prefill_s in ((short.tokens, short.seconds), (middle, (short.seconds + longer.seconds) / 2)):
        at = plan(spec(load=load | {"meanPromptTokens": tokens}, serving={"quantization": quantization}))
        assert prefill_s * 1000 + 0.9 * step_ms < at.predicted_ttft_ms < prefill_s * 1000 + 1.2 * step_ms, tokens


def test_a_step_curve_that_falls_is_planned_as_its_non_decreasing_fit() -> None:
    assert cpus.non_decreasing([3.0, 1.0, 2.0, 5.0, 4.0]) == [2.0, 2.0, 2.0, 4.5, 4.5]
    assert cpus.non_decreasing([1.0, 2.0]) == [1.0, 2.0]
    # The built-in "none" batch-1 step as a slow minute on a shared VM could measure it: above
    # batch 2's. Taken as it is, a second sequence would cost less than nothing.
    engine = builtin().engine
    assert engine is not None
    none = engine.schemes[0]
    one, two = none.decode[:2]
    slow = one.model_copy(update={"seconds": two.seconds * 1.25})
    falling = none.model_copy(update={"decode": (slow, *none.decode[1:])})
    pooled = cpus.non_decreasing([s.seconds for s in falling.decode])[0]
    assert slow.seconds - pooled > 0.002  # apart by more than the prediction's tolerance
    profile = builtin().model_copy(
        update={"name": "falling", "engine": engine.model_copy(update={"schemes": (falling, *engine.schemes[1:])})}
    )
    context = round(one.context_tokens)
    load = {"requestsPerSecond": 0.001, "meanPromptTokens": context - 8, "meanOutputTokens": 16}
    p = plan(
        spec("falling", load=load, serving={"quantization": "none"}), PlanContext(device_profiles={"falling": profile})
    )
    assert p.predicted_tpot_ms == pytest.approx(pooled * 1000, rel=0.03, abs=1)


def test_a_longer_context_costs_the_attention_the_profile_measured() -> None:
    engine = builtin().engine
    assert engine is not None
    long = engine.long_context
    short = next(s for s in engine.schemes[0].decode if s.batch == long.batch)
    device = cpus.cpu_device(builtin(), find_model(MODEL))  # type: ignore[arg-type]
    assert not isinstance(device, str) and device.kv_read_bytes_per_s is not None
    per_token = (long.seconds - short.seconds) / (long.batch * (long.context_tokens - short.context_tokens))
    # Attention on this CPU reads the KV far slower than the memory bandwidth.
    assert device.kv_read_bytes_per_s < builtin().memory_bandwidth_bytes_per_s
    near, far = (
        plan(spec(load={"requestsPerSecond": 1e-6, "meanPromptTokens": n, "meanOutputTokens": 16})) for n in (100, 1100)
    )
    assert far.predicted_tpot_ms - near.predicted_tpot_ms == pytest.approx(1000 * per_token * 1000, rel=0.1)


def test_a_faster_profile_predicts_faster_steps_and_needs_fewer_replicas() -> None:
    fast = faster(builtin(), "fast", 4)
    s, f = spec(load={"requestsPerSecond": 6}), spec("fast", load={"requestsPerSecond": 6})
    slow_plan, fast_plan = plan(s), plan(f, PlanContext(device_profiles={"fast": fast}))
    assert slow_plan.fits and fast_plan.fits
    assert fast_plan.predicted_tpot_ms < slow_plan.predicted_tpot_ms / 2
    assert fast_plan.replicas < slow_plan.replicas
    assert fast_plan.max_num_seqs > slow_plan.max_num_seqs  # more sequences meet the TPOT SLO per step


def test_a_tighter_tpot_slo_caps_the_batch_lower() -> None:
    loose, tight = plan(spec()), plan(spec(slo={"tpotP95Ms": 40}))
    assert tight.max_num_seqs < loose.max_num_seqs and tight.kv_pool_bytes < loose.kv_pool_bytes


def test_an_fp32_cpu_holds_weights_and_kv_in_four_bytes() -> None:
    fp32 = builtin().model_copy(
        update={"name": "fp32", "engine": builtin().engine.model_copy(update={"dtype": "float32"})}  # type: ignore[union-attr]
    )
    bf16, wide = plan(spec()), plan(spec("fp32"), PlanContext(device_profiles={"fp32": fp32}))
    assert wide.weight_bytes == 2 * bf16.weight_bytes and wide.kv_bytes_per_token == 2 * bf16.kv_bytes_per_token


def test_a_draft_model_is_held_as_the_cpu_engine_holds_it() -> None:
    # In the engine's dtype there (fp32: 4 bytes per value), its tied head twice where the engine
    # packs weights for oneDNN, and its KV in that dtype.
    fp32 = builtin().model_copy(
        update={"name": "fp32", "engine": builtin().engine.model_copy(update={"dtype": "float32"})}  # type: ignore[union-attr]
    )
    drafted = {"speculative": "draft", "draftModel": "hf://HuggingFaceTB/SmolLM2-135M-Instruct", "quantization": "int4"}
    bf16, wide = (
        plan(spec(serving=drafted)),
        plan(spec("fp32", serving=drafted), PlanContext(device_profiles={"fp32": fp32})),
    )
    assert bf16.fits and bf16.speculative == "draft", bf16.reason
    arch = find_model(MODEL)
    assert arch is not None and arch.tie_word_embeddings
    assert bf16.draft_weight_bytes == sizing.weight_bytes(arch, "none", held=sizing.HeldAs(2, packed=True))
    assert bf16.draft_weight_bytes == (arch.parameters + arch.vocab_size * arch.hidden_size) * 2
    assert wide.draft_weight_bytes == sizing.weight_bytes(arch, "none", held=sizing.HeldAs(4, packed=True))
    assert wide.kv_bytes_per_token == 2 * bf16.kv_bytes_per_token  # the target's and the draft's both


def _without(scheme: str) -> DeviceProfile:
    engine = builtin().engine
    assert engine is not None
    kept = tuple(s for s in engine.schemes if s.quantization != scheme)
    return builtin().model_copy(update={"name": "partial", "engine": engine.model_copy(update={"schemes": kept})})


def test_a_scheme_is_tried_only_on_a_cpu_whose_profile_measured_its_steps() -> None:
    s = spec(serving={"quantization": "auto"})
    assert "not tried: fp8, which" in plan(s).reasons["quantization"]
    partial = plan(
        spec("partial", serving={"quantization": "auto"}), PlanContext(device_profiles={"partial": _without("w8a8")})
    )
    assert "not tried: fp8, w8a8" in partial.reasons["quantization"]
    pinned = plan(spec(serving={"quantization": "w8a8"}))
    assert pinned.fits and pinned.quantization == "w8a8"
    unmeasured = plan(
        spec("partial", serving={"quantization": "int4"}), PlanContext(device_profiles={"partial": _without("int4")})
    )
    assert unmeasured.failure == "InvalidDeviceProfile"
    assert "has no engine steps with quantization int4 (measured: none, int8, w8a8)" in unmeasured.reason


@pytest.mark.parametrize(
    "accelerator, problem",
    [
        ({"type": "cpu"}, "accelerator.type cpu needs accelerator.profile"),
        ({"type": "L4", "profile": BUILTIN}, "and only it takes one"),
        ({"type": "cpu", "profile": BUILTIN, "count": 2}, "a CPU replica is one engine process"),
        ({"type": "cpu", "profile": "Not_A_Name"}, "String should match pattern"),
    ],
)
def test_the_spec_refuses_a_cpu_without_its_profile(accelerator: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValidationError, match=problem):
        InferenceServiceSpec.model_validate({"model": {"name": MODEL}, "accelerator": accelerator})


def test_profiles_that_cannot_plan_say_why() -> None:
    unknown = plan(spec("nowhere"))
    assert unknown.failure == "UnknownDeviceProfile" and BUILTIN in unknown.reason and "ConfigMap" in unknown.reason
    unmeasured = builtin().model_copy(update={"engine": None, "engine_skipped": "no embedded model"})
    broken = plan(spec("bare"), PlanContext(device_profiles={"bare": unmeasured}))
    assert broken.failure == "InvalidDeviceProfile" and "no embedded model" in broken.reason
    told = plan(spec("told"), PlanContext(device_profiles={"told": "ConfigMap kvpilot/told has no profile.json key"}))
    assert told.failure == "InvalidDeviceProfile" and "has no profile.json" in told.reason
    vllm = plan(spec(runtime="vllm"))
    assert vllm.failure == "UnsupportedByRuntime" and "runtime kvpilot serves on CPUs" in vllm.reason


class _ConfigMaps:
    def __init__(self, data: dict[str, str] | None) -> None:
        self.data, self.reads = data, 0

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self.reads += 1
        assert (api_version, kind, namespace) == ("v1", "ConfigMap", "kvpilot")
        if self.data is None:
            return None
        return {"metadata": {"name": name, "namespace": namespace}, "data": self.data}


def test_the_operator_reads_a_profile_configmap_in_its_namespace() -> None:
    mine = faster(builtin(), "node-pool-a", 2)
    found = device_profiles([spec("node-pool-a")], _ConfigMaps({"profile.json": mine.to_json()}), "kvpilot")  # type: ignore[arg-type]
    assert found == {"node-pool-a": mine}
    assert plan(spec("node-pool-a"), PlanContext(device_profiles=found)).device_profile == "node-pool-a"
    bad = device_profiles([spec("node-pool-a")], _ConfigMaps({"profile.json": "{}"}), "kvpilot")  # type: ignore[arg-type]
    assert "is not valid" in str(bad["node-pool-a"]) and "memory_bandwidth_bytes_per_s" in str(bad["node-pool-a"])
    keyless = device_profiles([spec("node-pool-a")], _ConfigMaps({"other": "x"}), "kvpilot")  # type: ignore[arg-type]
    assert "has no profile.json key" in str(keyless["node-pool-a"])
    assert device_profiles([spec("node-pool-a")], _ConfigMaps(None), "kvpilot") == {}  # type: ignore[arg-type]
    # A built-in profile and a GPU spec cost no read.
    none = _ConfigMaps(None)
    device_profiles([spec()], none, "kvpilot")  # type: ignore[arg-type]
    device_profiles([InferenceServiceSpec.model_validate({"model": {"name": MODEL}})], none, "kvpilot")  # type: ignore[arg-type]
    assert none.reads == 0


def _compiled(step_s: float | None) -> DeviceProfile:
    engine = builtin().engine
    assert engine is not None
    return builtin().model_copy(
        update={"name": "compiled", "engine": engine.model_copy(update={"compiled_step_s": step_s})}
    )


def test_compiled_decoding_is_rendered_where_the_plan_tpot_needs_it() -> None:
    # Mostly lone sequences (short answers, a light load) under a TPOT SLO just below the eager
    # batch-1 step.
    eager_ms = _steps(builtin(), "none").decode[0].seconds * 1000
    tight = {"load": {"requestsPerSecond": 0.2, "meanPromptTokens": 60, "meanOutputTokens": 64}}
    s = spec("compiled", slo={"tpotP95Ms": round(eager_ms * 0.9)}, serving={"quantization": "none"}, **tight)
    compiled = plan(s, PlanContext(device_profiles={"compiled": _compiled(eager_ms * 0.6 / 1000)}))
    eager = plan(s, PlanContext(device_profiles={"compiled": _compiled(None)}))
    assert compiled.compile_decode and compiled.meets_slo and not eager.meets_slo
    assert compiled.replicas < eager.replicas
    assert "x0.60 of the eager one" in compiled.reasons["compiledDecode"], compiled.reasons
    assert compiled.predicted_tpot_ms < eager_ms * 0.9
    args = render.engine_args(s, compiled, MODEL)
    assert "--compile-decode" in args and args[args.index("--compile-cache-dir") + 1] == render.COMPILE_CACHE_DIR
    assert render.COMPILE_CACHE_DIR.startswith("/tmp/")  # the pod's writable emptyDir
    # Not where eager steps meet the SLO, nor without the profile's measurement.
    loose = plan(
        spec("compiled", serving={"quantization": "none"}, **tight),
        PlanContext(device_profiles={"compiled": _compiled(eager_ms * 0.6 / 1000)}),
    )
    assert not loose.compile_decode and "compiledDecode" not in loose.reasons
    unmeasured = plan(s, PlanContext(device_profiles={"compiled": _compiled(None)}))
    assert not unmeasured.compile_decode and "--compile-decode" not in render.engine_args(s, unmeasured, MODEL)


def test_compiled_decoding_counts_the_plain_weights_its_graph_reads_and_is_left_off_where_they_do_not_fit() -> None:
    # The built-in profile's engine packed its weights for oneDNN: eager steps read the packed ones,
    # the compiled graph the plain ones kept beside (engine/cpu/onednn_linear.py).
    assert builtin().engine is not None and builtin().engine.onednn_weights
    eager_ms = _steps(builtin(), "none").decode[0].seconds * 1000
    tight = {"load": {"requestsPerSecond": 0.2, "meanPromptTokens": 60, "meanOutputTokens": 64}}
    s = spec("compiled", slo={"tpotP95Ms": round(eager_ms * 0.9)}, serving={"quantization": "none"}, **tight)
    profile = _compiled(eager_ms * 0.6 / 1000)
    compiled = plan(s, PlanContext(device_profiles={"compiled": profile}))
    eager = plan(s, PlanContext(device_profiles={"compiled": _compiled(None)}))
    arch, bpv = find_model(MODEL), 2
    plain = sizing.weight_bytes(arch, "none", True, sizing.HeldAs(bpv, True, True)) - sizing.weight_bytes(
        arch, "none", True, sizing.HeldAs(bpv, True)
    )
    linear = arch.parameters - arch.vocab_size * arch.hidden_size - (2 * arch.layers + 1) * arch.hidden_size
    assert plain == linear * bpv  # the decoder layers' linear weights; the tied head's plain rows are the embedding
    assert compiled.compile_decode and compiled.weight_bytes == eager.weight_bytes + plain
    assert f"plain weights, {plain / sizing.GiB:.1f} GiB" in compiled.reasons["compiledDecode"]
    rendered = render.engine_args(s, compiled, MODEL)
    assert "--compile-decode" in rendered
    # A node whose memory holds the eager replica but not the plain copy too: eager steps it is.
    reserve = sizing.runtime_reserve_bytes(arch, compiled.max_num_batched_tokens)
    needed = eager.weight_bytes + compiled.kv_pool_bytes + reserve + plain // 2
    small = profile.model_copy(update={"memory_bytes": int(needed / s.serving.gpu_memory_utilization)})
    cramped = plan(s, PlanContext(device_profiles={"compiled": small}))
    assert cramped.fits and not cramped.compile_decode and cramped.weight_bytes == eager.weight_bytes
    assert "--compile-decode" not in render.engine_args(s, cramped, MODEL)
    assert cramped.reasons["compiledDecode"].startswith("off: a lone sequence's step x0.60"), cramped.reasons
    assert "plain weights its graph reads" in cramped.reasons["compiledDecode"]


def test_an_engine_that_packs_for_onednn_holds_a_tied_head_twice_and_reads_it_once() -> None:
    # The same steps measured by an engine that served full-precision weights from oneDNN's layout
    # ("none" holding the tied head's packed copy too: engine/cpu/onednn_linear.py) and by one
    # that did not.
    engine = builtin().engine
    assert engine is not None
    arch = find_model(MODEL)
    assert arch is not None and arch.tie_word_embeddings
    copy = arch.vocab_size * arch.hidden_size * 2
    none = engine.schemes[0]
    without = none.weight_bytes - (copy if engine.onednn_weights else 0)
    profiles = {
        name: builtin().model_copy(
            update={
                "name": name,
                "engine": engine.model_copy(
                    update={
                        "onednn_weights": packed,
                        "schemes": (
                            none.model_copy(update={"weight_bytes": without + (copy if packed else 0)}),
                            *engine.schemes[1:],
                        ),
                    }
                ),
            }
        )
        for name, packed in (("plain", False), ("packed", True))
    }
    for scheme, extra in (("none", copy), ("int4", 0)):  # a quantized head is not packed
        plain, twice = (
            plan(
                spec(name, load={"requestsPerSecond": 4}, serving={"quantization": scheme}),
                PlanContext(device_profiles=profiles),
            )
            for name in ("plain", "packed")
        )
        assert twice.weight_bytes - plain.weight_bytes == extra, scheme
        # A step still reads the head once: the same predicted latencies.
        assert (twice.predicted_tpot_ms, twice.predicted_ttft_ms) == (plain.predicted_tpot_ms, plain.predicted_ttft_ms)


def test_a_prefix_share_predicts_the_prefill_of_the_uncached_tokens_only() -> None:
    # Nearly no load, so TTFT is the prefill plus the wait for a step: a 512-token prompt of which
    # the prefix cache serves 3/4 costs the profile's measured 128-token prefill, not its 512 one.
    prefill = {step.tokens: step.seconds * 1000 for step in _steps(builtin(), "none").prefill}
    load = {"requestsPerSecond": 0.001, "meanPromptTokens": 512, "meanOutputTokens": 16}
    plain = plan(spec(load=load, serving={"quantization": "none"}))
    shared = plan(spec(load={**load, "prefixShare": 0.75}, serving={"quantization": "none"}))
    saved = plain.predicted_ttft_ms - shared.predicted_ttft_ms
    assert saved == pytest.approx(prefill[512] - prefill[128], abs=1.5), (plain.reasons, shared.reasons)
    # The decode steps hold the whole prompt's KV either way (TPOT moves only by the prefills that
    # interrupt them, now shorter).
    assert shared.kv_pool_bytes == plain.kv_pool_bytes
    assert plain.predicted_tpot_ms * 0.95 <= shared.predicted_tpot_ms <= plain.predicted_tpot_ms
    assert "prefill computes 128 of 512 prompt tokens (load.prefixShare 0.75" in shared.reasons["replicas"]
    assert "prefixShare" not in plain.reasons["replicas"]


@pytest.mark.parametrize("share", [-0.1, 1.0])
def test_a_prefix_share_outside_0_to_0_99_is_refused(share: float) -> None:
    with pytest.raises(ValidationError, match="prefix_share|prefixShare"):
        spec(load={"prefixShare": share})
