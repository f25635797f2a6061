"""The device record the planner sizes for: a catalog GPU (gpus.py) from its spec sheet, or a CPU
node type (cpus.py) from what `kvpilot profile` measured on it (`Measured`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from kvpilot.operator.api.names import NVIDIA_GPU_RESOURCE, NVIDIA_PRODUCT_LABEL

MiB = 1024**2
GiB = 1024**3


class Measured(BaseModel):
    """What `kvpilot profile` measured on a CPU node type, which the planner uses in place of the
    spec sheet's figures: its rates are what the engine's kernels reached, so no spec-sheet
    efficiency applies. Its matmul rate depends on the tokens of a step (`matmul_curves`: scheme ->
    (tokens, FLOP/s) points); each step costs the engine's own measured work beside the weights and
    the arithmetic, by scheme: a decode step by its token rows (`step_overhead_curves`: scheme ->
    (rows, seconds)); a prefill step is interpolated between the measured ones (`prefill_curves`:
    scheme -> (prompt tokens, seconds)); and attention reads the KV cache at its own measured rate
    (`kv_read_bytes_per_s`; None: at the memory bandwidth, within the weights' read)."""

    model_config = ConfigDict(frozen=True)

    matmul_curves: tuple[tuple[str, tuple[tuple[int, float], ...]], ...] = ()
    step_overhead_curves: tuple[tuple[str, tuple[tuple[int, float], ...]], ...] = ()
    prefill_curves: tuple[tuple[str, tuple[tuple[int, float], ...]], ...] = ()
    kv_read_bytes_per_s: float | None = None
    # A lone sequence's decode step with compile_decode over the eager one, where a profile measured
    # it (`kvpilot profile --compiled`); None: the planner never renders compiled decoding.
    compiled_step_factor: float | None = None
    # The CPU's engine serves full-precision weights from oneDNN's layout, as the profile's engine
    # did: a tied LM head held twice, and with compiled decoding every plain weight beside its
    # packed copy (sizing.weight_bytes).
    packs_weights: bool = False


NOTHING_MEASURED = Measured()


class Device(BaseModel):
    """A device type the planner sizes for: a catalog GPU from its spec sheet, or a CPU node type
    from its measured profile (`measured`)."""

    model_config = ConfigDict(frozen=True)

    name: str
    product: str  # value of `product_label` on nodes that carry this GPU
    product_label: str = NVIDIA_PRODUCT_LABEL
    resource: str = NVIDIA_GPU_RESOURCE
    memory_gib: float  # nominal (datasheet)
    # The total CUDA reports (cudaMemGetInfo): the planner sizes with this, a few per cent under the
    # nominal figure (an L4 reports 22.03 GiB, not 24) and under nvidia-smi's memory.total.
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
    # The CUDA compute capability's major version (7 Turing, 8 Ampere and Ada, 9 Hopper, 10 Blackwell),
    # which some of vLLM's kernels require; None off CUDA.
    cuda_major: int | None = None
    max_per_node: int = 8
    # Other product strings of the same part (form factors whose figures are within a few per
    # cent), which node discovery and the pods' node affinity accept too.
    aliases: tuple[str, ...] = ()
    bytes_per_value: int = 2  # of unquantized weights and of the KV cache: 4 where a CPU computes in fp32
    cpus: int = 0  # CPUs one replica requests (CPU devices; a GPU's pod takes ENGINE_CPU_REQUEST)
    # A CPU node type is planned as a device too (planning/cpus.py), from what `kvpilot profile`
    # measured on it rather than from a spec sheet; None for a catalog GPU.
    measured: Measured | None = None

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

    @property
    def _measured(self) -> Measured:
        """What was measured; for a catalog GPU, nothing (no curves, no rates)."""
        return self.measured or NOTHING_MEASURED

    @property
    def kv_read_bytes_per_s(self) -> float | None:
        return self._measured.kv_read_bytes_per_s

    @property
    def compiled_step_factor(self) -> float | None:
        return self._measured.compiled_step_factor

    @property
    def packs_weights(self) -> bool:
        return self._measured.packs_weights

    def matmul_flops(self, quantization: str, tokens: float) -> float:
        """FLOP/s of a step's GEMMs over `tokens` rows at `quantization`: the measured curve where
        the device has one (linear between its points, flat beyond them), else the spec sheet's
        8-bit peak for W8A8 and FP8 and its 16-bit peak for the rest (weight-only schemes multiply
        in 16 bits)."""
        curve = dict(self._measured.matmul_curves).get(quantization)
        if curve is None:
            return self.int8_ops if quantization in ("w8a8", "fp8") else self.fp16_flops
        return _along(curve, tokens, extend=False)

    def step_overhead(self, quantization: str, running: float) -> float:
        """The engine's own work in a decode step of `running` token rows (0 where not measured;
        below 0 where the profile's GEMM rates under-rate what the model's steps reached)."""
        curve = dict(self._measured.step_overhead_curves).get(quantization)
        return _along(curve, running, extend=True) if curve else 0.0

    def measured_prefill(self, quantization: str, tokens: float) -> float | None:
        """The step that computes a prompt of `tokens` where the device measured this scheme's."""
        curve = dict(self._measured.prefill_curves).get(quantization)
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
