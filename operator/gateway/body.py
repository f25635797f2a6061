"""What the gateway reads of a request body: the model it names, and nothing else is kept. Pure."""

from __future__ import annotations

import json


class BadBody(ValueError):
    """The body is not an OpenAI request the gateway can route; the message says why."""


def model_of(raw: bytes | bytearray) -> str:
    """The `model` of a JSON request body. The parsed body is dropped at once: only the raw bytes
    go on to the engine (bounded, see limits.py), never a second, larger copy as Python objects."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise BadBody("the body must be a JSON object with a `model`") from None
    model = body.get("model") if isinstance(body, dict) else None
    if not isinstance(model, str) or not model:
        raise BadBody("the body must be a JSON object with a `model` (a string)")
    return model
