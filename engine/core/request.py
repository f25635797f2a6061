"""A request as the scheduler sees it: its tokens, how many of them have KV cached, its state."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from kvpilot.engine.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvpilot.engine.lora.adapter import LoRAAdapter


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, stop token or stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        lora: LoRAAdapter | None = None,
    ) -> None:
        self.request_id = request_id
        # The LoRA adapter it runs with (None: the base model); held until it finishes, so that
        # unloading the adapter meanwhile does not change it.
        self.lora = lora
        # Mixed into the prefix-cache key of the first block: requests share cached KV only with
        # requests of the same salt (one salt per tenant keeps tenants' caches apart).
        self.cache_salt = cache_salt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.token_ids = list(prompt_token_ids)  # prompt + output
        # Draft tokens proposed for verification in the next step (speculative decoding).
        self.spec_token_ids: list[int] = []
        # Tokens whose K/V are in the cache; written by the scheduler only.
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # of the prompt, tokens served by the prefix cache at admission
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None
        self.num_preemptions = 0
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        # When the engine queued it (vLLM's QUEUED event), later than arrival_time by the time the
        # request spent in the server (tokenizing, the engine thread's inbox).
        self.queued_time = time.monotonic()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def finish(self, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
