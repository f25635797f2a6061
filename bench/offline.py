"""Offline throughput: the engine versus HuggingFace batched generate on the same requests, one run.

    .venv/bin/python -m bench.offline [--num-requests 64] [--hf-batch-size 16,64]   # from the repository root

bench/compare_offline.py runs the engine half of it (make_requests + time_engine) on two source
trees, for a before/after comparison.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.machine import machine, write_result


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


@dataclass
class BenchResult:
    system: str
    seconds: float
    output_tokens: int

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds


def make_requests(n: int, seed: int, vocab_size: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [
        BenchRequest([rng.randrange(100, vocab_size) for _ in range(rng.randint(32, 512))], rng.randint(16, 256))
        for _ in range(n)
    ]


# The engine's options for this workload: every request fits in the batch and the KV pool.
ENGINE_OPTIONS = {"max_num_seqs": 64, "max_num_batched_tokens": 1024, "kv_cache_memory_bytes": 2 << 30}


def time_engine(requests: list[BenchRequest]) -> tuple[float, list[list[int]]]:
    """Generate every request with the engine; (seconds of `generate`, output token ids per request).

    Only the public API (`LLM(...).generate(prompts, SamplingParams(...))`), so that it runs on older
    source trees too (bench/compare_offline.py); loading the model is not timed."""
    from kvpilot.engine import LLM, SamplingParams

    llm = LLM(**ENGINE_OPTIONS)
    params = [SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True) for r in requests]
    start = time.perf_counter()
    outputs = llm.generate([r.prompt_token_ids for r in requests], params)
    seconds = time.perf_counter() - start
    return seconds, [list(o.outputs[0].token_ids) for o in outputs]


def run_engine(requests: list[BenchRequest]) -> BenchResult:
    seconds, tokens = time_engine(requests)
    return BenchResult("kvpilot", seconds, sum(len(t) for t in tokens))


def run_hf(requests: list[BenchRequest], batch_size: int) -> BenchResult:
    """Static batches in arrival order, left-padded; each batch runs until its longest output is done."""
    from transformers import AutoModelForCausalLM

    from kvpilot.engine.model.loader import embedded_model_dir

    model = AutoModelForCausalLM.from_pretrained(embedded_model_dir(), dtype=torch.float32).eval()
    pad = model.config.pad_token_id or 0
    start = time.perf_counter()
    useful = 0
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.tensor([[pad] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids for r in batch])
        mask = torch.tensor([[0] * (width - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids) for r in batch])
        longest = max(r.output_len for r in batch)
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=pad,
            )
        useful += sum(r.output_len for r in batch)  # tokens past a request's own length are waste
        print(f"  hf batch {i // batch_size + 1}: {time.perf_counter() - start:.1f}s", flush=True)
    return BenchResult(f"hf-generate-batch{batch_size}", time.perf_counter() - start, useful)


def embedded_vocab_size() -> int:
    """The vocabulary size of the embedded model, the range of the random prompt token ids."""
    from kvpilot.engine.model.loader import embedded_model_dir, load_config

    return int(load_config(embedded_model_dir()).vocab_size)


def run(args: argparse.Namespace) -> int:
    requests = make_requests(args.num_requests, args.bench_seed, embedded_vocab_size())
    print(
        f"{len(requests)} requests, {sum(len(r.prompt_token_ids) for r in requests)} prompt tokens, "
        f"{sum(r.output_len for r in requests)} output tokens, torch threads {torch.get_num_threads()}",
        flush=True,
    )
    results = [run_engine(requests)]
    print(f"  kvpilot: {results[0].seconds:.1f}s", flush=True)
    results += [run_hf(requests, int(b)) for b in args.hf_batch_size.split(",")]
    best_hf = max(results[1:], key=lambda r: r.tokens_per_second)
    ratio = results[0].tokens_per_second / best_hf.tokens_per_second
    for r in results:
        print(f"{r.system:24s} {r.seconds:8.1f} s  {r.output_tokens:6d} tokens  {r.tokens_per_second:8.1f} tok/s")
    print(f"kvpilot / best HF ({best_hf.system}): {ratio:.2f}x")
    write_result(
        Path(args.output),
        {
            "machine": machine(),
            "requests": len(requests),
            "seed": args.bench_seed,
            "results": [asdict(r) | {"tokens_per_second": r.tokens_per_second} for r in results],
            "speedup_vs_best_hf": ratio,
        },
    )
    return 0


def add_bench_offline_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-requests", type=int, default=64, help="requests in the workload (default: 64)")
    parser.add_argument(
        "--hf-batch-size",
        default="16,64",
        help="comma-separated HF static batch sizes; the best is the baseline (default: 16,64)",
    )
    parser.add_argument(
        "--seed", dest="bench_seed", type=int, default=0, help="seed of the prompts and output lengths (default: 0)"
    )
    parser.add_argument(
        "--output", default="bench/out/offline.json", help="JSON results (default: bench/out/offline.json)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.offline", description="engine vs HuggingFace generate, output tokens/s"
    )
    add_bench_offline_args(parser)
    return parser


if __name__ == "__main__":
    sys.exit(run(build_parser().parse_args()))
