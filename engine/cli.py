"""The `kvpilot` command: a light dispatcher, and the engine's own commands (generate, serve).

Each side registers its commands from its own module, and only the module of the command being
run is imported: `kvpilot serve` never loads the operator (kopf, kubernetes), `kvpilot plan` never
loads torch, and the operator image needs nothing of the engine beyond its contract (engine/contract/).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from kvpilot.engine.contract.config import EngineConfig, ServerConfig, add_flags, from_args

# command -> (the module whose register(subparsers) adds it, its one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("kvpilot.engine.cli", "offline generation with the engine"),
    "serve": ("kvpilot.engine.cli", "the OpenAI-compatible HTTP server"),
    "eval": ("kvpilot.engine.cli", "quality of each quantization scheme against the unquantized model"),
    "build-kernels": (
        "kvpilot.engine.cli",
        "build the engine's C++ CPU kernels for each ISA level ahead of time (an engine image's build step)",
    ),
    "quantize": (
        "kvpilot.engine.quantize.cli",
        "write a model folder as a compressed-tensors INT4/INT8 checkpoint (W4A16, W8A16)",
    ),
    "bench": (
        "kvpilot.engine.tools.benchmarks",
        "benchmarks of a source checkout's bench/ (serve: kvpilot, llama.cpp, HF side by side)",
    ),
    "profile": (
        "kvpilot.engine.profiling.profile",
        "measure this machine (bandwidth, matmul rates, engine step) and print its CPU device profile",
    ),
    "download": (
        "kvpilot.engine.tools.download",
        "download a model from the Hugging Face Hub into a local folder (an engine pod's init step)",
    ),
    "plan": (
        "kvpilot.operator.cli",
        "size a model on a GPU (or a manifest): KV cache, batch limits, quantization, tensor parallelism, latency",
    ),
    "operator": ("kvpilot.operator.cli", "run the InferenceService operator (kopf)"),
    "render": ("kvpilot.operator.cli", "print the objects the operator would apply for an InferenceService manifest"),
    "crd": ("kvpilot.operator.cli", "print the InferenceService CRD generated from the operator's pydantic types"),
    "gateway": ("kvpilot.operator.cli", "run the gateway: routes by namespace and model, wakes services from zero"),
    "inspect-checkpoint": (
        "kvpilot.operator.cli",
        "print a checkpoint folder's architecture as the planner reads it (the operator's inspection Job of "
        "a pvc:// model)",
    ),
}


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return from_args(EngineConfig, args)


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    config = from_args(ServerConfig, args)
    if config.api_key is None and os.environ.get("KVPILOT_API_KEY"):
        config = config.model_copy(update={"api_key": os.environ["KVPILOT_API_KEY"]})
    return config


def _generate(args: argparse.Namespace) -> int:
    from kvpilot.engine import LLM, SamplingParams

    llm = LLM(**engine_config_from_args(args).model_dump())
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.sampling_seed
    )
    prompts = args.prompt or ["Write a haiku about paged attention."]
    outputs = (
        llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
        if args.chat
        else llm.generate(prompts, params)
    )
    for prompt, out in zip(prompts, outputs):
        completion = out.outputs[0]
        print(
            f"### {prompt}\n{completion.text}\n[{len(completion.token_ids)} tokens, finish: {completion.finish_reason}]"
        )
    return 0


def _serve(args: argparse.Namespace) -> int:
    from kvpilot.engine.serving.api_server import serve

    # A server logs its lifecycle by default; -v adds one line per request.
    logging.getLogger("kvpilot").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    return serve(engine_config_from_args(args), server_config_from_args(args))


def _eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvpilot.engine.tools.evaluation import run

    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    return run(schemes, args.num_tokens, engine_config_from_args(args), Path(args.output) if args.output else None)


def _build_kernels(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from kvpilot.engine.cpu import kernels as cpu_kernels
    from kvpilot.engine.cpu.features import read_cpu_flags
    from kvpilot.engine.model.loader import cache_root

    by_name = {level.name: level for level in cpu_kernels.BUILDABLE}
    if args.levels == "all":
        levels = list(cpu_kernels.BUILDABLE)
    elif args.levels == "this":
        levels = [cpu_kernels.level_for(read_cpu_flags())]
    else:
        names = [n.strip() for n in args.levels.split(",") if n.strip()]
        unknown = [n for n in names if n not in by_name]
        if unknown or not names:
            raise ValueError(
                f"--levels: {', '.join(unknown) or 'none given'}; this machine builds {', '.join(by_name)}"
            )
        levels = [by_name[n] for n in names]
    folder = Path(args.output) if args.output else cache_root() / cpu_kernels.KERNELS
    for level in levels:
        print(f"building {level.name} ({' '.join(level.cflags)}) ...", flush=True)
        started = time.monotonic()
        path = cpu_kernels.build(level, folder)
        print(f"built {level.name}: {path} in {time.monotonic() - started:.0f} s", flush=True)
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    gen = sub.add_parser("generate", help=COMMANDS["generate"][1])
    gen.add_argument("prompt", nargs="*", help="prompts (default: a sample prompt)")
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True, help="apply the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    add_flags(gen, EngineConfig)
    gen.set_defaults(func=_generate)

    ev = sub.add_parser("eval", help=COMMANDS["eval"][1])
    ev.add_argument(
        "--schemes",
        default="none,int8,int4",
        help="comma-separated; the first is the reference (default: none,int8,int4)",
    )
    ev.add_argument(
        "--num-tokens", type=int, default=24_576, help="tokens of text to score per scheme (default: 24576)"
    )
    ev.add_argument("--output", default="bench/out/eval.json", help="JSON results ('' for none)")
    add_flags(ev, EngineConfig)
    ev.set_defaults(func=_eval)

    kernels = sub.add_parser("build-kernels", help=COMMANDS["build-kernels"][1])
    kernels.add_argument(
        "--levels",
        default="this",
        help="'this' (this CPU's level, the default), 'all' (every level of this architecture: what an image "
        "ships), or a comma-separated list of avx512-bf16, avx512, avx2, baseline",
    )
    kernels.add_argument(
        "--output", default=None, help="folder (default: $KVPILOT_CACHE/kernels, where engines look for them)"
    )
    kernels.set_defaults(func=_build_kernels)

    srv = sub.add_parser("serve", help=COMMANDS["serve"][1])
    add_flags(srv, ServerConfig)
    add_flags(srv, EngineConfig)
    srv.set_defaults(func=_serve)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser with `command`'s full flags and every other command as a name and help line only
    (so `kvpilot --help` lists them all without importing them); every command's flags when None."""
    parser = argparse.ArgumentParser(prog="kvpilot", description="LLM serving on Kubernetes")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    if command is None:
        wanted = [module for module, _ in COMMANDS.values()]
    else:
        wanted = [COMMANDS[command][0]] if command in COMMANDS else []
    for module in dict.fromkeys(wanted):
        importlib.import_module(module).register(sub)
    for name, (_, help_text) in COMMANDS.items():
        if name not in sub.choices:
            sub.add_parser(name, help=help_text)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command or "").parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return args.func(args)
    except ValueError as err:
        print(f"kvpilot: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
