"""Run by the vLLM venv (tests/vllm/env.py), never imported by the project: what vLLM makes of EAGLE-3
heads. Each stdin line is one of:

- {"id", "supports_eagle3": [architectures]}: whether each architecture's vLLM class gives an EAGLE-3
  head the hidden states it drafts from (SupportsEagle3), or why the class does not load here;
- {"id", "config": a target's config.json, "head": an EAGLE-3 head's config.json}: the target planned
  beside the head under SpeculativeConfig method "eagle3" (the method vLLM settles on, the head's
  class, its parameters' bytes in the model's 16-bit dtype, its attention layers' KV bytes per token,
  and the pool of both, as tests/vllm/kv_specs.py plans it), and what method "eagle" does with the
  same head.

Each stdout line is {"id", ...} with those, or the error. The heads are built on the meta device.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from vllm.model_executor.model_loader.utils import get_model_architecture
from vllm.model_executor.models.interfaces import supports_eagle3
from vllm.model_executor.models.registry import ModelRegistry

from tests.vllm.kv_specs import _init_distributed, _layer, _layer_specs, _planned, _vllm_config, drafter

BYTES_AS_LOADED = 2  # vLLM loads the head's floating-point weights in the target's 16-bit dtype


def support(architectures: list[str]) -> dict[str, Any]:
    """Per architecture, whether its class is SupportsEagle3; for a class this venv cannot import
    (a vision tower needs torchvision), the base classes its source declares."""
    found: dict[str, Any] = {}
    for name in architectures:
        try:
            model_class = ModelRegistry._try_load_model_cls(name)
            found[name] = _declared_bases(name) if model_class is None else bool(supports_eagle3(model_class))
        except Exception as error:  # noqa: BLE001 - reported per class, for the test to show
            found[name] = f"{type(error).__name__}: {error}"
    return found


def _declared_bases(name: str) -> list[str]:
    registered = ModelRegistry.models[name]
    spec = importlib.util.find_spec(registered.module_name)
    assert spec is not None and spec.origin is not None, registered.module_name
    tree = ast.parse(Path(spec.origin).read_text())
    [found] = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == registered.class_name]
    return [ast.unparse(base) for base in found.bases]


def _parameter_bytes(model: torch.nn.Module) -> int:
    return sum(
        p.numel() * (p.element_size() if not p.dtype.is_floating_point else BYTES_AS_LOADED) for p in model.parameters()
    )


def with_head(folder: Path, head: dict[str, Any]) -> dict[str, Any]:
    """The target in `folder` planned beside the EAGLE-3 head `head` as vLLM 0.33 plans it."""
    head_folder = folder.parent / f"{folder.name}-head"
    head_folder.mkdir()
    (head_folder / "config.json").write_text(json.dumps(head))
    vllm_config = _vllm_config(folder, eagle_head=head_folder, eagle_method="eagle3")
    speculative = vllm_config.speculative_config
    assert speculative is not None
    _, specs = _layer_specs(vllm_config)
    model, drafted = drafter(vllm_config, speculative.draft_model_config)
    return {
        "method": speculative.method,
        "head_class": type(model).__name__,
        "parameter_bytes": _parameter_bytes(model),
        "head_layers": [_layer(spec, vllm_config) for spec in drafted.values()],
        "pool": _planned(vllm_config, {**specs, **drafted}),
        "as_eagle": _as_eagle(folder, head_folder),
    }


def _as_eagle(folder: Path, head_folder: Path) -> str:
    """The head's class under method "eagle", or why vLLM has none."""
    try:
        speculative = _vllm_config(folder, eagle_head=head_folder).speculative_config
        model_class, _ = get_model_architecture(speculative.draft_model_config)
        return model_class.__name__
    except Exception as error:  # noqa: BLE001 - the refusal is what the test looks at
        # The first line of pydantic's message, without vLLM's list of every architecture it runs.
        return str(error).splitlines()[1].split(". Supported architectures")[0].strip()


def main() -> None:
    _init_distributed()
    with tempfile.TemporaryDirectory() as scratch:
        for line in sys.stdin:
            case = json.loads(line)
            try:
                if "supports_eagle3" in case:
                    found: dict[str, Any] = {"supports_eagle3": support(case["supports_eagle3"])}
                else:
                    folder = Path(scratch) / case["id"]
                    folder.mkdir()
                    (folder / "config.json").write_text(json.dumps(case["config"]))
                    found = with_head(folder, case["head"])
            except Exception as error:  # noqa: BLE001 - reported per case, for the test to show
                found = {"error": f"{type(error).__name__}: {error}"}
            print(json.dumps({"id": case["id"], **found}), flush=True)


if __name__ == "__main__":
    main()
