"""What the gateway reads of a request body: the model it names and the beginning of its prompt
(the key of prefix routing); nothing else is kept. Pure."""

from __future__ import annotations

import json
from typing import Any, NamedTuple

# The prefix key: this many characters of the first user message (chat) or of the prompt. As
# KubeAI's: long enough to tell conversations apart, short enough that the turns of one agree.
PREFIX_CHARS = 100


class BadBody(ValueError):
    """The body is not an OpenAI request the gateway can route; the message says why."""


class Routed(NamedTuple):
    model: str
    prefix: str


def _text(content: Any) -> str:
    """A message's text: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _prefix(body: dict[str, Any]) -> str:
    messages = body.get("messages")
    if isinstance(messages, list):
        first = next((m for m in messages if isinstance(m, dict) and m.get("role") == "user"), None)
        return _text((first or {}).get("content"))[:PREFIX_CHARS]
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0]
    return prompt[:PREFIX_CHARS] if isinstance(prompt, str) else ""


def read_body(raw: bytes | bytearray) -> Routed:
    """The `model` and prefix key of a JSON request body. The parsed body is dropped at once: only
    the raw bytes go on to the engine (bounded, see limits.py), never a second, larger copy as
    Python objects."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise BadBody("the body must be a JSON object with a `model`") from None
    model = body.get("model") if isinstance(body, dict) else None
    if not isinstance(model, str) or not model:
        raise BadBody("the body must be a JSON object with a `model` (a string)")
    return Routed(model, _prefix(body))
