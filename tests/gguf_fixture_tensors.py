"""How llama.cpp's convert_hf_to_gguf.py stores a test checkpoint's tensors, shared by the GGUF
fixture writers (family_fixtures, minimax_fixtures, minimax_m2_fixtures): the tensor type each gets
at an --outtype, and per-expert tensors stacked into one per layer and projection."""
from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Iterator

import gguf
import numpy as np

EXPERT_NAME = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight")


def checkpoint_arrays(hf_dir: str) -> Iterator[tuple[str, np.ndarray]]:
    """The test checkpoint's tensors as float32 arrays (what the converter reads)."""
    from safetensors.torch import load_file
    for name, t in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        yield name, t.float().numpy()


def tensor_adder(w: gguf.GGUFWriter, ftype: str,
                 keep_f32: Callable[[str, np.ndarray], bool]) -> Callable[[str, np.ndarray], None]:
    """add(gguf_name, array) at `ftype` (f32 / f16 / q8_0): F32 where keep_f32 says (norms, routers,
    biases: the converter's per-architecture list), F16 where Q8_0 cannot go (rows not a multiple of
    32, the converter's fallback), else Q8_0."""
    def add(gname: str, t: np.ndarray) -> None:
        if ftype == "f32" or keep_f32(gname, t):
            w.add_tensor(gname, t)
        elif ftype == "f16" or t.shape[-1] % 32:
            w.add_tensor(gname, t.astype(np.float16))
        else:
            q8 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(gname, gguf.quants.quantize(t, q8), raw_dtype=q8)
    return add


def stacked_experts(tensors: Iterable[tuple[str, np.ndarray]], n_experts: int,
                    names: dict[str, str]) -> Iterator[tuple[str, np.ndarray]]:
    """The checkpoint's (name, array) pairs with each layer's per-expert projections replaced by one
    stacked tensor, yielded under its GGUF name (`blk.L.<names[proj]>.weight`) once every expert is
    in, as the converter stacks them; other tensors pass through under their own names."""
    groups: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, t in tensors:
        m = EXPERT_NAME.fullmatch(name)
        if m is None:
            yield name, t
            continue
        group = groups.setdefault((m[1], names[m[3]]), {})
        group[int(m[2])] = t
        if len(group) == n_experts:
            yield f"blk.{m[1]}.{names[m[3]]}.weight", np.stack([group[e] for e in range(n_experts)])
