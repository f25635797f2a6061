"""The choices a plan makes besides its device: what the runtime can run, the quantization schemes to try,
the draft model, the speculative mode and compiled decoding."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from kvpilot.engine.contract.config import EngineCapabilities
from kvpilot.operator.api.plan import Plan
from kvpilot.operator.api.spec import CPU_TYPE, Architecture, InferenceServiceSpec, hub_source
from kvpilot.operator.planning import recurrent, sizing, speculation
from kvpilot.operator.planning.device import Device
from kvpilot.operator.planning.latency import SPECULATION_MAX_BATCH, Perf, draft_acceptance, fewest_replicas
from kvpilot.operator.planning.memory import Memory, divide_memory, with_plain_weights
from kvpilot.operator.planning.model_config import EAGLE3_TARGETS, HYBRID_MTP, MTP_FAMILIES, ModelConfig
from kvpilot.operator.planning.models import MODELS, find_model
from kvpilot.operator.planning.reasons import failed_plan, gib, listed, ms, rejected_because
from kvpilot.operator.planning.replica import DRAFT_MODEL_MODES, DRAFTED, Draft, Inputs, held_weights
from kvpilot.operator.runtimes import RUNTIMES
from kvpilot.operator.runtimes.vllm import VLLM_VERSION

# Least lossy first: INT8 weight-only keeps the activations and rounds each weight to one of 256
# levels, W8A8 rounds the activations too, INT4 has only 16 levels per group of weights.
QUALITY_ORDER = ("none", "int8", "fp8", "w8a8", "int4")


HIGH_TEMPERATURE = 1.0


class Speculation(NamedTuple):
    """The speculative mode a (GPU, quantization) pair runs, with the memory and replicas it gives."""

    mode: str
    reason: str
    memory: Memory
    replicas: int
    perf: Perf
    miss: str | None
    compiled: str = ""  # why the plan compiles a lone sequence's decode step, when it does


def unsupported_pins(spec: InferenceServiceSpec, capabilities: EngineCapabilities) -> str | None:
    """Why the spec pins options its runtime cannot run, None when it pins none."""
    runtime = f"runtime {spec.runtime}"
    cpu = spec.accelerator.type == CPU_TYPE
    problems = [
        f"{field} {value!r} is not one {runtime} runs (supported: {listed(supported)}{auto})"
        for field, value, supported, auto in (
            (
                "serving.quantization",
                spec.serving.quantization,
                (
                    *capabilities.quantization,
                    *(capabilities.cpu_only_quantization if cpu else ()),
                    *((spec.model.quantization,) if spec.model.quantization else ()),
                ),
                "; or 'auto'",
            ),
            ("serving.speculative", spec.serving.speculative, capabilities.speculative, "; or 'auto'"),
            ("serving.kvCacheDtype", spec.serving.kv_cache_dtype, capabilities.kv_cache_dtypes, "; or 'auto'"),
            ("model.quantization", spec.model.quantization, capabilities.checkpoint_quantization, ""),
        )
        if value not in (None, "auto") and value not in supported
    ]
    if spec.serving.quantization in capabilities.cpu_only_quantization and not cpu:
        problems.append(f"serving.quantization {spec.serving.quantization} runs on CPUs only (accelerator.type cpu)")
    block = spec.serving.block_size
    if capabilities.block_sizes is not None and block not in capabilities.block_sizes:
        problems.append(f"serving.blockSize {block}: {runtime} runs {listed(map(str, capabilities.block_sizes))}")
    if spec.accelerator.type == CPU_TYPE and capabilities.tensor_parallel_sizes != (1,):
        problems.append(f"accelerator.type cpu: {runtime} is planned on GPUs only; runtime kvpilot serves on CPUs")
    count = spec.accelerator.count
    if count is not None and count not in capabilities.tensor_parallel_sizes:
        others = [n for n, r in RUNTIMES.items() if count in r.capabilities.tensor_parallel_sizes]
        problems.append(
            f"accelerator.count {count}: {runtime} runs {listed(map(str, capabilities.tensor_parallel_sizes))} "
            "GPU(s) per replica" + (f"; runtime: {others[0]} runs tensor parallelism over {count}" if others else "")
        )
    return "; ".join(problems + _adapter_pins(spec)) or None


def _adapter_pins(spec: InferenceServiceSpec) -> list[str]:
    """Why the runtime cannot serve the spec's adapters as it pins the rest, [] when it can."""
    runtime = RUNTIMES[spec.runtime]
    if not spec.adapters:
        return []
    if not runtime.lora:
        return [f"spec.adapters: runtime {spec.runtime} serves no LoRA adapters"]
    mode = spec.serving.speculative
    if mode != "auto" and mode not in runtime.lora_speculative:
        return [
            f"serving.speculative {mode!r}: runtime {spec.runtime} does not run it with spec.adapters (with them: "
            f"{listed(runtime.lora_speculative)}; or 'auto')"
        ]
    return []


