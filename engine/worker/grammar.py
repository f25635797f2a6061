"""Structured outputs on xgrammar: grammars compiled once per spec, and per request a matcher that
says which tokens may come next, as a bitmask the sampler applies to the logits.

Compiling a JSON schema can take from milliseconds to seconds, so the server compiles in a worker
thread before it submits a request; the engine thread then finds the grammar in the cache. A
request's matcher is fed the request's own output tokens just before each mask is built, never the
tokens a step sampled: a step that fails, a stop string that cuts the output, or a preemption that
recomputes the prompt leave the matcher exactly where the request's committed tokens put it.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Iterable

import torch
import xgrammar

from kvpilot.engine.core.request import Request
from kvpilot.engine.core.structured_output import StructuredOutput

# Distinct specs whose compiled grammars are kept; a client cycling through more compiles again.
CACHE_SIZE = 256
# xgrammar prefixes its errors with a timestamp and its C++ source file: the client needs neither.
_ERROR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


class Grammars:
    """Compiled grammars by spec, for one tokenizer; safe to call from several threads."""

    def __init__(self, tokenizer: object, vocab_size: int, stop_token_ids: frozenset[int], threads: int = 2) -> None:
        # The model's vocabulary can be wider than the tokenizer's (padding rows): masks span it all.
        self.info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        self._compiler = xgrammar.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self._cache: OrderedDict[StructuredOutput, xgrammar.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def cached(self, spec: StructuredOutput) -> bool:
        with self._lock:
            return spec in self._cache

    def compile(self, spec: StructuredOutput) -> xgrammar.CompiledGrammar:
        """The spec's grammar, compiled on the first call; ValueError (with xgrammar's reason) for
        a schema, regex or grammar it cannot compile."""
        with self._lock:
            grammar = self._cache.get(spec)
            if grammar is not None:
                self._cache.move_to_end(spec)
                return grammar
        try:
            grammar = self._compile(spec)
        except (RuntimeError, ValueError) as err:
            reason = _ERROR_PREFIX.sub("", str(err).strip()).splitlines()[0]
            raise ValueError(f"the {spec.kind} structured output cannot be compiled: {reason}") from None
        with self._lock:
            self._cache[spec] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def _compile(self, spec: StructuredOutput) -> xgrammar.CompiledGrammar:
        compiler = self._compiler
        if spec.kind == "json":
            return compiler.compile_json_schema(spec.spec)
        if spec.kind == "json_object":
            # An object, as OpenAI's JSON mode promises (xgrammar's built-in JSON grammar takes any
            # value), with whatever properties: not strict.
            return compiler.compile_json_schema('{"type": "object"}', strict_mode=False)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.spec)
        return compiler.compile_grammar(spec.ebnf() if spec.kind == "choice" else spec.spec)


class GrammarMatchers:
    """One matcher per running request with a structured output, and the step's bitmask."""

    def __init__(self, grammars: Grammars) -> None:
        self.grammars = grammars
        self._matchers: dict[str, tuple[xgrammar.GrammarMatcher, int]] = {}  # id -> (matcher, tokens fed)

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._matchers.pop(request_id, None)

    def bitmask(self, rows: list[Request], device: torch.device) -> tuple[torch.Tensor, list[int]] | None:
        """The allowed tokens of each constrained row (a bitmask of [rows, ceil(vocab / 32)] int32)
        and those rows' indices; None when no row is constrained. A request whose grammar has
        finished (its stop token was sampled, yet ignore_eos keeps it going) is no longer masked."""
        constrained = [(row, r) for row, r in enumerate(rows) if r.params.structured is not None]
        if not constrained:
            return None
        mask = xgrammar.allocate_token_bitmask(len(rows), self.grammars.info.vocab_size)
        indices = []
        for row, request in constrained:
            matcher = self._advance(request)
            if not matcher.is_terminated():
                matcher.fill_next_token_bitmask(mask, row)
                indices.append(row)
        if not indices:
            return None
        return mask.to(device), indices

    def _advance(self, request: Request) -> xgrammar.GrammarMatcher:
        """The request's matcher, fed the output tokens it has not seen yet."""
        matcher, fed = self._matchers.get(request.request_id) or (
            xgrammar.GrammarMatcher(self.grammars.compile(request.params.structured)),
            0,
        )
        output = request.output_token_ids
        for token in output[fed:]:
            if matcher.is_terminated():
                break
            if not matcher.accept_token(token):
                raise RuntimeError(f"token {token} of request {request.request_id} breaks its structured output")
        self._matchers[request.request_id] = (matcher, len(output))
        return matcher
