"""What an inspection Job reports about a checkpoint on a claim (a pvc:// model.source the spec and
the catalog do not describe): the Architecture its config.json gives, the scheme it is stored in and
its safetensors' bytes. `kvpilot inspect-checkpoint` writes it, the operator reads it back from the
container's termination message; both through this model, so neither can drift from the other."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

from kvpilot.operator.api.spec import Architecture, CheckpointQuantization

# The kubelet keeps at most this many bytes of a termination message (it cuts the rest off): a
# result is written whole or not at all, never cut into JSON that does not parse.
TERMINATION_MESSAGE_LIMIT = 4096
TERMINATION_MESSAGE_PATH = "/dev/termination-log"
# How a refusal's message starts, so that the operator gives the status the same reason as hf://.
UNSUPPORTED = "UnsupportedArchitecture"


class CheckpointInspection(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)

    architecture: Architecture
    quantization: CheckpointQuantization | None = None

    def message(self) -> str:
        """The compact JSON a termination message carries; ValueError when it would not fit."""
        text = self.model_dump_json(by_alias=True, exclude_none=True)
        if len(text.encode()) > TERMINATION_MESSAGE_LIMIT:
            raise ValueError(
                f"the inspection's result is {len(text.encode())} bytes, more than the "
                f"{TERMINATION_MESSAGE_LIMIT} a termination message holds"
            )
        return text
