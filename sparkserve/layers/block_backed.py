"""BlockBacked: a module whose fp32 `weight` came from checkpoint blocks (quantized GGUF, half
types) that it keeps beside it. Served quantized (--activation-quant int8), such a module reads
the blocks only, so the fp32 copy can go: a meta tensor of the same shape stands in for it, and
`dense_weight()` rebuilds the values for the rare reader (a draft copying the target's LM head,
autograd). The blocks themselves are then held in the layout the int8 kernels read, in place of the
GGUF order. The model's weights are held once, as llama.cpp holds them, not also in fp32."""
from __future__ import annotations

import torch
from torch import nn

from sparkserve.kernels import BlockWeight
from sparkserve.mem.huge_pages import move_into_huge_pages


class BlockBacked(nn.Module):
    weight: nn.Parameter
    _blocks: BlockWeight | None = None
    _dense_dropped = False

    def set_blocks(self, blocks: BlockWeight | None) -> None:
        """Keep the checkpoint's block form of `weight` (the same values: the caller guarantees it)."""
        raise NotImplementedError

    def set_activation_quant(self, mode: str) -> None:
        raise NotImplementedError

    def keeps_dense_with(self, blocks: BlockWeight | None) -> bool:
        """Whether, given these blocks, the module would hold its fp32 weight under its mode: if
        not, the loader need not compute the values (a GGUF tensor is then never dequantized)."""
        raise NotImplementedError

    @property
    def held_blocks(self) -> BlockWeight | None:
        """The blocks in the form held now (packed under int8 where the kernels read that)."""
        return self._blocks

    def _blocks_hold_weight(self) -> bool:
        """Whether the blocks still hold `weight`'s values (not once it is trained or overwritten)."""
        return self._blocks is not None

    def _hold_blocks_packed(self, packed: bool) -> None:
        """Hold the blocks in the int8 kernels' layout (where they read one, BlockWeight.packed) or
        in GGUF order: one form at a time, so the weights are not held twice."""
        if self._blocks is not None:
            self._blocks = (self._blocks.packed() or self._blocks) if packed else self._blocks.unpacked()

    def _hold_dense(self, keep: bool) -> bool:
        """Drop the fp32 weight or bring it back from the blocks; whether it changed."""
        if keep and self._dense_dropped:        # one Parameter again for modules tied by their blocks
            self.weight = self._blocks.dense_shared(lambda w: nn.Parameter(w, requires_grad=False))
        elif not keep and not self._dense_dropped and self._blocks_hold_weight():
            self.weight = nn.Parameter(torch.empty(self.weight.shape, device="meta"), requires_grad=False)
        else:
            return False
        self._dense_dropped = not keep
        return True

    def dense_weight(self) -> torch.Tensor:
        """The fp32 weight, also while it is dropped (then made anew from the blocks)."""
        return self._blocks.dequantize() if self._dense_dropped else self.weight


class ServesActivationQuant(nn.Module):
    """A module that is not block-backed itself but builds block-backed ones as its weights load
    (a MoE's experts), so it must know the mode they serve."""

    def set_activation_quant(self, mode: str) -> None:
        raise NotImplementedError


def set_activation_quant(model: nn.Module, mode: str) -> None:
    """Every block-backed module of `model` (Linear layers, the embedding) serves `mode`: "int8"
    or "none" (see Linear)."""
    for m in model.modules():
        if isinstance(m, (BlockBacked, ServesActivationQuant)):
            m.set_activation_quant(mode)


def drop_blocks(model: nn.Module) -> None:
    """Every block-backed module keeps its fp32 weight only (for devices whose kernels read
    nothing else); the fp32 values come back from the blocks first where they were dropped."""
    for m in model.modules():
        if isinstance(m, BlockBacked):
            m.set_activation_quant("none")
            m.set_blocks(None)


def hold_weights_in_huge_pages(*roots: nn.Module) -> int:
    """What a forward of the modules under `roots` streams moves into 2 MiB huge pages
    (mem/huge_pages.py): the blocks each block-backed module holds (its forward reads those, and
    its `weight` must stay put, since moving it would count as an update that makes the blocks
    stale), and the parameters of every other module (norms, stacked experts, convolutions).
    Returns the bytes moved."""
    tensors: dict[int, torch.Tensor] = {}
    for root in roots:
        for m in root.modules():
            if isinstance(m, BlockBacked):
                own = [] if m.held_blocks is None else [m.held_blocks.blocks]
            else:
                own = [p for p in m.parameters(recurse=False) if not p.is_meta]
            tensors.update((id(t), t) for t in own)
    return move_into_huge_pages(tensors.values())
