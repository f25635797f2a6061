"""Activation-aware weight quantization (AWQ, Lin et al. 2023) for INT4 checkpoints.

A few input channels of each linear layer carry much larger activations than the rest, and the
rounding error of their weights costs the most. AWQ multiplies those weight columns by a per-channel
scale s before quantizing (so they get a finer share of their group's grid) and divides the
activation by s; the division is folded into the operation that produces the activation, so the
model stays a plain Llama whose linear layers are then quantized as usual (min-max, group-wise) and
the checkpoint stays a plain W4A16 one that any compressed-tensors reader loads.

Per decoder layer, the linear layers that share an input and the operation it comes from:
- q, k, v (our fused qkv_proj) after input_layernorm: s divides the norm's weight;
- o_proj after v: s divides v's rows (the attention output is a mix of v's rows); with grouped
  queries, the query heads that share a kv head share its scales;
- gate, up (fused gate_up_proj) after post_attention_layernorm;
- down_proj after up: s divides up's rows (silu(gate) x up is linear in up).
s = mean|x|^alpha per channel, normalised so that max(s) x min(s) = 1, with alpha searched on a grid
per group for the least squared error of the group's outputs on the calibration activations; alpha
0 is s = 1, plain round-to-nearest, so the search never does worse than it there.

Then, optionally, AWQ's clipping search: each group of each output row may shrink its min-max range
toward zero (clamping its largest weights) when that lowers its output error on the calibration
activations; it is applied by clamping the weights, so min-max quantization later picks up the
shrunk range. As upstream, q and k are not clipped (their errors pass through the softmax, which an
output MSE does not see).

Activations come from one forward pass of the full-precision model over the calibration prompts
(calibration.py); each layer is searched and rewritten right after it ran, so every layer
sees the full-precision model's activations, as in AutoAWQ and llm-compressor, and only one layer's
activations are held at a time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvpilot.engine.model.attention import AttentionMetadata, KVCache, allocate_kv_caches
from kvpilot.engine.model.layers import FusedLinear, Linear
from kvpilot.engine.model.llama import DecoderLayer, LlamaForCausalLM, kv_shape
from kvpilot.engine.worker.step_inputs import StepInputs

FakeQuantize = Callable[[torch.Tensor], torch.Tensor]  # [out, in] weight -> its quantized-then-dequantized values

ALPHA_GRID = 20  # alpha in 0, 1/20, ..., 19/20
CLIP_RATIOS = tuple(1 - i / 20 for i in range(10))  # keep 100 % .. 55 % of a group's range


@dataclass
class GroupResult:
    """What the search found for one group of linear layers: its alpha, and the mean squared error
    of its outputs on the calibration activations under round-to-nearest and under AWQ (its scales,
    and its clipping when that was kept)."""

    name: str
    alpha: float
    rtn_error: float
    awq_error: float


@dataclass
class AwqReport:
    groups: list[GroupResult] = field(default_factory=list)
    tokens: int = 0


@dataclass(frozen=True)
class _Group:
    """Linear layers that read one input, and the operation that writes it."""

    name: str
    linear: Linear
    # Tensors whose first dimension indexes the previous operation's output channels: a norm's
    # weight, or a linear layer's rows (and bias rows). Dividing them by s divides the input.
    previous: tuple[torch.Tensor, ...]
    # [in]: the previous channel each input channel of `linear` comes from (identity, or the kv
    # channel a query head's attention output mixes under grouped queries).
    source: torch.Tensor
    clip_rows: slice  # the rows of `linear` the clipping search may clamp


def _row_tensors(layer: FusedLinear, shard: str) -> tuple[torch.Tensor, ...]:
    rows = layer.rows(shard)
    return (layer.weight.data[rows],) + (() if layer.bias is None else (layer.bias.data[rows],))


def _groups(layer: DecoderLayer) -> list[_Group]:
    attn, mlp = layer.self_attn, layer.mlp
    hidden = torch.arange(attn.qkv_proj.in_features)
    # Query head h reads kv head h // (heads / kv_heads): its attention output channel (h, d) is a
    # mix of v's channel (h // ratio, d).
    heads = torch.arange(attn.num_heads).repeat_interleave(attn.head_dim)
    dims = torch.arange(attn.head_dim).repeat(attn.num_heads)
    o_source = heads // (attn.num_heads // attn.num_kv_heads) * attn.head_dim + dims
    return [
        _Group(
            "self_attn.qkv_proj", attn.qkv_proj, (layer.input_layernorm.weight.data,), hidden, attn.qkv_proj.rows("v")
        ),
        _Group("self_attn.o_proj", attn.o_proj, _row_tensors(attn.qkv_proj, "v"), o_source, slice(None)),
        _Group(
            "mlp.gate_up_proj", mlp.gate_up_proj, (layer.post_attention_layernorm.weight.data,), hidden, slice(None)
        ),
        _Group(
            "mlp.down_proj",
            mlp.down_proj,
            _row_tensors(mlp.gate_up_proj, "up"),
            torch.arange(mlp.down_proj.in_features),
            slice(None),
        ),
    ]


def _output_error(delta: torch.Tensor, gram: torch.Tensor, tokens: int) -> float:
    """Mean squared error over tokens and outputs of a weight off by `delta` ([out, in]) on
    activations X with gram = X^T X: ||X delta^T||^2 = sum(delta gram . delta), so one [in, in]
    matrix stands for all the calibration tokens and each candidate costs no matmul over them."""
    return ((delta @ gram) * delta).sum().item() / (tokens * delta.shape[0])


def _search_scale(
    group: _Group, x: torch.Tensor, gram: torch.Tensor, fake_quantize: FakeQuantize
) -> tuple[torch.Tensor, float, float, float]:
    """The scales of the previous operation's channels with the least output error; their alpha,
    the error at alpha 0 (round-to-nearest) and theirs."""
    weight = group.linear.weight.data.float()
    channels = int(group.source.max()) + 1
    counts = torch.bincount(group.source, minlength=channels)
    mean_abs = torch.zeros(channels).index_add_(0, group.source, x.abs().mean(0)) / counts
    best: tuple[float, float, torch.Tensor] | None = None
    rtn_error = math.nan
    for step in range(ALPHA_GRID):
        alpha = step / ALPHA_GRID
        scales = mean_abs.pow(alpha).clamp(min=1e-4)
        scales = scales / (scales.max() * scales.min()).sqrt()
        column_scales = scales[group.source]
        # (x / s) Q(W s)^T = x (Q(W s) / s)^T: the error in the unscaled input's terms.
        error = _output_error(fake_quantize(weight * column_scales) / column_scales - weight, gram, x.shape[0])
        if step == 0:
            rtn_error = error
        if best is None or error < best[0]:
            best = (error, alpha, scales)
    assert best is not None
    error, alpha, scales = best
    return scales, alpha, rtn_error, error


def _apply_scale(group: _Group, scales: torch.Tensor) -> None:
    """W x diag(s) on the linear layer, / s on what writes its input: the same function."""
    group.linear.weight.data.mul_(scales[group.source])
    for tensor in group.previous:
        tensor.div_(scales.view(-1, *[1] * (tensor.dim() - 1)))


def _search_clip(
    weight: torch.Tensor, gram: torch.Tensor, group_size: int, fake_quantize: FakeQuantize
) -> torch.Tensor:
    """`weight` with each (row, group) clamped to the shrink of its range that gives the least
    error of that group's share of the output (upstream AWQ's per-group objective; the group's
    diagonal block of the Gram matrix gives it)."""
    out_features, in_features = weight.shape
    groups = in_features // group_size
    w = weight.view(out_features, groups, group_size)
    blocks = torch.stack([gram[i : i + group_size, i : i + group_size] for i in range(0, in_features, group_size)])
    low, high = w.amin(-1, keepdim=True).clamp(max=0), w.amax(-1, keepdim=True).clamp(min=0)
    best_error = torch.full((out_features, groups), math.inf)
    best = w.clone()
    for ratio in CLIP_RATIOS:
        clamped = torch.maximum(torch.minimum(w, high * ratio), low * ratio)
        delta = fake_quantize(clamped.reshape(out_features, in_features)).view_as(w) - w
        error = torch.einsum("ogi,gij,ogj->og", delta, blocks, delta)
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best = torch.where(better[..., None], clamped, best)
    return best.reshape(out_features, in_features)


def _calibrate_layer(
    groups: list[_Group],
    inputs: dict[str, torch.Tensor],
    fake_quantize: FakeQuantize,
    group_size: int,
    clip: bool,
    report: AwqReport,
    prefix: str,
) -> None:
    for group in groups:
        x = inputs.pop(group.name)
        gram = x.T @ x
        scales, alpha, rtn_error, error = _search_scale(group, x, gram, fake_quantize)
        result = GroupResult(f"{prefix}.{group.name}", alpha, rtn_error, error)
        report.groups.append(result)
        _apply_scale(group, scales)
        if not clip:
            continue
        # The per-group objective ignores how groups' errors add up in an output; a clipped
        # layer whose whole output error is not lower than the scaled one's stays unclipped.
        column_scales = scales[group.source]
        scaled_gram = gram / column_scales[:, None] / column_scales[None, :]
        weight = group.linear.weight.data.float()
        rows = group.clip_rows
        clipped = _search_clip(weight[rows], scaled_gram, group_size, fake_quantize)
        candidate = weight.clone()
        candidate[rows] = clipped
        clipped_error = _output_error(fake_quantize(candidate) - weight, scaled_gram, x.shape[0])
        if clipped_error < result.awq_error:
            group.linear.weight.data.copy_(candidate)
            result.awq_error = clipped_error


@torch.inference_mode()
def apply_awq(
    model: LlamaForCausalLM, prompts: list[list[int]], fake_quantize: FakeQuantize, group_size: int, clip: bool = True
) -> AwqReport:
    """Rescale (and clip) the full-precision `model`'s linear layers in place for INT4 with the
    given quantizer, calibrated on `prompts` (token ids). Without clipping the model computes the
    same function as before, up to float rounding."""
    report = AwqReport(tokens=sum(len(p) for p in prompts))
    captured: dict[str, torch.Tensor] = {}
    hooks = []
    for index, layer in enumerate(model.model.layers):
        groups = _groups(layer)
        for group in groups:
            hooks.append(
                group.linear.register_forward_pre_hook(
                    lambda _module, args, name=group.name: captured.__setitem__(name, args[0].float())
                )
            )
        hooks.append(
            layer.register_forward_hook(
                lambda _module, _args, _output, groups=groups, prefix=f"model.layers.{index}": _calibrate_layer(
                    groups, captured, fake_quantize, group_size, clip, report, prefix
                )
            )
        )
    try:
        model(*prefill_batch(model, prompts))
    finally:
        for hook in hooks:
            hook.remove()
    return report


def prefill_batch(
    model: LlamaForCausalLM, prompts: list[list[int]]
) -> tuple[torch.Tensor, torch.Tensor, list[KVCache], AttentionMetadata]:
    """One flattened batch of whole prompts (each its own prefill) over a cache just large enough:
    one-slot blocks, each prompt in the slots after the previous one's."""
    weight = model.model.embed_tokens.weight
    inputs, start = StepInputs(1, weight.device), 0
    for prompt in prompts:
        inputs.add(prompt, 0, list(range(start, start + len(prompt))), decode=False)
        start += len(prompt)
    ids, positions, meta = inputs.build()
    return (
        ids,
        positions,
        allocate_kv_caches(len(model.model.layers), start, *kv_shape(model), weight.dtype, weight.device),
        meta,
    )


def checkpoint_tensors(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """The model's parameters under the names a HuggingFace checkpoint gives them: fused layers
    split back into their projections (qkv_proj -> q_proj, k_proj, v_proj)."""
    part_of = {(fused, shard): part for part, (fused, shard) in model.packed_modules.items()}
    out: dict[str, torch.Tensor] = {}
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if isinstance(module, FusedLinear):
                parent, _, fused = module_name.rpartition(".")
                for shard in module.shard_sizes:
                    out[f"{parent}.{part_of[fused, shard]}.{param_name}"] = param.data[module.rows(shard)]
            else:
                out[f"{module_name}.{param_name}"] = param.data
    return out
