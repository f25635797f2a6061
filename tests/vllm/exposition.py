"""Run by the vLLM venv (tests/vllm/env.py), never imported by the project: prints the /metrics
body vLLM's own PrometheusStatLogger writes after recording the engine steps given as JSON on
stdin, for a served model configured by `vllm serve ARGV` (tests/vllm/engine_configs.py builds the
configuration the same way).

stdin: {"argv": [...], "config": {config.json}, "steps": [{"running", "waiting", "kv_usage",
"drafts": [[proposed, accepted], ...], "prompts": [[tokens, prefix cache hits], ...], "ttfts": [...],
"itls": [...], "finished": [{"tpot", "tokens", "reason"}]}]}
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from prometheus_client import REGISTRY, generate_latest
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.v1.engine import FinishReason
from vllm.v1.metrics.loggers import PrometheusStatLogger
from vllm.v1.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats
from vllm.v1.spec_decode.metrics import SpecDecodingStats

from tests.vllm.engine_configs import PARSER


def main() -> None:
    case = json.load(sys.stdin)
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(case["config"]))
        args = PARSER.parse_args(["serve", folder, *case["argv"], "--skip-tokenizer-init"])
        args.model = args.model_tag
        config = AsyncEngineArgs.from_cli_args(args).create_engine_config()
    logger = PrometheusStatLogger(config)
    if "num_gpu_blocks" in case:
        # What the engine core does once it has sized its KV pool: the blocks go into the cache
        # config, which the logger exports as vllm:cache_config_info.
        config.cache_config.num_gpu_blocks = case["num_gpu_blocks"]
        logger.log_engine_initialized()
    spec_tokens = config.speculative_config.num_speculative_tokens if config.speculative_config else 0
    for step in case["steps"]:
        scheduler = SchedulerStats(
            num_running_reqs=step["running"], num_waiting_reqs=step["waiting"], kv_cache_usage=step["kv_usage"]
        )
        for tokens, hits in step.get("prompts", []):
            scheduler.prefix_cache_stats.record(num_tokens=tokens, num_hits=hits, preempted=False)
        if spec_tokens:
            scheduler.spec_decoding_stats = SpecDecodingStats.new(spec_tokens)
            for proposed, accepted in step.get("drafts", []):
                scheduler.spec_decoding_stats.observe_draft(proposed, accepted)
        iteration = IterationStats()
        iteration.time_to_first_tokens_iter = list(step.get("ttfts", []))
        iteration.inter_token_latencies_iter = list(step.get("itls", []))
        iteration.finished_requests = [
            FinishedRequestStats(
                finish_reason=FinishReason[done["reason"].upper()],
                num_generation_tokens=done["tokens"],
                mean_time_per_output_token=done["tpot"],
            )
            for done in step.get("finished", [])
        ]
        logger.record(scheduler, iteration)
    sys.stdout.write(generate_latest(REGISTRY).decode())


if __name__ == "__main__":
    main()
