"""`kvpilot eval`: what a quantization scheme costs in quality, against the unquantized model.

- Perplexity on English text that ships with every Python: the documentation topics of CPython's
  `pydoc_data` (PSF license), cut into windows the model scores token by token.
- Greedy agreement: the share of positions where the scheme's most likely next token is the
  unquantized model's.
- Task accuracy: 101 four-way questions (engine/tools/eval_tasks.py), answered by the choice the model
  gives the highest log-probability.

Everything is scored with the engine's own prompt log-probabilities, so it measures what serving
computes.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kvpilot.engine.contract.config import QUANTIZATION_SCHEMES, EngineConfig
from kvpilot.engine.core.sampling_params import SamplingParams
from kvpilot.engine.llm import LLM
from kvpilot.engine.tools.eval_tasks import CAPITALS, choices

WINDOW_TOKENS = 512


@dataclass
class SchemeQuality:
    scheme: str
    weight_bytes: int
    perplexity: float
    scored_tokens: int
    greedy_agreement: float | None  # against the first scheme evaluated (the unquantized one)
    task_accuracy: float
    seconds: float


def corpus_text() -> str:
    from pydoc_data.topics import topics  # type: ignore[import-not-found]

    return "\n\n".join(topics[key] for key in sorted(topics))


def _score_windows(llm: LLM, windows: list[list[int]]) -> tuple[list[float], list[int]]:
    """Per scored position: the logprob of the actual token and the model's most likely token."""
    outputs = llm.generate(windows, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    logprobs, top1 = [], []
    for out in outputs:
        for position in out.prompt_logprobs[1:]:
            logprobs.append(position.chosen.logprob)
            top1.append(position.top[0].token_id)
    return logprobs, top1


def _task_accuracy(llm: LLM) -> float:
    prompts, spans = [], []
    for index, (country, _) in enumerate(CAPITALS):
        prefix = llm.engine.tokenize(f"The capital of {country} is")
        for choice in choices(index):
            answer = llm.engine.tokenize(" " + choice)
            prompts.append(prefix + answer)
            spans.append(len(answer))
    outputs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    scores = [sum(p.chosen.logprob for p in out.prompt_logprobs[-span:]) for out, span in zip(outputs, spans)]
    correct = sum(max(range(4), key=lambda c: scores[4 * i + c]) == 0 for i in range(len(CAPITALS)))
    return correct / len(CAPITALS)


def evaluate(schemes: list[str], num_tokens: int, engine_options: dict[str, object]) -> list[SchemeQuality]:
    results: list[SchemeQuality] = []
    reference_top1: list[int] | None = None
    for scheme in schemes:
        start = time.perf_counter()
        llm = LLM(**{**engine_options, "quantization": scheme})
        ids = llm.engine.tokenize(corpus_text())[:num_tokens]
        windows = [
            ids[i : i + WINDOW_TOKENS]
            for i in range(0, len(ids) - 1, WINDOW_TOKENS)
            if len(ids[i : i + WINDOW_TOKENS]) > 1
        ]
        logprobs, top1 = _score_windows(llm, windows)
        agreement = None
        if reference_top1 is None:
            reference_top1 = top1
        else:
            agreement = sum(a == b for a, b in zip(top1, reference_top1)) / len(top1)
        results.append(
            SchemeQuality(
                scheme=scheme,
                weight_bytes=llm.engine.runner.weight_bytes,
                perplexity=math.exp(-sum(logprobs) / len(logprobs)),
                scored_tokens=len(logprobs),
                greedy_agreement=agreement,
                task_accuracy=_task_accuracy(llm),
                seconds=time.perf_counter() - start,
            )
        )
        print(_row(results[-1]), flush=True)
    return results


def _row(r: SchemeQuality) -> str:
    agreement = "-" if r.greedy_agreement is None else f"{r.greedy_agreement:.1%}"
    return (
        f"| {r.scheme} | {r.weight_bytes / 2**20:.1f} MiB | {r.perplexity:.3f} | {r.scored_tokens} | {agreement} | "
        f"{r.task_accuracy:.1%} | {r.seconds:.0f} s |"
    )


def run(schemes: list[str], num_tokens: int, config: EngineConfig, output: Path | None) -> int:
    unknown = [s for s in schemes if s not in QUANTIZATION_SCHEMES]
    if unknown:
        raise ValueError(f"unknown schemes {unknown}; this engine runs {', '.join(QUANTIZATION_SCHEMES)}")
    print("| scheme | weights | perplexity | tokens | greedy agreement | task accuracy | time |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    options = config.model_dump(exclude={"quantization"})
    results = evaluate(schemes, num_tokens, options)
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(
            json.dumps({"num_tokens": num_tokens, "engine": options, "results": [asdict(r) for r in results]}, indent=2)
        )
    return 0
