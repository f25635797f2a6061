"""Which adapters the engine serves (by name), which it holds in memory, which are resident.

As vLLM's: adapters are registered by name and path (at start from --lora-modules, or while serving
through /v1/load_lora_adapter); at most max_cpu_loras of them are held in memory, least recently used
first out (one that is asked for again is read back from its path); a request holds its adapter's
weights until it finishes, so unloading an adapter or evicting it never changes a running request.
At most max_loras distinct adapters run in one step (the scheduler's rule); their weights on the
model's device are the resident ones (Resident), also kept least recently used first out.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable

import torch

from kvpilot.engine.lora.adapter import AdapterError, LoRAAdapter


class UnknownAdapterError(ValueError):
    """No adapter of that name is registered."""


class AdapterRegistry:
    def __init__(self, max_cpu_loras: int, load: Callable[[str, str], LoRAAdapter]) -> None:
        self.max_cpu_loras = max_cpu_loras
        self._load = load  # (name, path) -> the adapter read and checked, or AdapterError
        self._paths: dict[str, tuple[str, int]] = {}  # name -> (path, lora_id)
        self._in_memory: OrderedDict[str, LoRAAdapter] = OrderedDict()
        # Identities start at 1 and are never reused: a name registered again is a new adapter, whose
        # prefix-cache keys must not meet the old one's.
        self._ids = itertools.count(1)

    def names(self) -> dict[str, str]:
        """Registered adapter name -> its path, in registration order."""
        return {name: path for name, (path, _) in self._paths.items()}

    def add(self, name: str, path: str, adapter: LoRAAdapter | None = None) -> LoRAAdapter:
        """Register `name`; `adapter`: already read from `path` (off the engine thread), else read here."""
        if name in self._paths:
            raise AdapterError(f"The lora adapter '{name}' has already been loaded.")
        adapter = adapter if adapter is not None else self._load(name, path)
        adapter.lora_id = next(self._ids)
        self._paths[name] = (path, adapter.lora_id)
        self._keep(adapter)
        return adapter

    def remove(self, name: str) -> None:
        """Stop serving `name`; requests already running with it finish with it."""
        if self._paths.pop(name, None) is None:
            raise UnknownAdapterError(f"The lora adapter '{name}' cannot be found.")
        self._in_memory.pop(name, None)

    def get(self, name: str) -> LoRAAdapter:
        """The adapter for a new request: from memory, else read back from its path."""
        entry = self._paths.get(name)
        if entry is None:
            raise UnknownAdapterError(f"The lora adapter '{name}' cannot be found.")
        adapter = self._in_memory.get(name)
        if adapter is None:
            path, lora_id = entry
            adapter = self._load(name, path)
            adapter.lora_id = lora_id
        self._keep(adapter)
        return adapter

    def _keep(self, adapter: LoRAAdapter) -> None:
        self._in_memory[adapter.name] = adapter
        self._in_memory.move_to_end(adapter.name)
        while len(self._in_memory) > self.max_cpu_loras:
            self._in_memory.popitem(last=False)


class Resident:
    """The adapters' weights on the model's device, for at most max_loras adapters (the slots)."""

    def __init__(self, max_loras: int, device: torch.device) -> None:
        self.max_loras = max_loras
        self.device = device
        self._slots: OrderedDict[int, LoRAAdapter] = OrderedDict()  # lora_id -> on the device

    def activate(self, adapters: list[LoRAAdapter]) -> list[LoRAAdapter]:
        """The step's adapters on the device, evicting the least recently used others."""
        if len(adapters) > self.max_loras:
            raise RuntimeError(f"{len(adapters)} adapters in one step, more than max_loras={self.max_loras}")
        out = []
        for adapter in adapters:
            resident = self._slots.get(adapter.lora_id)
            if resident is None:
                resident = self._slots[adapter.lora_id] = adapter.to(self.device)
            self._slots.move_to_end(adapter.lora_id)
            out.append(resident)
        while len(self._slots) > self.max_loras:
            self._slots.popitem(last=False)
        return out