def with_adapters(spec: InferenceServiceSpec, capabilities: EngineCapabilities) -> EngineCapabilities:
    """What the runtime runs for this spec: with adapters, only the speculative modes it runs beside them."""
    if not spec.adapters:
        return capabilities
    modes = RUNTIMES[spec.runtime].lora_speculative
    return capabilities.model_copy(update={"speculative": tuple(m for m in capabilities.speculative if m in modes)})


def drafted_source(spec: InferenceServiceSpec, capabilities: EngineCapabilities | None = None) -> str | None:
    """serving.draftModel when a plan may run it (under a mode that may choose it, on a runtime that
    runs that mode: the spec's, or `capabilities`), else None."""
    source = spec.serving.draft_model
    capabilities = capabilities or with_adapters(spec, RUNTIMES[spec.runtime].capabilities)
    mode = "draft" if spec.serving.speculative == "auto" else spec.serving.speculative
    return source if source is not None and mode in DRAFT_MODEL_MODES and mode in capabilities.speculative else None


def given_draft_architecture(spec: InferenceServiceSpec) -> Architecture | None:
    """The draft's architecture as the spec (serving.draftModelArchitecture) or the catalog (by its
    repository or folder name) give it; None: its checkpoint's config.json is read."""
    source = spec.serving.draft_model
    if source is None:
        return None
    hub = hub_source(source)
    return spec.serving.draft_model_architecture or find_model(hub.repo if hub else source.rstrip("/"))


def unloaded_class(arch: Architecture, capabilities: EngineCapabilities, runtime: str) -> str | None:
    """Why `runtime` would not load `arch`'s model class (config.json's architectures[0]), None when it
    would; an architecture written by hand (no class) is taken as the plain decoder it describes."""
    loaded = capabilities.architectures
    if loaded is None or arch.hf_architecture is None or arch.hf_architecture in loaded:
        return None
    return f"it is a {arch.hf_architecture}, and runtime {runtime} loads only {', '.join(loaded)}: use runtime vllm"


def _draft_refusal(
    spec: InferenceServiceSpec, config: ModelConfig, capabilities: EngineCapabilities, target: Architecture
) -> tuple[str, str] | None:
    """The failure and the reason why the runtime would not run, or the planner cannot size, this
    draft; None when it can."""
    arch, stored = config
    beyond = sizing.beyond_plain_decoder(arch)
    runs = f"runtime {spec.runtime}"
    if arch.state is not None:
        return "UnsupportedByRuntime", f"it has {beyond}, which the planner does not size for a draft"
    if target.indexer is not None and arch.sliding_window is not None:
        # vLLM groups such a draft's pages among the indexer's and the latent's, which the planner does not size.
        return "UnsupportedByRuntime", "it has windowed layers, which the planner does not size beside sparse attention"
    if beyond and capabilities.plain_decoders_only:
        return (
            "UnsupportedByRuntime",
            f"it has {beyond}, and {runs} runs only decoders whose every layer attends to the whole sequence, "
            "text only: use runtime vllm",
        )
    unloaded = unloaded_class(arch, capabilities, spec.runtime)
    if unloaded:
        return "UnsupportedByRuntime", unloaded
    if stored is not None and not capabilities.holds_checkpoint_as_stored:
        return "UnsupportedByRuntime", f"it is stored as {stored}, and {runs} loads a draft at 16 bits"
    if stored is not None and arch.checkpoint_bytes is None:
        return (
            "InvalidArchitecture",
            f"it is stored as {stored}, sized from its safetensors' bytes, which are not known",
        )
    return _eagle3_refusal(spec, arch, target)


