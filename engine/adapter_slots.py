"""LoRA adapters in the embedded engine: named versions served from a few peft slots.

The learner publishes a new version after every update, and every version is served under its
own name until the requests that use it finish. Building peft modules for each version (peft's
`load_adapter`) takes 200-370 ms with the model held; a new version usually lands in a slot
that an unloaded version left behind instead, its tensors swapped in place.

The in-place swap is a plain copy of each saved tensor into the slot's parameter. peft has its
own (`peft.utils.hotswap.hotswap_adapter_from_state_dict`), measured against this copy on
SmolLM2-135M (r 16, all seven projections, 2 CPU cores; bench/adapter_swap.py): 23 ms against
5 ms median, with identical logits. peft's version walks the whole model state dict and looks
every module up by name on each swap, and updates the LoRA scaling, which the copy need not do:
a slot is only reused by an adapter with the same rank, alpha and targets (its `signature`).
So the copy stays; a slot signature mismatch falls back to peft's `load_adapter`.

Not thread-safe: only the engine's worker thread calls it.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nextstate.engine.base import EngineError, UnknownAdapterError

# Freed slots kept for the next versions; more are deleted (their memory given back).
MAX_FREE_SLOTS = 2
# peft's name for "no adapter" in a mixed batch (`adapter_names=`).
BASE_ROW = "__base__"
_LORA_KEY = re.compile(r"\.(lora_[AB])\.weight$")


def copy_into_slot(model: torch.nn.Module, slot: str, tensors: dict[str, torch.Tensor]) -> bool:
    """Copy a saved adapter's tensors into peft slot `slot` in place; False (nothing copied)
    unless they cover exactly that slot's LoRA parameters, shape for shape."""
    params = dict(model.named_parameters())
    targets = []
    for key, value in tensors.items():
        target = params.get(_LORA_KEY.sub(rf".\1.{slot}.weight", key))
        if target is None or target.shape != value.shape:
            return False
        targets.append((target, value))
    if len(targets) != sum(1 for name in params if f".{slot}." in name):
        return False
    with torch.no_grad():
        for target, value in targets:
            target.copy_(value.to(target.dtype))
    return True


@dataclass(frozen=True)
class AdapterFiles:
    """A published adapter read from disk (off the model thread): what must match for its
    tensors to fit an existing slot, its config and its tensors."""

    signature: tuple
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]

    @classmethod
    def read(cls, path: Path) -> AdapterFiles:
        from safetensors.torch import load_file

        config = json.loads((path / "adapter_config.json").read_text())
        targets = config.get("target_modules")
        signature = (
            config.get("peft_type"), config.get("r"), config.get("lora_alpha"),
            tuple(sorted(targets)) if isinstance(targets, list) else targets,
            config.get("use_rslora", False), config.get("use_dora", False), config.get("bias", "none"),
            tuple(config.get("modules_to_save") or ()),
        )
        weights = path / "adapter_model.safetensors"
        return cls(signature, config, load_file(str(weights)) if weights.is_file() else {})


@dataclass(frozen=True)
class Slot:
    slot: str  # peft adapter name inside the model
    signature: tuple
    path: str


class AdapterSlots:
    """Served adapter names → peft slots of one base model."""

    def __init__(self, base: torch.nn.Module) -> None:
        self.base = base
        self.model: torch.nn.Module = base  # a peft.PeftModel once the first adapter loads
        self._peft: Any = None
        self._served: dict[str, Slot] = {}
        self._free: list[Slot] = []
        self._counter = 0
        self._active: str | None = None

    @property
    def names(self) -> list[str]:
        return list(self._served)

    def __contains__(self, name: object) -> bool:
        return name in self._served

    def slot_of(self, name: str) -> str:
        return self._served[name].slot

    def use(self, name: str | None) -> contextlib.AbstractContextManager:
        """Route the next forward passes through adapter `name` (None: the base model)."""
        if name is not None and name not in self._served:
            # Never fall back to the base model silently: that would serve the wrong policy.
            raise UnknownAdapterError(f"adapter {name!r} is not loaded")
        if self._peft is None:
            return contextlib.nullcontext()
        if name is None:
            return self._peft.disable_adapter()
        slot = self._served[name].slot
        if self._active != slot:
            self._peft.set_adapter(slot)
            self._active = slot
        return contextlib.nullcontext()

    def row_names(self, names: list[str | None]) -> list[str] | None:
        """peft's per-row adapter names for a batch mixing `names` (None: the base model), or
        None when all rows use one and `use` routes the whole pass."""
        if self._peft is None or len(set(names)) == 1:
            return None
        for name in names:
            if name is not None and name not in self._served:
                raise UnknownAdapterError(f"adapter {name!r} is not loaded")
        return [BASE_ROW if name is None else self._served[name].slot for name in names]

    def load(self, name: str, path: str, files: AdapterFiles) -> None:
        if name in self._served:
            raise EngineError(f"adapter {name!r} is already loaded")
        for i, slot in enumerate(self._free):
            if slot.signature == files.signature and copy_into_slot(self._peft, slot.slot, files.tensors):
                del self._free[i]
                self._served[name] = Slot(slot.slot, files.signature, path)
                return
        self._served[name] = Slot(self._new_slot(path), files.signature, path)

    def unload(self, name: str) -> None:
        if name not in self._served:
            raise UnknownAdapterError(f"adapter {name!r} is not loaded")
        self._free.append(self._served.pop(name))
        while len(self._free) > MAX_FREE_SLOTS:
            self._peft.delete_adapter(self._free.pop(0).slot)
        self._active = None

    def _new_slot(self, path: str) -> str:
        from peft import PeftModel

        slot = f"slot{self._counter}"
        self._counter += 1
        if self._peft is None:
            self._peft = PeftModel.from_pretrained(self.base, path, adapter_name=slot, is_trainable=False)
            self._peft.eval()
            self.model = self._peft
        else:
            self._peft.load_adapter(path, adapter_name=slot, is_trainable=False)
        self._active = None
        return slot
