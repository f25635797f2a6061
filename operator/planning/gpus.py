"""Accelerators the planner can size for, from the vendors' public spec sheets.

`memory_gib` is the marketed capacity; the planner sizes with `usable_memory_mib`, the total the
device reports (nvidia-smi's memory.total, as printed in public nvidia-smi outputs of each part:
T4 15360, L4 23034, A10G 23028, L40S 46068, A100 40960 / 81920, H100 81559, H200 143771, B200
183359 MiB), which ECC and firmware reservations put a few per cent under the marketed figure on
all but the A100. MI300X's is the marketed 192 GiB, not checked against a device. Bandwidth and
throughput are the spec sheets' decimal GB/s and TFLOP/s, always the dense figures (the spec
sheets' headline numbers assume 2:4 sparsity, which LLM weights lack).

Tensor parallelism all-reduces over the GPUs' interconnect: `link_gbps` is one GPU's bandwidth in
one direction (half the spec sheets' bidirectional NVLink / Infinity Fabric figure; PCIe x16 for
cards without NVLink: 16 GB/s Gen3, 32 GB/s Gen4), and `link_latency_us` the fixed cost of one
all-reduce call: 10 us over NVLink / Infinity Fabric and 30 us over PCIe, ASSUMED from published
nccl-tests small-message all-reduce times (8 GPUs), not measured here (no GPU was at hand).
`max_per_node` is the most GPUs of the type one node carries (8 on DGX/HGX boards and on the largest
cloud instances of every type here: p5/p4d, g6e/g6/g5.48xlarge, g4dn.metal, a3/a2-highgpu-8g,
g2-standard-96): the largest tensor-parallel group, which must stay within one node.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from kvpilot.operator.api.names import (
    AMD_GPU_RESOURCE,
    AMD_PRODUCT_LABEL,
    NVIDIA_GPU_RESOURCE,
    NVIDIA_PRODUCT_LABEL,
)

MiB = 1024**2
GiB = 1024**3


class GPU(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    product: str  # value of `product_label` on nodes that carry this GPU
    product_label: str = NVIDIA_PRODUCT_LABEL
    resource: str = NVIDIA_GPU_RESOURCE
    memory_gib: float  # nominal (datasheet)
    # What the device reports as its total (nvidia-smi's memory.total): the planner sizes with this,
    # a few per cent under the nominal figure (an L4 reports 23034 MiB, not 24 GiB).
    usable_memory_mib: int
    bandwidth_gbps: float  # GB/s
    fp16_tflops: float  # dense FP16/BF16 tensor
    int8_tops: float  # dense INT8 tensor
    fp8: bool
    source: str
    link: str  # the interconnect tensor parallelism all-reduces over
    link_gbps: float  # GB/s, one direction
    link_latency_us: float
    # Turing (T4) and Volta have no bf16 arithmetic: the engine runs float16 there.
    bf16: bool = True
    max_per_node: int = 8
    # Other product strings of the same part (form factors whose figures are within a few per
    # cent), which node discovery and the pods' node affinity accept too.
    aliases: tuple[str, ...] = ()
    # A CPU node type is planned as a device too (planning/cpus.py), from what `kvpilot profile`
    # measured on it rather than from a spec sheet: its rates are what the engine's kernels reached,
    # so no spec-sheet efficiency applies (`measured`); its matmul rate depends on the tokens of a
    # step (`matmul_curves`: scheme -> (tokens, FLOP/s) points); each step costs the engine's own
    # measured work beside the weights and the arithmetic, by scheme: a decode step by its token
    # rows (`step_overhead_curves`: scheme -> (rows, seconds)); a prefill step is interpolated
    # between the measured ones (`prefill_curves`: scheme -> (prompt tokens, seconds)); and
    # attention reads the KV cache at its own measured rate (`kv_read_bytes_per_s`; None: at the
    # memory bandwidth, within the weights' read).
    measured: bool = False
    matmul_curves: tuple[tuple[str, tuple[tuple[int, float], ...]], ...] = ()
    step_overhead_curves: tuple[tuple[str, tuple[tuple[int, float], ...]], ...] = ()
    prefill_curves: tuple[tuple[str, tuple[tuple[int, float], ...]], ...] = ()
    kv_read_bytes_per_s: float | None = None
    bytes_per_value: int = 2  # of unquantized weights and of the KV cache: 4 where a CPU computes in fp32
    cpus: int = 0  # CPUs one replica requests (CPU devices; a GPU's pod takes ENGINE_CPU_REQUEST)
    # A lone sequence's decode step with compile_decode over the eager one, where a profile measured
    # it (`kvpilot profile --compiled`); None: the planner never renders compiled decoding.
    compiled_step_factor: float | None = None
    # The CPU's engine serves full-precision weights from oneDNN's layout, as the profile's engine
    # did: a tied LM head held twice, and with compiled decoding every plain weight beside its
    # packed copy (sizing.weight_bytes).
    packs_weights: bool = False

    @property
    def products(self) -> tuple[str, ...]:
        return (self.product, *self.aliases)

    @property
    def memory_bytes(self) -> int:
        return self.usable_memory_mib * MiB

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.bandwidth_gbps * 1e9

    @property
    def fp16_flops(self) -> float:
        return self.fp16_tflops * 1e12

    @property
    def int8_ops(self) -> float:
        return self.int8_tops * 1e12

    @property
    def link_bytes_per_s(self) -> float:
        return self.link_gbps * 1e9

    @property
    def is_cpu(self) -> bool:
        return self.cpus > 0

    def matmul_flops(self, quantization: str, tokens: float) -> float:
        """FLOP/s of a step's GEMMs over `tokens` rows at `quantization`: the measured curve where
        the device has one (linear between its points, flat beyond them), else the spec sheet's
        8-bit peak for W8A8 and FP8 and its 16-bit peak for the rest (weight-only schemes multiply
        in 16 bits)."""
        curve = dict(self.matmul_curves).get(quantization)
        if curve is None:
            return self.int8_ops if quantization in ("w8a8", "fp8") else self.fp16_flops
        return _along(curve, tokens, extend=False)

    def step_overhead(self, quantization: str, running: float) -> float:
        """The engine's own work in a decode step of `running` token rows (0 where not measured;
        below 0 where the profile's GEMM rates under-rate what the model's steps reached)."""
        curve = dict(self.step_overhead_curves).get(quantization)
        return _along(curve, running, extend=True) if curve else 0.0

    def measured_prefill(self, quantization: str, tokens: float) -> float | None:
        """The step that computes a prompt of `tokens` where the device measured this scheme's."""
        curve = dict(self.prefill_curves).get(quantization)
        return None if curve is None else max(0.0, _along(curve, tokens, extend=True))


