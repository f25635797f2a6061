"""Accelerators the planner can size for, from the vendors' public spec sheets.

`memory_gib` is the marketed capacity; the planner sizes with `usable_memory_mib`, the total CUDA
reports (cudaMemGetInfo, torch.cuda.mem_get_info: what vLLM multiplies by --gpu-memory-utilization),
as public PyTorch out-of-memory messages and vLLM start-up logs print it for each part ("GPU 0 has a
total capacity of 79.19 GiB", "Free memory on device (78.68/79.19 GiB)"): T4 14.56, L4 22.03, A10G
22.06, L40S 44.53, A100 39.39 / 79.14, H100 SXM 79.19, H200 139.80, B200 178.35, MI300X (in a VM)
191.69 GiB, the lowest of the sources where they differ (drivers move it by 0.01-0.2 GiB). It is
0.3-1 GiB under nvidia-smi's memory.total (81559 MiB on an H100), which counts the driver's own
reservation, and a few per cent under the marketed figure (ECC, firmware). Bandwidth and
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

from kvpilot.operator.api.names import AMD_GPU_RESOURCE, AMD_PRODUCT_LABEL
from kvpilot.operator.planning.device import Device

GPUS: dict[str, Device] = {
    gpu.name: gpu
    for gpu in (
        Device(
            name="T4",
            cuda_major=7,
            link="PCIe Gen3 x16",
            link_gbps=16,
            link_latency_us=30,
            product="Tesla-T4",
            memory_gib=16,
            usable_memory_mib=14909,
            bandwidth_gbps=320,
            fp16_tflops=65,
            int8_tops=130,
            fp8=False,
            bf16=False,
            source="https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/"
            "t4-tensor-core-datasheet-951643.pdf",
        ),
        Device(
            name="L4",
            cuda_major=8,
            link="PCIe Gen4 x16",
            link_gbps=32,
            link_latency_us=30,
            product="NVIDIA-L4",
            memory_gib=24,
            usable_memory_mib=22558,
            bandwidth_gbps=300,
            fp16_tflops=121,
            int8_tops=242.5,
            fp8=True,
            source="https://resources.nvidia.com/en-us-data-center-overview/l4-gpu-datasheet "
            "(242 TFLOPS FP16 / 485 TOPS INT8 with sparsity, halved)",
        ),
        # NVIDIA publishes no A10G sheet; memory and bandwidth equal the A10's, tensor throughput
        # is AWS's G5 figure as compared in the Baseten write-up.
        Device(
            name="A10G",
            cuda_major=8,
            link="PCIe Gen4 x16",
            link_gbps=32,
            link_latency_us=30,
            product="NVIDIA-A10G",
            memory_gib=24,
            usable_memory_mib=22589,
            bandwidth_gbps=600,
            fp16_tflops=70,
            int8_tops=140,
            fp8=False,
            source="https://aws.amazon.com/ec2/instance-types/g5/ ; "
            "https://www.baseten.co/blog/nvidia-a10-vs-a10g-for-ml-model-inference/",
        ),
        Device(
            name="L40S",
            cuda_major=8,
            link="PCIe Gen4 x16",
            link_gbps=32,
            link_latency_us=30,
            product="NVIDIA-L40S",
            memory_gib=48,
            usable_memory_mib=45598,
            bandwidth_gbps=864,
            fp16_tflops=362.05,
            int8_tops=733,
            fp8=True,
            source="https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413 "
            "(733 TFLOPS FP16 / 1466 TOPS INT8 with sparsity, halved)",
        ),
        Device(
            name="A100-40GB",
            cuda_major=8,
            link="NVLink 3 (600 GB/s)",
            link_gbps=300,
            link_latency_us=10,
            product="NVIDIA-A100-SXM4-40GB",
            memory_gib=40,
            usable_memory_mib=40335,
            bandwidth_gbps=1555,
            fp16_tflops=312,
            int8_tops=624,
            fp8=False,
            aliases=("NVIDIA-A100-PCIE-40GB",),
            source="https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
            "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf (SXM)",
        ),
        Device(
            name="A100-80GB",
            cuda_major=8,
            link="NVLink 3 (600 GB/s)",
            link_gbps=300,
            link_latency_us=10,
            product="NVIDIA-A100-SXM4-80GB",
            memory_gib=80,
            usable_memory_mib=81039,
            bandwidth_gbps=2039,
            fp16_tflops=312,
            int8_tops=624,
            fp8=False,
            # The PCIe card's 1935 GB/s is 5 % below the SXM figure planned with.
            aliases=("NVIDIA-A100-80GB-PCIe",),
            source="https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
            "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf (SXM)",
        ),
        Device(
            name="H100-80GB",
            cuda_major=9,
            link="NVLink 4 (900 GB/s)",
            link_gbps=450,
            link_latency_us=10,
            product="NVIDIA-H100-80GB-HBM3",
            memory_gib=80,
            usable_memory_mib=81090,
            bandwidth_gbps=3350,
            fp16_tflops=989,
            int8_tops=1979,
            fp8=True,
            source="https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet "
            "(H100 SXM; 1979 TFLOPS BF16 / 3958 TOPS INT8 with sparsity, halved)",
        ),
        Device(
            name="H200",
            cuda_major=9,
            link="NVLink 4 (900 GB/s)",
            link_gbps=450,
            link_latency_us=10,
            product="NVIDIA-H200",
            memory_gib=141,
            usable_memory_mib=143155,
            bandwidth_gbps=4800,
            fp16_tflops=989,
            int8_tops=1979,
            fp8=True,
            source="https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM, sparsity halved)",
        ),
        Device(
            name="B200",
            cuda_major=10,
            link="NVLink 5 (1.8 TB/s)",
            link_gbps=900,
            link_latency_us=10,
            product="NVIDIA-B200",
            memory_gib=180,
            usable_memory_mib=182630,
            bandwidth_gbps=8000,
            fp16_tflops=2250,
            int8_tops=4500,
            fp8=True,
            source="https://www.nvidia.com/en-us/data-center/hgx/ (HGX B200: 1.4 TB, 64 TB/s, "
            "36 PFLOPS FP16 and 72 POPS INT8 sparse per 8 GPUs; per GPU, sparsity halved)",
        ),
        Device(
            name="MI300X",
            link="Infinity Fabric (896 GB/s)",
            link_gbps=448,
            link_latency_us=10,
            product="AMD_Instinct_MI300X",
            product_label=AMD_PRODUCT_LABEL,
            resource=AMD_GPU_RESOURCE,
            memory_gib=192,
            usable_memory_mib=196290,
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


_BY_KEY: dict[str, Device] = {_key(alias): gpu for gpu in GPUS.values() for alias in (gpu.name, *gpu.products)}


def find_gpu(name: str) -> Device | None:
    """A catalog GPU by name or node product string, case-insensitively; None when unknown."""
    return _BY_KEY.get(_key(name))


# What one GPU-hour costs by default, in US dollars, where the cluster's own price table
# (the chart's gpuPrices, or `kvpilot plan --gpu-price`) does not say: approximate on-demand list
# prices, the instance's hourly price over its GPUs, AWS us-east-1 in 2025 (g4dn.xlarge,
# g6.xlarge, g5.xlarge, g6e.xlarge, p4d/p4de.24xlarge, p5/p5en.48xlarge, p6-b200.48xlarge; MI300X:
# Azure's ND MI300X v5). They only rank GPU types by cost when nobody has stated the cluster's
# (reserved, spot and other clouds' prices differ by 2-3x); a mixed pool's own prices belong in
# its price table.
LIST_PRICE_PER_GPU_HOUR: dict[str, float] = {
    "T4": 0.53,
    "L4": 0.80,
    "A10G": 1.01,
    "L40S": 1.86,
    "A100-40GB": 2.75,
    "A100-80GB": 3.43,
    "H100-80GB": 6.88,
    "H200": 7.91,
    "B200": 14.24,
    "MI300X": 6.00,
}