def _eagle3_refusal(spec: InferenceServiceSpec, draft: Architecture, target: Architecture) -> tuple[str, str] | None:
    """Why vLLM would not draft with an EAGLE-3 head here; None when it would (or it is none)."""
    if not draft.eagle3_head:
        return None
    if spec.serving.speculative != "eagle":
        return (
            "UnsupportedByRuntime",
            "it is an EAGLE-3 head (config.json's architectures): set serving.speculative eagle",
        )
    if target.hf_architecture is None:
        return (
            "UnsupportedByRuntime",
            f"it is an EAGLE-3 head, which drafts from the target's hidden states, and {spec.model.name}'s "
            "architecture class is not known: set model.architecture.hfArchitecture (config.json's architectures[0])",
        )
    if target.hf_architecture not in EAGLE3_TARGETS:
        return (
            "UnsupportedByRuntime",
            f"it is an EAGLE-3 head, which drafts from three of the target's layers' hidden states, and vLLM "
            f"{VLLM_VERSION}'s {target.hf_architecture} does not give them (its {listed(sorted(EAGLE3_TARGETS))} do)",
        )
    return None


def draft_model(
    spec: InferenceServiceSpec,
    target: Architecture,
    capabilities: EngineCapabilities,
    checkpoint: ModelConfig | None = None,
) -> Draft | Plan | None:
    """The draft model a plan may run (serving.draftModel, under a mode that may choose it; the
    checkpoint's MTP modules under mtp), a failed Plan when it cannot be sized or the engine would
    refuse it, None when there is none. Its architecture: the spec's or the catalog's, else
    `checkpoint` (its config.json as read)."""
    if spec.serving.speculative == "mtp":
        return mtp_draft(spec, target)
    source = drafted_source(spec, capabilities)
    if source is None:
        return None
    given = given_draft_architecture(spec)
    config = ModelConfig(given, None) if given is not None else checkpoint
    if config is None:
        return failed_plan(
            spec,
            "UnknownDraftModel",
            f"serving.draftModel {source!r} is not a catalog model ({', '.join(MODELS)}) by its "
            "repository or folder name, serving.draftModelArchitecture is not set, and its config.json was "
            "not read (the operator reads it from the Hub, a claim or the engine image): the planner needs "
            "the draft's size",
        )
    arch = config.architecture
    problem = sizing.architecture_problem(arch)
    refusal = ("InvalidArchitecture", problem) if problem else _draft_refusal(spec, config, capabilities, target)
    if refusal is not None:
        return failed_plan(spec, refusal[0], f"serving.draftModel {source!r}: {refusal[1]}")
    if arch.vocab_size != target.vocab_size:
        return failed_plan(
            spec,
            "DraftVocabularyMismatch",
            f"serving.draftModel {source!r} has a vocabulary of {arch.vocab_size} tokens and "
            f"{spec.model.name} {target.vocab_size}: the engine drafts only with the target's "
            "tokens, so it would refuse this draft",
        )
    stored = arch.loaded_checkpoint_bytes if config.quantization else None
    weights = held_weights(arch, stored, sizing.weight_bytes(arch, "none"))
    return Draft(source, arch, weights, sizing.kv_bytes_per_token(arch), stored=stored)


