"""A GGUF's MLA kv_b as llama.cpp's converter writes it (DeepSeek-V2, Kimi-Linear): split per head
into `k_b_proj` [heads, kv_lora_rank, nope] (W_uk transposed) and `v_b_proj` [heads, v,
kv_lora_rank]; loader/gguf.py gives them as [heads * rows, k] (rows per head). Where both come as
blocks the kernels read, the layer's AbsorbedKvB holds them as they are (layers/mla.py), as llama.cpp
does; else kv_b_proj.weight loads as their fp32 join [heads * (nope + v), kv_lora_rank], the
checkpoint's own kv_b_proj."""
from __future__ import annotations

import re

import torch

from sparkserve.layers.mla import AbsorbedKvB
from sparkserve.loader.weights import WeightLoader, blocks_of, values_of


class SplitKvB:
    _HALF = re.compile(r"(.*\.self_attn\.)(k|v)_b_proj\.weight")

    def __init__(self, kv_lora_rank: int, modules: dict[str, torch.nn.Module], loader: WeightLoader):
        """`modules`: the model's named modules; `loader`: told when a layer holds its halves."""
        self.kv_lora_rank = kv_lora_rank
        self.modules, self.loader = modules, loader
        self._halves: dict[str, dict[str, torch.Tensor]] = {}

    def is_half(self, name: str) -> bool:
        return self._HALF.fullmatch(name) is not None

    def add(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """(kv_b_proj's name, the joined weight) for the caller to load once a layer's two halves are
        in; None while one is missing or once the layer holds their blocks."""
        m = self._HALF.fullmatch(name)
        halves = self._halves.setdefault(m[1], {})
        halves[m[2]] = tensor
        if len(halves) < 2:
            return None
        del self._halves[m[1]]
        k, v = halves["k"], halves["v"]
        k_b, v_b = blocks_of(k), blocks_of(v)
        owner = self.modules[f"{m[1]}kv_b_proj"]
        if k_b is not None and v_b is not None and isinstance(owner, AbsorbedKvB):
            owner.hold_halves(k_b, v_b)
            self.loader.mark_loaded(f"{m[1]}kv_b_proj.weight")
            return None
        k = values_of(k).reshape(-1, self.kv_lora_rank, k.shape[-1])       # rows per head, or by head
        joined = torch.cat([k.transpose(1, 2), values_of(v).reshape(k.shape[0], -1, self.kv_lora_rank)], 1)
        return f"{m[1]}kv_b_proj.weight", joined.reshape(-1, self.kv_lora_rank)
