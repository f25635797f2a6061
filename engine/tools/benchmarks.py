"""`kvpilot bench serve`: the serving benchmark of a source checkout's bench/, as a command.

The benchmarks live in the repository's bench/ (with their recorded results), not in the installed
package: they start peers (llama.cpp's server, an HF baseline) and write into the checkout. This
command runs them from the checkout the package was installed from in editable mode (`make
install`), and says so plainly anywhere else.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvpilot.engine.cli import COMMANDS

# The checkout that holds bench/ (engine/tools/ is kvpilot.engine.tools in an editable install).
CHECKOUT = Path(__file__).resolve().parents[2]


def _bench_module(name: str):  # noqa: ANN202 - a module
    if not (CHECKOUT / "bench" / f"{name}.py").exists():
        raise ValueError(
            f"`kvpilot bench {name}` runs bench/{name}.py of a source checkout; "
            f"this installation ({CHECKOUT}) has none: install kvpilot from a checkout with `make install`"
        )
    if str(CHECKOUT) not in sys.path:
        sys.path.insert(0, str(CHECKOUT))
    import importlib

    return importlib.import_module(f"bench.{name}")


def _serve(args: argparse.Namespace) -> int:
    args.invocation = "kvpilot " + " ".join(sys.argv[1:])  # what the report says was run
    return int(_bench_module("serve").run(args))


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    bench = sub.add_parser("bench", help=COMMANDS["bench"][1])
    kinds = bench.add_subparsers(dest="benchmark", required=True)
    serve = kinds.add_parser(
        "serve",
        help="streamed completions against kvpilot serve, llama.cpp's llama-server and an "
        "HF baseline, alternating in one run (bench/serve.py)",
    )
    try:
        _bench_module("serve").add_bench_serve_args(serve)
    except ValueError as error:
        serve.set_defaults(func=_fails_with(error))
        return
    serve.set_defaults(func=_serve)


def _fails_with(error: ValueError):  # noqa: ANN202 - a command function
    def fail(_: argparse.Namespace) -> int:
        raise error

    return fail