def mtp_draft(spec: InferenceServiceSpec, target: Architecture) -> Draft | Plan:
    """The target's MTP modules as vLLM 0.33 drafts with them (speculative method mtp), or why it
    would not: a checkpoint that lacks them (DeepSeek's drafter refuses it at load, GLM's would draft
    with uninitialized weights), and k drafts with n modules where n does not divide k. Held as the
    checkpoint stores them, or in 16 bits; each draft step also computes with the target's LM head,
    which vLLM shares with them."""
    modules, where = target.mtp, spec.model.source or spec.model.name
    if modules is None:
        return failed_plan(
            spec,
            "NoMtpModules",
            f"serving.speculative mtp: {where} describes no multi-token-prediction modules vLLM drafts with "
            f"(model.architecture.mtp: config.json's num_nextn_predict_layers of {listed(sorted(MTP_FAMILIES))}, "
            f"or the modules of {listed(sorted(HYBRID_MTP))})",
        )
    if not target.mtp_bytes:
        held = "holds none" if target.checkpoint_bytes else "is not known to hold them (model.architecture.mtpBytes)"
        return failed_plan(
            spec,
            "NoMtpModules",
            f"serving.speculative mtp: the checkpoint of {where} {held}, and vLLM would load an MTP drafter "
            "without its layers (DeepSeek's refuses to start, GLM's drafts with uninitialized weights)",
        )
    k = spec.serving.num_speculative_tokens
    if k > modules.layers and k % modules.layers:
        return failed_plan(
            spec,
            "UnsupportedByRuntime",
            f"serving.numSpeculativeTokens {k}: vLLM {VLLM_VERSION} runs more drafts than the {modules.layers} MTP "
            "modules only in whole rounds of them (a multiple)",
        )
    drafter = sizing.mtp_drafter(target)
    loaded = target.loaded_checkpoint_bytes
    stored = None
    if spec.model.quantization and loaded:
        # At the checkpoint's mean bytes per value (the projection, eh_proj or fc, in 16 bits), or the MTP
        # tensors' own bytes less the copies of the embedding and the head DeepSeek and GLM store beside
        # them (vLLM uses the target's; Qwen3-Next's and Qwen3.5's hold none), whichever is more: a
        # checkpoint may keep its MTP layers in 16 bits.
        projection = modules.layers * 2 * target.hidden_size**2
        mean = (modules.parameters - projection) * loaded // target.parameters + projection * sizing.BYTES_PER_VALUE
        copied = 0 if target.state is not None else 2 * target.vocab_size * target.hidden_size
        copies = modules.layers * copied * sizing.BYTES_PER_VALUE
        stored = max(mean, target.mtp_bytes - copies)
    weights = held_weights(drafter, stored, sizing.weight_bytes(drafter, "none"))
    return Draft(
        f"{where} (its MTP modules)",
        drafter,
        weights,
        sizing.kv_bytes_per_token(drafter),
        stored=stored,
        shared_values=target.vocab_size * target.hidden_size,
    )


class Situation(NamedTuple):
    """What speculation's choice rests on: the replica's predicted running batch, whether its TPOT
    is nearer its SLO than its TTFT, and the load's sampling temperature."""

    batch: float
    tpot_bound: bool
    temperature: float


def choose_speculative(
    mode: str, situation: Situation, *, draft_model: str | None, supported: Sequence[str]
) -> tuple[str, str]:
    """The speculative mode to run and why; `supported` are the engine's modes, and a pinned
    `mode` is one of them (plan() refuses a spec pinning any other)."""
    batch, tpot_bound, temperature = situation
    if mode != "auto":
        return mode, f"{mode}: set in the spec"
    if not set(supported) - {"off"}:
        return "off", f"off: this runtime runs no speculative mode (supported: {listed(supported)})"
    if batch > SPECULATION_MAX_BATCH:
        return "off", (
            f"off: predicted batch {batch:.1f} per replica > {SPECULATION_MAX_BATCH}, "
            "the device is already busy and speculation has no spare compute to use"
        )
    if temperature >= HIGH_TEMPERATURE:
        return "off", (f"off: temperature {temperature:g} >= {HIGH_TEMPERATURE:g}, drafts are rarely accepted")
    if not tpot_bound:
        return "off", "off: TTFT, not TPOT, is closest to its SLO; speculation only shortens TPOT"
    # A draft model accepts more tokens than prompt-lookup n-grams, when there is one to run.
    proposers = [m for m in (("draft",) if draft_model else ()) + ("ngram",) if m in supported]
    if not proposers:
        return "off", (
            f"off: speculation would pay, but this engine's modes "
            f"({listed(supported)}) need a serving.draftModel, which is not set"
        )
    return proposers[0], (
        f"{proposers[0]}: predicted batch {batch:.1f} per replica <= "
        f"{SPECULATION_MAX_BATCH}, low temperature and a TPOT-bound SLO"
    )


