"""JSON merge patches (RFC 7386) of an object's status: what every status writer sends."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def merge_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON merge patch (RFC 7386) that turns `old` into `new`: changed and new keys, None for
    removed ones, lists whole; {} when they are equal (then there is nothing to write)."""
    patch: dict[str, Any] = {key: None for key in old if key not in new}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            nested = merge_patch(before, value)
            if nested:
                patch[key] = nested
        elif key not in old or before != value:
            patch[key] = value
    return patch


def as_merge_patch(old_status: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    """`fields` as a JSON merge patch onto `old_status`: a merge patch keeps every key it does not
    name, so keys gone from the new value (the baseline of a pod that is gone) must be named null."""
    return merge_patch({key: old_status[key] for key in fields if key in old_status}, fields)
