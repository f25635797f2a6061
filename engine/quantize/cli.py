"""`kvpilot quantize`: write a model folder as a compressed-tensors checkpoint (W4A16 or W8A16).

Torch-free at import, like every command's parser: the work is in kvpilot.engine.quantize.writer.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvpilot.engine.cli import COMMANDS


def _quantize(args: argparse.Namespace) -> int:
    from kvpilot.engine.quantize.writer import quantize_checkpoint, report_line

    print(
        report_line(quantize_checkpoint(args.model, Path(args.output), args.scheme, args.group_size, args.method)),
        flush=True,
    )
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = sub.add_parser(
        "quantize",
        help=COMMANDS["quantize"][1],
        description="Quantize the linear layers of a model folder (LM head excepted) and write them in the "
        "compressed-tensors pack-quantized format, loadable by `kvpilot serve --model OUTPUT` and vLLM.",
    )
    parser.add_argument("output", help="folder to write (must not exist, or be empty)")
    parser.add_argument(
        "--model", default=None, help="a local HF Llama folder (default: the embedded SmolLM2-135M-Instruct)"
    )
    parser.add_argument(
        "--scheme",
        choices=("int8", "int4"),
        default="int4",
        help="int8: per output channel, symmetric (W8A16); int4: group-wise with zero points (W4A16) (default: int4)",
    )
    parser.add_argument(
        "--group-size", type=int, default=32, help="int4: input columns per scale and zero point (default: 32)"
    )
    parser.add_argument(
        "--method",
        choices=("awq", "rtn"),
        default=None,
        help="int4: awq (activation-aware scale and clipping search, calibrated on prompts that ship with kvpilot) "
        "or rtn (round-to-nearest, min-max per group); int8 is always rtn (default: awq for int4)",
    )
    parser.set_defaults(func=_quantize)
