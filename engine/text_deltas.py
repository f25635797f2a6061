"""Turn successive snapshots of a sequence's output text into the deltas a stream may send.

The engine re-decodes the whole output every step and cuts it before a stop string once one
appears, so a snapshot is final only when the sequence has finished. Until then two tails are
unsafe to send: U+FFFD from a multi-byte character whose remaining bytes are in tokens not yet
generated, and any tail that could be the start of a stop string (sent text cannot be taken back
when the stop string completes and the engine cuts it).
"""

from __future__ import annotations

_REPLACEMENT_CHAR = "\ufffd"


class TextDeltas:
    def __init__(self, stop: list[str]) -> None:
        self._stop = stop
        self._sent = 0  # characters of the snapshot already sent

    def next(self, text: str, finished: bool) -> str:
        end = len(text) if finished else self._safe_end(text)
        if end <= self._sent:
            return ""
        delta = text[self._sent : end]
        self._sent = end
        return delta

    def _safe_end(self, text: str) -> int:
        end = len(text.rstrip(_REPLACEMENT_CHAR))
        held = 0
        for stop in self._stop:
            # Longest proper prefix of `stop` that the text ends with.
            for k in range(min(len(stop) - 1, end), held, -1):
                if text.endswith(stop[:k], 0, end):
                    held = k
                    break
        return end - held
