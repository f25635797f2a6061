"""Full-precision linear layers on x86 CPUs with their weights in oneDNN's blocked layout.

`F.linear` hands oneDNN a plain [out, in] weight on every call, and for 2-16 rows oneDNN then
picks a kernel that reads the weight about half as fast as its one-row GEMV, so a second row costs
nearly as much as the first: that is what a verification step (1 + drafts rows) or a second running
request pays. Reordered once into the layout oneDNN's kernels read (what inductor's freezing does
to linear weights), a few rows cost about what one row does, and fp32 weights gain most (measured:
bench/RESULTS.md, "oneDNN-packed weights").

The packed weight is an opaque mkldnn tensor: inductor takes one only as a constant it folded
itself, and its graph cache cannot pickle one, so a model that torch.compile traces
(compile_decode) keeps its plain weights.
"""

from __future__ import annotations

import torch


def available() -> bool:
    """Whether this torch build has oneDNN and its packed-linear kernels."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def serves(device: torch.device, dtype: torch.dtype, cpu_dtypes: tuple[str, ...]) -> bool:
    """Whether full-precision weights of `dtype` are served packed on `device`: a CPU whose flags
    favour it for that dtype (cpu_features.KernelPath.onednn_dtypes), with a torch that has the kernels."""
    return device.type == "cpu" and str(dtype).removeprefix("torch.") in cpu_dtypes and available()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> the same weight in oneDNN's blocked layout (an mkldnn tensor of that shape)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b with W packed by pack()."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
