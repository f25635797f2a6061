"""The `kvpilot` command: engine subcommands here, operator subcommands registered by kvpilot.operator."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import typing

from kvpilot.engine.config import EngineConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field, so the CLI can never drift from the config model."""
    for name, field in EngineConfig.model_fields.items():
        flag = "--" + name.replace("_", "-")
        kind = field.annotation
        if typing.get_origin(kind) is not typing.Literal:  # `int | None` -> int
            kind = next((a for a in typing.get_args(kind) if a is not type(None)), kind)
        help_text = f"default: {field.default}"
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default, help=help_text)
        elif typing.get_origin(kind) is typing.Literal:
            parser.add_argument(flag, choices=typing.get_args(kind), default=field.default, help=help_text)
        else:
            parser.add_argument(flag, type=kind, default=field.default, help=help_text)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{name: getattr(args, name) for name in EngineConfig.model_fields})


def _generate(args: argparse.Namespace) -> int:
    from kvpilot.engine import LLM, SamplingParams

    llm = LLM(**engine_config_from_args(args).model_dump())
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.sampling_seed)
    prompts = args.prompt or ["Write a haiku about paged attention."]
    outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params) if args.chat else llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        print(f"### {prompt}\n{out.outputs[0].text}\n[{len(out.outputs[0].token_ids)} tokens, finish: {out.outputs[0].finish_reason}]")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from kvpilot.engine.model_loader import EMBEDDED_MODEL
    from kvpilot.engine.server import ServeSettings, serve

    # A server logs its lifecycle by default; -v adds one line per request.
    logging.getLogger("kvpilot").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    config = engine_config_from_args(args)
    settings = ServeSettings(
        served_model_name=args.served_model_name or config.model or EMBEDDED_MODEL,
        host=args.host, port=args.port, api_key=args.api_key or os.environ.get("KVPILOT_API_KEY") or None,
        max_waiting_requests=args.max_waiting_requests, vllm_compatible_metrics=args.vllm_compatible_metrics,
        grace_period=args.grace_period,
    )
    return serve(config, settings)


def _bench_serve(args: argparse.Namespace) -> int:
    from kvpilot.engine.bench_serve import run

    return run(args)


def _bench_offline(args: argparse.Namespace) -> int:
    from kvpilot.engine.bench_offline import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpilot", description="LLM serving on Kubernetes")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="offline generation with the engine")
    gen.add_argument("prompt", nargs="*", help="prompts (default: a sample prompt)")
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True, help="apply the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    add_engine_args(gen)
    gen.set_defaults(func=_generate)

    srv = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--served-model-name", help="the name clients send as `model` (default: --model)")
    srv.add_argument("--api-key", help="require `Authorization: Bearer <key>` on /v1/* (default: $KVPILOT_API_KEY)")
    srv.add_argument("--max-waiting-requests", type=int, default=256,
                     help="sequences waiting to be scheduled beyond which requests get 429 (default: 256)")
    srv.add_argument("--vllm-compatible-metrics", action="store_true",
                     help="also export vllm:* metric names for vLLM dashboards and the Gateway API Inference Extension")
    srv.add_argument("--grace-period", type=float, default=25.0,
                     help="seconds in-flight requests get to finish after SIGTERM (default: 25)")
    add_engine_args(srv)
    srv.set_defaults(func=_serve)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    offline = bench_sub.add_parser("offline", help="engine vs HuggingFace generate, output tokens/s")
    offline.add_argument("--num-requests", type=int, default=64)
    offline.add_argument("--hf-batch-size", default="16,64", help="comma-separated HF static batch sizes; the best is the baseline")
    offline.add_argument("--seed", dest="bench_seed", type=int, default=0)
    offline.add_argument("--output", default="bench/out/offline.json")
    offline.set_defaults(func=_bench_offline)
    from kvpilot.engine.bench_serve import add_bench_serve_args

    serve_bench = bench_sub.add_parser("serve", help="load generator: Poisson arrivals against kvpilot serve and an HF baseline")
    add_bench_serve_args(serve_bench)
    serve_bench.set_defaults(func=_bench_serve)

    from kvpilot.operator.cli import register

    register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as err:
        print(f"kvpilot: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
