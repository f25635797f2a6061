"""Offline batch inference in the style of vLLM: LLM(...).generate(prompts, sampling_params)."""

from __future__ import annotations

from collections.abc import Sequence

from kvpilot.engine.contract.config import EngineConfig
from kvpilot.engine.core.request import Request
from kvpilot.engine.core.sampling_params import SamplingParams
from kvpilot.engine.llm_engine import LLMEngine
from kvpilot.engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput

Prompt = str | list[int]
ChatMessages = list[dict[str, str]]


class LLM:
    def __init__(self, model: str | None = None, **engine_config: object) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_config))

    @property
    def tokenizer(self):  # noqa: ANN201 - the tokenizer's type depends on the model
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_name: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """`lora_name`: the registered LoRA adapter of every prompt, or one per prompt (None: the base model)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt, as text or as token ids
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")
        loras = [lora_name] * len(prompts) if lora_name is None or isinstance(lora_name, str) else list(lora_name)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} adapter names for {len(prompts)} prompts")

        groups: list[list[Request]] = []
        finals: dict[str, CompletionOutput] = {}
        prompt_logprobs: dict[str, list] = {}
        try:
            for prompt, params, lora in zip(prompts, sampling_params, loras):
                groups.append([self.engine.add_request(prompt, p, lora_name=lora) for p in params.per_sequence()])
                for index, request in enumerate(groups[-1]):
                    finals[request.request_id] = CompletionOutput(index=index, text="", token_ids=[])
            while self.engine.has_unfinished():
                for step in self.engine.step():
                    final = finals[step.request_id]
                    final.text += step.text_delta
                    final.token_ids += step.new_token_ids
                    final.finish_reason, final.stop_reason = step.finish_reason, step.stop_reason
                    if step.logprobs is not None:
                        final.logprobs = (final.logprobs or []) + step.logprobs
                    if step.prompt_logprobs is not None:
                        prompt_logprobs[step.request_id] = step.prompt_logprobs
        except BaseException:
            for group in groups:
                for request in group:
                    self.engine.abort(request.request_id)
            raise
        return [
            _to_output(prompt, group, finals, prompt_logprobs.get(group[0].request_id))
            for prompt, group in zip(prompts, groups)
        ]

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.engine.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, sampling_params)


def _to_output(
    prompt: Prompt,
    group: list[Request],
    finals: dict[str, CompletionOutput],
    prompt_logprobs: list[PositionLogprobs | None] | None,
) -> RequestOutput:
    first = group[0]
    return RequestOutput(
        request_id=first.request_id,
        prompt=prompt if isinstance(prompt, str) else None,
        prompt_token_ids=first.prompt_token_ids,
        outputs=[finals[r.request_id] for r in group],
        num_cached_tokens=first.num_cached_tokens,
        prompt_logprobs=prompt_logprobs,
    )