def state_speculation(arch: Architecture, mode: str) -> str | None:
    """Why speculative `mode` does not run (or is not sized) beside `arch`'s state layers; None where it
    runs, or there are none. vLLM keeps Mamba-2 and Gated DeltaNet layers a state per draft token
    (planning/recurrent.py sizes them); a drafter's own layers would share the hybrid's raised blocks."""
    state = arch.state
    if state is None or mode == "off":
        return None
    if state.kind not in recurrent.SPECULATING_KINDS:
        return (
            f"its {state.layers} {state.kind} layers verify no drafts: vLLM 0.33's Mamba (1) mixer decodes one "
            "token per sequence and step"
        )
    if mode in DRAFT_MODEL_MODES:
        return (
            f"{'a draft model' if mode == 'draft' else 'an EAGLE head'}'s layers would share the blocks vLLM raises "
            f"for its {state.layers} {state.kind} "
            "layers' state pages, which the planner does not size (ngram, or mtp where the checkpoint has "
            "the modules, are)"
        )
    return None


def choose_speculation(inputs: Inputs, memory: Memory, device: tuple[Device, int]) -> Speculation:
    """The speculative mode for a replica whose memory is `memory` (sized with the draft when the
    spec pins one; `inputs.draft` is the draft a mode may run), and the replicas it then needs."""
    spec, capabilities, draft = inputs.spec, inputs.capabilities, inputs.draft
    serving = spec.serving
    k = serving.num_speculative_tokens
    off = Speculation("off", "", memory, *fewest_replicas(spec, memory.replica, "off"))
    perf = off.perf
    tpot_bound = perf.tpot_s * 1000 / spec.slo.tpot_p95_ms >= perf.ttft_s * 1000 / spec.slo.ttft_p95_ms

    def choose(draft_model: str | None) -> tuple[str, str]:
        return choose_speculative(
            serving.speculative,
            Situation(batch=perf.batch, tpot_bound=tpot_bound, temperature=spec.load.temperature),
            draft_model=draft_model,
            supported=capabilities.speculative,
        )

    state = inputs.arch.state
    mode, reason = choose(draft.source if draft and state is None else None)
    beside = state_speculation(inputs.arch, mode)
    if beside:
        # plan() refuses such a pinned mode; auto leaves speculation off.
        mode, reason = "off", f"off: {beside}"
    elif serving.speculative == "auto" and draft and state is not None:
        reason += f" (serving.draftModel {draft.source} is not run: {state_speculation(inputs.arch, 'draft')})"
    if mode != "off" and serving.speculative == "auto" and (mode == "draft" or state is not None):
        memory, mode, reason = _sized_speculating(inputs, memory, device, (mode, reason), choose)
    if mode in DRAFTED and draft is not None:
        reason += (
            f"; {_drafter(mode, draft)} {draft.source}: {gib(draft.weights)} GiB of "
            f"weights ({'as stored' if draft.stored else 'unquantized'}), "
            f"{draft.kv_per_token / sizing.MiB:.3g} MiB of KV per token; "
            + f"{draft_acceptance(inputs.correction, mode, k):.2f} of drafts accepted, "
            + (
                "observed (status.correction)"
                if mode in dict(inputs.correction.acceptance)
                else "assumed (not measured)"
            )
        )
    if mode == "off":
        off = off._replace(reason=reason)
    else:
        memory = _adapters_verify_in_one_step(spec, memory)
        speculating = Speculation(mode, reason, memory, *fewest_replicas(spec, memory.replica, mode))
        if serving.speculative != "auto" or not _observed_worse(speculating, off):
            return speculating
        off = off._replace(reason=_observed_reason(speculating, off, k))
    # Adapters run in the engine's eager step only, which a compiled decode step would bypass.
    return _compiled(spec, off) if off.memory.replica.gpu.compiled_step_factor and not spec.adapters else off


