"""The vocabulary split over the tensor-parallel ranks (SGLang's VocabParallelEmbedding and
ParallelLMHead): each rank keeps its slice of the embedding and LM head rows (`vocab_shard`:
the vocab padded up to a multiple of --tp-size, padding rows zero). The embedding looks up the ids
of its slice, zeroes the others' rows and sums over the tp group; the LM head gives this rank's
slice of the logits (CausalLM.compute_logits gathers them on the driver). On one rank both are
the plain embedding and linear."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparkserve import kernels
from sparkserve.distributed import parallel_state as ps
from sparkserve.distributed.sharding import vocab_shard
from sparkserve.kernels import BlockWeight
from sparkserve.layers.block_backed import BlockBacked
from sparkserve.layers.linear import ACTIVATION_QUANTS, Linear
from sparkserve.layers.sharded import Sharded


def vocab_slice(tensor: torch.Tensor, blocks: BlockWeight | None, start: int, rows: int,
                real: int) -> tuple[torch.Tensor, BlockWeight | None]:
    """Rows [start, start + real) of a [vocab, ...] checkpoint tensor, zero-padded to `rows`; the
    block form only when no padding is added (blocks cannot hold the zero rows)."""
    part = tensor[start:start + real]
    if real < rows:
        part = torch.cat([part, part.new_zeros(rows - real, *part.shape[1:])])
        return part, None
    return part, None if blocks is None else blocks.rows(torch.arange(start, start + rows))


class VocabParallelEmbedding(Sharded, BlockBacked):
    """Served quantized ("int8"), the embedding looks its rows up in the checkpoint's blocks (the
    same values, dequantized per lookup: a few rows a step) and holds no fp32 table."""

    def __init__(self, vocab_size: int, hidden_size: int, scale: float = 1.0):
        """`scale`: what every looked-up row is multiplied by (Gemma's sqrt(hidden)), here so the
        forward, aux tap -1 and a draft sharing this embedding all see the model's values."""
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.scale = vocab_size, hidden_size, scale
        self.start, self.rows, self.real = vocab_shard(vocab_size)
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size), requires_grad=False)
        self.activation_quant = "none"

    def local_shard(self, tensor, blocks=None):
        if ps.tp_size() == 1:
            return tensor, blocks
        return vocab_slice(tensor, blocks, self.start, self.rows, self.real)

    def set_blocks(self, blocks: BlockWeight | None) -> None:
        if blocks is not None and tuple(blocks.shape) != tuple(self.weight.shape):
            raise ValueError(f"blocks {tuple(blocks.shape)} do not fit the embedding "
                             f"{tuple(self.weight.shape)}")
        self._blocks = blocks
        self.set_activation_quant(self.activation_quant)

    def set_activation_quant(self, mode: str) -> None:
        if mode not in ACTIVATION_QUANTS:
            raise ValueError(f"activation_quant {mode!r}: use one of {', '.join(ACTIVATION_QUANTS)}")
        self.activation_quant = mode
        self._hold_blocks_packed(mode == "int8")
        self._hold_dense(mode != "int8")

    def keeps_dense_with(self, blocks: BlockWeight | None) -> bool:
        return blocks is None or self.activation_quant != "int8"

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self._dense_dropped:
            return kernels.dequantize_rows(self._blocks, ids.reshape(-1)).view(*ids.shape, self.embedding_dim)
        return F.embedding(ids, self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ps.tp_size() == 1:
            x = self._lookup(ids)
        else:
            local = ids - self.start
            inside = (local >= 0) & (local < self.rows)
            x = self._lookup(torch.where(inside, local, 0))
            x = ps.all_reduce(x.masked_fill_(~inside.unsqueeze(-1), 0.0))
        return x if self.scale == 1.0 else x * self.scale


class ParallelLMHead(Linear):
    """This rank's slice of the LM head rows (and of its bias): its slice of the logits."""

    def __init__(self, hidden_size: int, vocab_size: int, bias: bool = False):
        self.vocab_size = vocab_size
        self.start, rows, self.real = vocab_shard(vocab_size)
        super().__init__(hidden_size, rows, bias)

    def local_shard(self, tensor, blocks=None):
        if ps.tp_size() == 1:
            return tensor, blocks
        return vocab_slice(tensor, blocks, self.start, self.out_features, self.real)
