"""What kopf remembers of the last handled InferenceService: the SHA-256 of its essence (the spec,
labels and annotations), not a copy of it.

kopf keeps the essence it last handled to tell an update from an event that changed nothing; its
annotation storage writes the whole essence as JSON into an annotation of the object, a second copy
of the spec on every InferenceService (a spec with a long env list puts the object near the 256 KiB
annotation limit twice over). Our handlers do the same for create, update and resume and never read
kopf's diff, so whether the essence changed is all they need, and a digest tells that.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import kopf

PREFIX = "sha256:"


def essence_digest(essence: Any) -> str:
    """The digest kopf's essence is remembered by: canonical JSON, so key order does not count."""
    canonical = json.dumps(essence, sort_keys=True, separators=(",", ":"))
    return PREFIX + hashlib.sha256(canonical.encode()).hexdigest()


class DigestDiffBaseStorage(kopf.AnnotationsDiffBaseStorage):
    """kopf's annotation storage holding a digest: `fetch` gives back the object's own essence when
    it hashes to the stored digest (no change), an empty essence when it does not (a change), and
    None when nothing is stored (a new object). A full essence written by an older operator is a
    change once, then replaced by a digest."""

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        stored = next(
            (
                body.metadata.annotations[key]
                for key in self.make_keys(self.key, body=body)
                if key in body.metadata.annotations
            ),
            None,
        )
        if stored is None:
            return None
        essence = self.build(body=body)
        return essence if stored.strip() == essence_digest(essence) else kopf.BodyEssence()

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        for key in self.make_keys(self.key, body=body):
            patch.metadata.annotations[key] = essence_digest(essence)
        self._store_marker(prefix=self.prefix, patch=patch, body=body)