def _sized_speculating(
    inputs: Inputs,
    memory: Memory,
    device: tuple[Device, int],
    chosen: tuple[str, str],
    choose: Callable[[str | None], tuple[str, str]],
) -> tuple[Memory, str, str]:
    """A mode auto chose with the target sized alone, sized again as it runs: beside the draft's weights
    and KV, or with a hybrid's state pages for its draft tokens. Where that does not fit: the mode
    chosen without a draft model, or off beside state layers."""
    mode, reason = chosen
    drafted = mode == "draft"
    resized = divide_memory(
        inputs._replace(draft=inputs.draft if drafted else None, speculating=True), device, memory.sizes.quantization
    )
    if not isinstance(resized, Plan):
        return resized, mode, reason
    if drafted:
        mode, reason = choose(None)
        return memory, mode, f"{reason} (the draft model does not fit: {resized.reason})"
    return memory, "off", f"off: {mode} would pay, but the state pages of its draft tokens do not fit: {resized.reason}"


def _drafter(mode: str, draft: Draft) -> str:
    if mode == "mtp":
        return "drafting with"
    if mode != "eagle":
        return "draft model"
    return "EAGLE-3 head (vLLM's method eagle3)" if draft.arch.eagle3_head else "EAGLE head"


def _adapters_verify_in_one_step(spec: InferenceServiceSpec, memory: Memory) -> Memory:
    """A speculating replica serving adapters: vLLM refuses LoRA beside speculation unless every running
    sequence's k + 1 verified tokens fit one step (max_num_batched_tokens >= max_num_seqs x (k + 1)), so
    it runs at most budget / (k + 1) sequences (our engine is planned alike)."""
    k = spec.serving.num_speculative_tokens
    cap = memory.budget // (k + 1)
    if not spec.adapters or memory.replica.max_num_seqs <= cap:
        return memory
    return memory._replace(
        replica=memory.replica._replace(max_num_seqs=cap),
        kv_reason=f"{memory.kv_reason}; {cap} sequences run at most: with adapters and speculation each "
        f"step verifies k + 1 = {k + 1} tokens of every running sequence within its {memory.budget}-token budget",
    )


def _observed_worse(speculating: Speculation, off: Speculation) -> bool:
    """Whether a speculative mode the engines' observed acceptance is known for does no better than
    no speculation: more replicas, or as many and a TPOT no lower."""
    if speculating.mode not in dict(speculating.memory.replica.correction.acceptance):
        return False
    ranked = ((s.miss is None, -s.replicas, -s.perf.tpot_s) for s in (speculating, off))
    return next(ranked) <= next(ranked)


def _observed_reason(speculating: Speculation, off: Speculation, k: int) -> str:
    acceptance = draft_acceptance(speculating.memory.replica.correction, speculating.mode, k)
    return (
        f"off: {speculating.mode} would be chosen ({speculating.reason}), but with the acceptance its engines "
        f"reported, {acceptance:.2f} of drafts (status.correction; assumed "
        f"{speculation.assumed_acceptance(speculating.mode, k):.2f}), it "
        f"predicts TPOT {ms(speculating.perf.tpot_s)} ms at {speculating.replicas} replica(s) against "
        f"{ms(off.perf.tpot_s)} ms at {off.replicas} without drafts"
    )


def _compiled(spec: InferenceServiceSpec, eager: Speculation) -> Speculation:
    """Compiled decoding where the plan's TPOT needs it: when compiling a lone sequence's step (as
    the profile measured it) meets the SLO where eager steps do not, or with fewer replicas, and the
    plain weights the compiled graph reads fit beside the packed ones the eager steps read."""
    replica = eager.memory.replica._replace(compiled=True)
    replicas, perf, miss = fewest_replicas(spec, replica, "off")
    factor = replica.gpu.compiled_step_factor
    if (miss is None, -replicas) <= (eager.miss is None, -eager.replicas):
        return eager
    sizes, plain = with_plain_weights(spec, eager.memory)
    gain = (
        f"a lone sequence's step x{factor:.2f} of the eager one (the profile's measurement) "
        f"{'meets the SLO' if miss is None else 'comes closest to the SLO'} with {replicas} replica(s) where "
        f"eager steps need {eager.replicas}" + ("" if eager.miss is None else f" and miss it ({eager.miss})")
    )
    if sizes is None:
        return eager._replace(
            compiled=f"off: {gain}, but the plain weights its graph reads, {gib(plain)} GiB beside the packed "
            f"ones, do not fit the node's {gib(eager.memory.replica.gpu.memory_bytes)} GiB"
        )
    why = f"on: {gain}"
    if plain:
        why += f"; the compiled graph reads plain weights, {gib(plain)} GiB beside the packed ones"
    memory = eager.memory._replace(replica=replica, sizes=sizes)
    return Speculation(eager.mode, eager.reason, memory, replicas, perf, miss, why)


