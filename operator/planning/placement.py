"""Where a plan's replicas run: the device types to try (a CPU node type of accelerator.profile,
else the GPU types the spec or the nodes name, smallest first) and the tensor-parallel sizes on each
(the runtime's, within one node, dividing the heads), with the reason text for the size chosen."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from kvpilot.engine.contract.config import EngineCapabilities
from kvpilot.engine.contract.device_profile import DeviceProfile
from kvpilot.operator.api.plan import Plan
from kvpilot.operator.api.spec import CPU_TYPE, Architecture, InferenceServiceSpec
from kvpilot.operator.planning import cpus, sizing
from kvpilot.operator.planning.device import Device
from kvpilot.operator.planning.gpus import GPUS, find_gpu
from kvpilot.operator.planning.reasons import failed_plan, rejected_because
from kvpilot.operator.runtimes import RUNTIMES

# Nothing to plan for: no GPU type named, none on the nodes. The reconcile looks again later
# (controller/reconcile.py's RETRIED), when nodes may have come.
NO_GPU_TYPE = "NoGPUType"


def devices_to_try(
    spec: InferenceServiceSpec,
    arch: Architecture,
    available: Iterable[str],
    profiles: Mapping[str, DeviceProfile | str],
) -> tuple[list[Device], tuple[Device, DeviceProfile] | None] | Plan:
    """The devices to try (the CPU of accelerator.profile, else GPUs), and the CPU with its profile
    for a CPU plan."""
    cpu = _cpu(spec, arch, profiles) if spec.accelerator.type == CPU_TYPE else None
    if isinstance(cpu, Plan):
        return cpu
    gpus = [cpu[0]] if cpu else _gpus(spec, available)
    if isinstance(gpus, Plan):
        return gpus
    return gpus, cpu


def _cpu(
    spec: InferenceServiceSpec, arch: Architecture, profiles: Mapping[str, DeviceProfile | str]
) -> tuple[Device, DeviceProfile] | Plan:
    """The CPU device of accelerator.profile: a built-in profile, else one of `profiles` (the
    operator's profile ConfigMaps; a string says why one could not be read)."""
    name = str(spec.accelerator.profile)
    known = {**cpus.builtin_profiles(), **profiles}
    profile = known.get(name)
    if profile is None:
        return failed_plan(
            spec,
            "UnknownDeviceProfile",
            f"accelerator.profile {name!r} is neither a built-in profile ({', '.join(cpus.builtin_profiles())}) "
            f"nor a ConfigMap of that name in the operator's namespace with a {cpus.PROFILE_CONFIGMAP_KEY} key",
        )
    if isinstance(profile, str):
        return failed_plan(spec, "InvalidDeviceProfile", profile)
    device = cpus.cpu_device(profile, arch)
    if isinstance(device, str):
        return failed_plan(spec, "InvalidDeviceProfile", device)
    return device, profile


def _gpus(spec: InferenceServiceSpec, available: Iterable[str]) -> list[Device] | Plan:
    wanted = spec.accelerator.type
    if wanted:
        gpu = find_gpu(wanted)
        if gpu is None:
            return failed_plan(spec, "UnknownGPU", f"GPU type {wanted!r} is not in the catalog ({', '.join(GPUS)})")
        return [gpu]
    found = {gpu.name: gpu for gpu in map(find_gpu, available) if gpu is not None}
    if not found:
        return failed_plan(
            spec, NO_GPU_TYPE, "spec.accelerator.type is not set and no node carries a known GPU product label"
        )
    # Smallest (cheapest) first, so the first that works wastes the least.
    return sorted(found.values(), key=lambda g: (g.memory_gib, g.bandwidth_gbps))


def heads_problem(arch: Architecture, tp: int) -> str | None:
    """Why `tp` GPUs cannot split `arch`'s attention, None when vLLM 0.33 splits it: the attention
    heads evenly, the KV heads evenly or, fewer than the GPUs, each copied to tp / KV heads of them
    (QKVParallelLinear's num_kv_head_replicas: a KV head on every GPU); a latent is not split (every
    GPU keeps it whole); a hybrid's state layers split their heads and convolution channels evenly."""
    kv_heads = {arch.kv_heads, arch.full_kv_shape[0]}  # Gemma 4's full-attention layers have their own
    kv_split = all(heads % tp == 0 or tp % heads == 0 for heads in kv_heads)
    if arch.attention_heads % tp or (arch.latent_dim is None and not kv_split):
        listed = " and ".join(str(heads) for heads in sorted(kv_heads))
        return f"TP {tp} does not divide {arch.attention_heads} attention heads and {listed} KV heads"
    state = arch.state
    if state is not None and (state.heads % tp or state.conv_channels % tp):
        return (
            f"TP {tp} does not divide the {state.kind} layers' {state.heads} heads and "
            f"{state.conv_channels} convolution channels"
        )
    return None


def kernels_problem(arch: Architecture, gpu: Device) -> str | None:
    """Why the planner does not plan `arch`'s attention on `gpu`, None when it does: DeepSeek Sparse
    Attention runs on vLLM 0.33's sparse MLA backends only (with none, vLLM finds no attention backend at
    start); the planner sizes CUDA's for compute capability 9 and 10 over DeepSeek's latent. ROCm's
    (AITER's, which pads its pages otherwise) and SM120's (fp8_ds_mla even for a 16-bit cache) it does not."""
    if arch.indexer is None:
        return None
    if arch.latent_dim != sizing.SPARSE_LATENT_VALUES:
        return (
            f"sparse attention over a {arch.latent_dim}-value latent: the planner sizes vLLM 0.33's sparse MLA "
            f"kernels for DeepSeek's {sizing.SPARSE_LATENT_VALUES}-value one"
        )
    if gpu.cuda_major in sizing.SPARSE_MLA_CUDA_MAJORS:
        return None
    where = f"compute capability {gpu.cuda_major}.x" if gpu.cuda_major is not None else "not a CUDA GPU"
    return (
        f"{gpu.name} ({where}): sparse attention (the lightning indexer) is planned on the GPUs of vLLM 0.33's "
        "sparse MLA kernels the planner sizes, Hopper's and Blackwell's (compute capability 9.x and 10.x)"
    )


def tensor_parallel_sizes(
    spec: InferenceServiceSpec, arch: Architecture, gpu: Device, capabilities: EngineCapabilities, per_node: int | None
) -> tuple[list[int], str]:
    """The tensor-parallel sizes to try on `gpu`, smallest first, and what rules the others out:
    the runtime's sizes (or the pinned accelerator.count), within one node (the most GPUs the
    cluster's nodes of the type carry, else the catalog's), dividing the heads."""
    kernels = kernels_problem(arch, gpu)
    if kernels:
        return [], kernels
    sizes = [spec.accelerator.count] if spec.accelerator.count else list(capabilities.tensor_parallel_sizes)
    most, where = (per_node, "the cluster's nodes carry") if per_node else (gpu.max_per_node, "a node holds")
    usable, ruled_out = [], []
    for tp in sizes:
        if tp > most:
            ruled_out.append(f"TP {tp} > the {most} {gpu.name} GPUs {where}")
        elif heads_problem(arch, tp):
            ruled_out.append(str(heads_problem(arch, tp)))
        else:
            usable.append(tp)
    return usable, "; ".join(ruled_out)


def tp_reason(spec: InferenceServiceSpec, chosen: Plan, smaller: Sequence[Plan], ruled_out: str) -> str:
    """Why this many GPUs per replica, and why not fewer."""
    tp = chosen.gpu_count
    if spec.accelerator.count:
        return f"{tp}: set in the spec (accelerator.count)"
    sizes = ", ".join(map(str, RUNTIMES[spec.runtime].capabilities.tensor_parallel_sizes))
    why = "fits and meets the SLO" if chosen.meets_slo else "fits"
    text = f"{tp}: the smallest of runtime {spec.runtime}'s sizes ({sizes}) on {chosen.gpu} that {why}"
    if tp > 1:
        text += f", over {find_gpu(str(chosen.gpu)).link}"  # type: ignore[union-attr]
    rejected = [f"TP {o.gpu_count}: {rejected_because(o)}" for o in smaller]
    return text + (f" (rejected {'; '.join(rejected)})" if rejected else "") + (f"; {ruled_out}" if ruled_out else "")


def most_per_node(gpus_per_node: Mapping[str, int]) -> dict[str, int]:
    """The most GPUs of each catalog type one node carries, from the nodes' product labels and counts."""
    most: dict[str, int] = {}
    for product, count in gpus_per_node.items():
        known = find_gpu(product)
        if known is not None and count > 0:
            most[known.name] = max(most.get(known.name, 0), count)
    return most
