"""`kvpilot serve`'s server flags (tests/operator/controller/test_contract.py parses what the operator renders)."""

from __future__ import annotations

from kvpilot.engine.cli import build_parser


def test_serve_server_flags() -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "--api-key",
            "k",
            "--max-waiting-requests",
            "3",
            "--vllm-compatible-metrics",
            "--grace-period",
            "5",
        ]
    )
    assert (args.api_key, args.max_waiting_requests, args.vllm_compatible_metrics, args.grace_period) == (
        "k",
        3,
        True,
        5.0,
    )
