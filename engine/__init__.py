"""kvpilot engine: a paged-KV, continuous-batching LLM runtime.

Names are imported on first use so that `kvpilot plan` and other light commands, which share this
package's CLI, do not pay for importing torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "LLM": "kvpilot.engine.llm",
    "LLMEngine": "kvpilot.engine.llm_engine",
    "EngineConfig": "kvpilot.engine.contract.config",
    "SamplingParams": "kvpilot.engine.core.sampling_params",
    "RequestOutput": "kvpilot.engine.outputs",
    "CompletionOutput": "kvpilot.engine.outputs",
}
__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    # For type checkers only: at run time __getattr__ imports these on first use.
    from kvpilot.engine.contract.config import EngineConfig  # noqa: F401
    from kvpilot.engine.core.sampling_params import SamplingParams  # noqa: F401
    from kvpilot.engine.llm import LLM  # noqa: F401
    from kvpilot.engine.llm_engine import LLMEngine  # noqa: F401
    from kvpilot.engine.outputs import CompletionOutput, RequestOutput  # noqa: F401


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kvpilot.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
