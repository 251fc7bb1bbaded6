"""WeightLoader: put checkpoint tensors (HF names) into a model whose projections may be fused
(q|k|v, gate|up), and check at the end that every parameter — every shard of a fused one —
was filled. Shared by the target models and the DSpark draft."""
from __future__ import annotations

import torch
from torch import nn

from sparkserve.layers.linear import FusedLinear


class WeightLoader:
    def __init__(self, model: nn.Module, stacked: dict[str, tuple[str, str]], what: str = "checkpoint"):
        """stacked: checkpoint name fragment -> (fused module fragment, shard name)."""
        self.model = model
        self.stacked = stacked
        self.what = what
        self.params = dict(model.named_parameters())
        self.modules = dict(model.named_modules())
        self.loaded: set[str] = set()

    def load(self, name: str, tensor: torch.Tensor) -> None:
        for frag, (fused, shard) in self.stacked.items():
            if frag in name:
                mod, kind = name.replace(frag, fused).rsplit(".", 1)
                self.modules[mod].load(shard, tensor, kind)
                self.loaded.add(f"{mod}.{kind}#{shard}")
                return
        if name not in self.params:
            raise ValueError(f"{self.what} tensor {name} has no matching parameter")
        p = self.params[name]
        if p.shape != tensor.shape:
            raise ValueError(f"{name}: {self.what} shape {tuple(tensor.shape)} != {tuple(p.shape)}")
        p.data.copy_(tensor)
        self.loaded.add(name)

    def mark_loaded(self, name: str) -> None:
        """For parameters filled another way (tied or shared with another model)."""
        self.loaded.add(name)

    def check_complete(self) -> None:
        expected: set[str] = set()
        for mod_name, mod in self.model.named_modules():
            for pname, _ in mod.named_parameters(recurse=False):
                full = f"{mod_name}.{pname}"
                expected |= ({f"{full}#{s}" for s in mod.shard_offsets} if isinstance(mod, FusedLinear)
                             else {full})
        missing = sorted(expected - self.loaded)
        if missing:
            raise ValueError(f"{self.what} is missing tensors: {missing[:6]}{' ...' if len(missing) > 6 else ''}")
