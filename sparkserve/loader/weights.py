"""WeightLoader: put checkpoint tensors (HF names) into a model whose projections may be fused
(q|k|v, gate|up), and check at the end that every parameter — every shard of a fused one —
was filled. Shared by the target models and the DSpark draft. Under tensor or expert
parallelism a module that keeps only part of a tensor says which (`local_shard`).

A checkpoint tensor may carry its block form (`with_blocks`, set by the GGUF loader): the loader
hands those blocks to the module that receives the tensor (a Linear, the embedding), which then
computes from them (sparkserve.kernels) and may let its fp32 copy go. Such a tensor may also come
unread, a meta tensor of its shape (`values_of` dequantizes it): its values are computed only for
a module that keeps an fp32 weight, so a model served with int8 activations is never dequantized
whole while it loads."""
from __future__ import annotations

import torch
from torch import nn

from sparkserve.kernels.blocks import BlockWeight
from sparkserve.layers.block_backed import BlockBacked
from sparkserve.layers.linear import FusedLinear
from sparkserve.layers.sharded import Sharded
from sparkserve.layers.vocab_parallel import VocabParallelEmbedding

_BLOCKS_ATTR = "_sparkserve_blocks"


def with_blocks(tensor: torch.Tensor, blocks: BlockWeight | None) -> torch.Tensor:
    """Mark `tensor` (fp32, the dequantized weight) as coming from `blocks`; returns it."""
    if blocks is not None:
        setattr(tensor, _BLOCKS_ATTR, blocks)
    return tensor


def blocks_of(tensor: torch.Tensor) -> BlockWeight | None:
    return getattr(tensor, _BLOCKS_ATTR, None)


def values_of(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's values: an unread one (meta, with blocks) dequantized from its blocks."""
    if not tensor.is_meta:
        return tensor
    blocks = blocks_of(tensor)
    if blocks is None:
        raise ValueError("a checkpoint tensor came without values or blocks")
    return blocks.dequantize()


def split_rows(tensor: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """A checkpoint tensor cut into consecutive row ranges, each with its blocks' rows (a fused
    q|k|v or gate|up tensor fed to a FusedLinear part by part); an unread one stays unread."""
    blocks, parts, start = blocks_of(tensor), [], 0
    for n in sizes:
        part = (torch.empty(n, *tensor.shape[1:], device="meta") if tensor.is_meta
                else tensor[start:start + n])
        rows = None if blocks is None else blocks.rows(torch.arange(start, start + n))
        parts.append(with_blocks(part, rows))
        start += n
    if start != tensor.shape[0]:
        raise ValueError(f"a fused checkpoint tensor has {tensor.shape[0]} rows, its parts {start}")
    return parts


class WeightLoader:
    def __init__(self, model: nn.Module, stacked: dict[str, tuple[str, str]], what: str = "checkpoint"):
        """stacked: checkpoint name fragment -> (fused module fragment, shard name)."""
        self.model = model
        self.stacked = stacked
        self.what = what
        # names only: a layer may swap its parameter for a stand-in once loaded (BlockBacked),
        # and a reference kept here would hold every dropped fp32 weight until the load ends
        self.param_names = {name for name, _ in model.named_parameters()}
        self.modules = dict(model.named_modules())
        self.loaded: set[str] = set()
        self.blocks: dict[str, BlockWeight] = {}     # embedding name -> its checkpoint blocks
        self.unread: set[str] = set()     # parameters whose module needed no values from the blocks

    def load(self, name: str, tensor: torch.Tensor) -> None:
        blocks = blocks_of(tensor)
        for frag, (fused, shard) in self.stacked.items():
            if frag in name:
                mod, kind = name.replace(frag, fused).rsplit(".", 1)
                target = self.modules[mod]
                if isinstance(target, FusedLinear):
                    target.load(shard, tensor, kind, blocks=blocks)
                else:                        # other stacked modules (e.g. MoE experts)
                    target.load(shard, values_of(tensor), kind)
                self.loaded.add(f"{mod}.{kind}#{shard}")
                return
        if name not in self.param_names:
            raise ValueError(f"{self.what} tensor {name} has no matching parameter")
        owner_name, pname = name.rsplit(".", 1) if "." in name else ("", name)
        owner = self.modules[owner_name]
        whole = tensor
        if tensor.is_meta and not (isinstance(owner, BlockBacked) and pname == "weight"):
            tensor = values_of(tensor)
        if isinstance(owner, Sharded):     # a module split over the ranks keeps its part only
            tensor, blocks = owner.local_shard(tensor, blocks)
            if tensor.is_meta and blocks is None:     # the part has no block form (vocab padding)
                tensor, blocks = owner.local_shard(values_of(whole), blocks_of(whole))
        p = getattr(owner, pname)
        if p.shape != tensor.shape:
            raise ValueError(f"{name}: {self.what} shape {tuple(tensor.shape)} != {tuple(p.shape)}")
        if not tensor.is_meta:
            p.data.copy_(tensor)
        elif owner.keeps_dense_with(blocks):
            p.data.copy_(blocks.dequantize())
        else:
            self.unread.add(name)
        self.loaded.add(name)
        self._give_blocks(name, blocks)
        if blocks is not None and isinstance(owner, (nn.Embedding, VocabParallelEmbedding)):
            # for an LM head tied to it (mark_loaded): the form the embedding holds, not a second one
            self.blocks[name] = owner.held_blocks if isinstance(owner, BlockBacked) else blocks

    def mark_loaded(self, name: str, tied_to: str | None = None) -> None:
        """For parameters filled another way (tied or shared with another model). `tied_to`:
        the loaded parameter it is tied to, whose checkpoint blocks it then shares."""
        self.loaded.add(name)
        if tied_to is None:
            return
        blocks = self.blocks.get(tied_to)
        mod_name, kind = name.rsplit(".", 1) if "." in name else ("", name)
        mod = self.modules.get(mod_name)
        # the shared parameter got no values if its first module needed none: this one may
        if tied_to in self.unread and isinstance(mod, BlockBacked) and mod.keeps_dense_with(blocks):
            getattr(mod, kind).data.copy_(blocks.dequantize())
        self._give_blocks(name, blocks)

    def _give_blocks(self, name: str, blocks: BlockWeight | None) -> None:
        mod_name, kind = name.rsplit(".", 1) if "." in name else ("", name)
        mod = self.modules.get(mod_name)
        if kind == "weight" and isinstance(mod, BlockBacked):
            mod.set_blocks(blocks)

    def check_complete(self) -> None:
        expected: set[str] = set()
        for mod_name, mod in self.model.named_modules():
            for pname, _ in mod.named_parameters(recurse=False):
                full = f"{mod_name}.{pname}"
                expected |= ({f"{full}#{s}" for s in mod.shard_offsets} if isinstance(mod, FusedLinear)
                             else {full})
        missing = sorted(expected - self.loaded)
        if missing:
            raise ValueError(f"{self.what} is missing tensors: "
                             f"{missing[:6]}{' ...' if len(missing) > 6 else ''}")