def quantization_schemes(
    spec: InferenceServiceSpec, capabilities: EngineCapabilities, cpu: Device | None
) -> tuple[tuple[str, ...], str] | Plan:
    """The quantization schemes to try, least lossy first, and what was left out and why; on a
    CPU also those whose kernels run only there, where its profile measured them."""
    stored = spec.model.quantization
    if stored is not None and spec.serving.quantization not in ("auto", stored):
        return failed_plan(
            spec,
            "QuantizationMismatch",
            f"the checkpoint is quantized as {stored} (model.quantization): the runtime serves it as "
            f"stored and cannot re-quantize it to serving.quantization {spec.serving.quantization}; "
            f"set serving.quantization to auto or {stored}",
        )
    # On a CPU, only the schemes whose engine steps its profile measured: the others' cost is unknown.
    stepped = dict(cpu.measured.step_overhead_curves) if cpu and cpu.measured else {}
    if stored is not None or spec.serving.quantization != "auto":
        pinned = stored or spec.serving.quantization
        if cpu and pinned not in stepped:
            return failed_plan(
                spec,
                "InvalidDeviceProfile",
                f"{cpu.source} has no engine steps with quantization {pinned} (measured: {listed(stepped)}): "
                "measure the node type again with `kvpilot profile`",
            )
        return (pinned,), ""
    # Only the schemes the runtime applies on load, and of those only the ones sizing knows the bytes of.
    runs = (
        tuple(s for s in (*capabilities.quantization, *capabilities.cpu_only_quantization) if s in stepped)
        if cpu
        else capabilities.quantization
    )
    schemes = tuple(s for s in QUALITY_ORDER if s in runs)
    if not schemes:
        return failed_plan(
            spec,
            "UnsupportedByRuntime",
            f"runtime {spec.runtime} runs no quantization scheme the planner can "
            f"size (supported: {listed(capabilities.quantization)})",
        )
    skipped = [s for s in QUALITY_ORDER if s not in schemes]
    return schemes, (
        f"; not tried: {listed(skipped)}, which runtime {spec.runtime} does not apply on load "
        f"(supported: {listed(capabilities.quantization)}"
        + (
            f"; on a CPU whose profile measured them also {listed(capabilities.cpu_only_quantization)})"
            if capabilities.cpu_only_quantization
            else ")"
        )
        if skipped
        else ""
    )


def kv_cache_dtypes(spec: InferenceServiceSpec, capabilities: EngineCapabilities, gpu: Device) -> tuple[str, ...]:
    """The KV cache dtypes to try on `gpu`, in the order of preference: the pinned one, else the
    model's 16-bit one and then FP8 where the runtime stores it and the GPU has FP8."""
    pinned = spec.serving.kv_cache_dtype
    if pinned != "auto":
        return (pinned,)
    return ("model", "fp8") if "fp8" in capabilities.kv_cache_dtypes and gpu.fp8 else ("model",)


def kv_cache_dtype_reason(spec: InferenceServiceSpec, chosen: Plan, earlier: Sequence[Plan]) -> dict[str, str]:
    """Why the KV cache is FP8, where it is (the 16-bit cache of the same option is what it beat)."""
    if chosen.kv_cache_dtype != "fp8":
        return {}
    if spec.serving.kv_cache_dtype == "fp8":
        return {"kvCacheDtype": "fp8: set in the spec"}
    same = [
        o
        for o in earlier
        if (o.gpu, o.quantization, o.gpu_count) == (chosen.gpu, chosen.quantization, chosen.gpu_count)
    ]
    why = rejected_because(same[-1]) if same else "not tried"
    return {"kvCacheDtype": f"fp8: one byte per value, twice the tokens of the 16-bit cache (with it: {why})"}
