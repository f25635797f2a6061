"""Why an INT4 compressed-tensors checkpoint of the embedded model loses more than load-time INT4.

For every body linear weight of the embedded model (fp32, converted from its Q4_1 GGUF): the
relative RMS error of the weights each INT4 grid stores, group 32, round-to-nearest, and how the
weights sit on their groups' grids. Results: bench/RESULTS.md (INT4 checkpoints: AWQ against
round-to-nearest).

    .venv/bin/python -m bench.int4_grid
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors import safe_open

from kvpilot.engine.model.layers import Linear
from kvpilot.engine.model.loader import embedded_model_dir
from kvpilot.engine.model.quantization import Int4WeightOnly
from kvpilot.engine.quantize.writer import int4_round_trip, weight_args

GROUP = 32
ARGS = weight_args("int4", GROUP)


def load_time(weight: torch.Tensor) -> torch.Tensor:
    """What `--quantization int4` serves: float zero, bf16 scale and zero per group."""
    layer = Linear(weight.shape[1], weight.shape[0], quantization=Int4WeightOnly(GROUP))
    layer.weight.weight_loader(layer.weight, weight)  # type: ignore[attr-defined]
    layer.process_weights_after_loading()
    return Int4WeightOnly(GROUP).dequantized(layer)


def fp32_scale_checkpoint(weight: torch.Tensor) -> torch.Tensor:
    """The checkpoint's integer zero points with the scales left in fp32 (compressed-tensors' default)."""
    groups = weight.view(weight.shape[0], -1, GROUP)
    scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), ARGS)
    return fake_quantize(weight, scale, zero_point, ARGS)


GRIDS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "float zero, bf16 scale and zero (load-time INT4)": load_time,
    "integer zero point, bf16 scale (the checkpoint, `rtn`)": lambda w: int4_round_trip(w, ARGS),
    "integer zero point, fp32 scale": fp32_scale_checkpoint,
}


def main() -> None:
    source = embedded_model_dir()
    errors = dict.fromkeys(GRIDS, 0.0)
    norm = 0.0
    groups = on_grid = aligned = 0
    with safe_open(source / "model.safetensors", framework="pt") as checkpoint:
        names = sorted(name for name in checkpoint.keys() if name.endswith("_proj.weight"))  # the LM head is tied
        for name in names:
            weight = checkpoint.get_tensor(name).float()
            norm += weight.pow(2).sum().item()
            for label, grid in GRIDS.items():
                errors[label] += (grid(weight) - weight).pow(2).sum().item()
            g = weight.view(weight.shape[0], -1, GROUP)
            low = g.amin(-1, keepdim=True)
            step = (g.amax(-1, keepdim=True) - low) / 15
            levels = (g - low) / step
            groups += low.numel()
            on_grid += ((levels - levels.round()).abs().amax(-1) < 1e-3).sum().item()
            aligned += ((low / step - (low / step).round()).abs() < 1e-2).sum().item()
    print(f"{len(names)} linear weights, {groups} groups of {GROUP}")
    print(f"groups whose weights lie on their min-max 16-level grid: {on_grid / groups:.1%}")
    print(
        f"groups whose minimum is a multiple of their step (an integer zero point can hold it): {aligned / groups:.1%}"
    )
    print("| grid | relative RMS weight error |")
    print("| --- | ---: |")
    for label, error in errors.items():
        print(f"| {label} | {(error / norm) ** 0.5:.2%} |")


if __name__ == "__main__":
    main()
