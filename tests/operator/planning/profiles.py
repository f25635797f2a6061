"""Device profiles made for tests from measured ones."""

from __future__ import annotations

import json

from kvpilot.engine.contract.device_profile import DeviceProfile


def faster(profile: DeviceProfile, name: str, speed: float) -> DeviceProfile:
    """`profile` as if measured on a machine `speed` times as fast in every figure: bandwidths and
    matmul rates times `speed`, the engine's steps divided by it."""
    data = json.loads(profile.model_dump_json())
    data["name"] = name
    data["memory_bandwidth_bytes_per_s"] *= speed
    data["memory_copy_bandwidth_bytes_per_s"] *= speed
    for matmul in data["matmul"].values():
        for point in (matmul or {}).get("points", []):
            point["flop_per_s"] *= speed
    engine = data["engine"]
    for scheme in engine["schemes"]:
        for step in (*scheme["decode"], *scheme["prefill"]):
            step["seconds"] /= speed
    engine["long_context"]["seconds"] /= speed
    if engine.get("compiled_step_s"):
        engine["compiled_step_s"] /= speed
    return DeviceProfile.model_validate(data)