def _along(curve: tuple[tuple[int, float], ...], x: float, extend: bool) -> float:
    """`curve` at `x`: linear between its points; beyond them flat, or (`extend`) along the nearest
    segment."""
    if len(curve) == 1:
        return curve[0][1]
    segments = list(zip(curve, curve[1:]))
    (low, low_y), (high, high_y) = next(((a, b) for a, b in segments if x <= b[0]), segments[-1])
    share = (x - low) / (high - low)
    if not extend:
        share = min(1.0, max(0.0, share))
    return low_y + share * (high_y - low_y)


GPUS: dict[str, GPU] = {
    gpu.name: gpu
    for gpu in (
        GPU(
            name="T4",
            link="PCIe Gen3 x16",
            link_gbps=16,
            link_latency_us=30,
            product="Tesla-T4",
            memory_gib=16,
            usable_memory_mib=15360,
            bandwidth_gbps=320,
            fp16_tflops=65,
            int8_tops=130,
            fp8=False,
            bf16=False,
            source="https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/"
            "t4-tensor-core-datasheet-951643.pdf",
        ),
        GPU(
            name="L4",
            link="PCIe Gen4 x16",
            link_gbps=32,
            link_latency_us=30,
            product="NVIDIA-L4",
            memory_gib=24,
            usable_memory_mib=23034,
            bandwidth_gbps=300,
            fp16_tflops=121,
            int8_tops=242.5,
            fp8=True,
            source="https://resources.nvidia.com/en-us-data-center-overview/l4-gpu-datasheet "
            "(242 TFLOPS FP16 / 485 TOPS INT8 with sparsity, halved)",
        ),
        # NVIDIA publishes no A10G sheet; memory and bandwidth equal the A10's, tensor throughput
        # is AWS's G5 figure as compared in the Baseten write-up.
        GPU(
            name="A10G",
            link="PCIe Gen4 x16",
            link_gbps=32,
            link_latency_us=30,
            product="NVIDIA-A10G",
            memory_gib=24,
            usable_memory_mib=23028,
            bandwidth_gbps=600,
            fp16_tflops=70,
            int8_tops=140,
            fp8=False,
            source="https://aws.amazon.com/ec2/instance-types/g5/ ; "
            "https://www.baseten.co/blog/nvidia-a10-vs-a10g-for-ml-model-inference/",
        ),
        GPU(
            name="L40S",
            link="PCIe Gen4 x16",
            link_gbps=32,
            link_latency_us=30,
            product="NVIDIA-L40S",
            memory_gib=48,
            usable_memory_mib=46068,
            bandwidth_gbps=864,
            fp16_tflops=362.05,
            int8_tops=733,
            fp8=True,
            source="https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413 "
            "(733 TFLOPS FP16 / 1466 TOPS INT8 with sparsity, halved)",
        ),
        GPU(
            name="A100-40GB",
            link="NVLink 3 (600 GB/s)",
            link_gbps=300,
            link_latency_us=10,
            product="NVIDIA-A100-SXM4-40GB",
            memory_gib=40,
            usable_memory_mib=40960,
            bandwidth_gbps=1555,
            fp16_tflops=312,
            int8_tops=624,
            fp8=False,
            aliases=("NVIDIA-A100-PCIE-40GB",),
            source="https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
            "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf (SXM)",
        ),
        GPU(
            name="A100-80GB",
            link="NVLink 3 (600 GB/s)",
            link_gbps=300,
            link_latency_us=10,
            product="NVIDIA-A100-SXM4-80GB",
            memory_gib=80,
            usable_memory_mib=81920,
            bandwidth_gbps=2039,
            fp16_tflops=312,
            int8_tops=624,
            fp8=False,
            # The PCIe card's 1935 GB/s is 5 % below the SXM figure planned with.
            aliases=("NVIDIA-A100-80GB-PCIe",),
            source="https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
            "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf (SXM)",
        ),
        GPU(
            name="H100-80GB",
            link="NVLink 4 (900 GB/s)",
            link_gbps=450,
            link_latency_us=10,
            product="NVIDIA-H100-80GB-HBM3",
            memory_gib=80,
            usable_memory_mib=81559,
            bandwidth_gbps=3350,
            fp16_tflops=989,
            int8_tops=1979,
            fp8=True,
            source="https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet "
            "(H100 SXM; 1979 TFLOPS BF16 / 3958 TOPS INT8 with sparsity, halved)",
        ),
        GPU(
            name="H200",
            link="NVLink 4 (900 GB/s)",
            link_gbps=450,
            link_latency_us=10,
            product="NVIDIA-H200",
            memory_gib=141,
            usable_memory_mib=143771,
            bandwidth_gbps=4800,
            fp16_tflops=989,
            int8_tops=1979,
            fp8=True,
            source="https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM, sparsity halved)",
        ),
        GPU(
            name="B200",
            link="NVLink 5 (1.8 TB/s)",
            link_gbps=900,
            link_latency_us=10,
            product="NVIDIA-B200",
            memory_gib=180,
            usable_memory_mib=183359,
            bandwidth_gbps=8000,
            fp16_tflops=2250,
            int8_tops=4500,
            fp8=True,
            source="https://www.nvidia.com/en-us/data-center/hgx/ (HGX B200: 1.4 TB, 64 TB/s, "
            "36 PFLOPS FP16 and 72 POPS INT8 sparse per 8 GPUs; per GPU, sparsity halved)",
        ),
        GPU(
            name="MI300X",
            link="Infinity Fabric (896 GB/s)",
            link_gbps=448,
            link_latency_us=10,
            product="AMD_Instinct_MI300X",
            product_label=AMD_PRODUCT_LABEL,
            resource=AMD_GPU_RESOURCE,
            memory_gib=192,
            usable_memory_mib=196608,
            bandwidth_gbps=5300,
            fp16_tflops=1307.4,
            int8_tops=2614.9,
            fp8=True,
            source="https://www.amd.com/content/dam/amd/en/documents/instinct-tech-docs/"
            "data-sheets/amd-instinct-mi300x-data-sheet.pdf",
        ),
    )
}

# What the e2e cluster labels fake nodes with, and what node discovery maps back to catalog names.
PRODUCT_LABELS: dict[str, str] = {name: gpu.product for name, gpu in GPUS.items()}


def _key(name: str) -> str:
    return name.lower().replace("_", "-").replace(" ", "-")


_BY_KEY: dict[str, GPU] = {_key(alias): gpu for gpu in GPUS.values() for alias in (gpu.name, *gpu.products)}


def find_gpu(name: str) -> GPU | None:
    """A catalog GPU by name or node product string, case-insensitively; None when unknown."""
    return _BY_KEY.get(_key(name))
