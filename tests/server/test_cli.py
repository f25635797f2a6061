"""`kvpilot serve` accepts exactly what the operator renders into engine pods."""

from __future__ import annotations

from kvpilot.engine.cli import build_parser, engine_config_from_args
from kvpilot.operator import render
from kvpilot.operator.planner import plan
from kvpilot.operator.spec import InferenceServiceSpec


def test_serve_accepts_the_operators_rendered_args() -> None:
    spec = InferenceServiceSpec.model_validate({
        "model": {"name": "llama-2-7b", "source": "hf://meta-llama/Llama-2-7b-hf"},
        "accelerator": {"type": "A10G"},
        "serving": {"maxContextLength": 4096, "speculative": "off", "quantization": "none"},
    })
    p = plan(spec)
    args = build_parser().parse_args(["serve", *render.engine_args(spec, p, "meta-llama/Llama-2-7b-hf")])
    config = engine_config_from_args(args)
    assert (args.host, args.port, args.served_model_name) == ("0.0.0.0", 8000, "llama-2-7b")
    assert config.model == "meta-llama/Llama-2-7b-hf"
    assert config.max_model_len == 4096
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (p.max_num_seqs, p.max_num_batched_tokens)
    assert (config.quantization, config.speculative) == ("none", "off")


def test_serve_server_flags() -> None:
    args = build_parser().parse_args([
        "serve", "--api-key", "k", "--max-waiting-requests", "3", "--vllm-compatible-metrics", "--grace-period", "5",
    ])
    assert (args.api_key, args.max_waiting_requests, args.vllm_compatible_metrics, args.grace_period) == ("k", 3, True, 5.0)
