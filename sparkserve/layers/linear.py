"""Linear layers that own how checkpoint tensors load into them, and how they run fast on CPU.

Fused projections (q|k|v, gate|up) cut the number of GEMV calls per decode step. `pack()`
reorders a weight into oneDNN's blocked layout once at load time, which runs fp32 GEMV and
small-M GEMM (verify, batched decode) faster than `F.linear`.

A layer loaded from GGUF blocks (Q4_0, Q4_1, Q8_0, Q6_S) or bf16 also keeps those blocks (`set_blocks`):
for up to QUANT_MAX_M rows (decode, batched decode, verify blocks) the C++ kernel in
sparkserve.kernels reads them directly — 5-6x fewer bytes than fp32 for Q4_1 — and computes
in fp32 on exactly the dequantized values. Larger M (prefill) and anything with autograd keep
the fp32 weight (oneDNN).

`set_activation_quant("int8")` (the engine's default --activation-quant, applied by load_model) lets layers
with quantized blocks quantize x to int8 per block of 32 and use integer dot products (llama.cpp's scheme)
at every M the block kernel takes (every M at all where the int8 variant is faster than oneDNN
at prefill sizes, `kernels.int8_beats_gemm()`); "none" (the default of a bare Linear) keeps the
fp32-exact kernel. Int8 is used for all those M, not only where it is fastest: a row's int8
result is then bit-identical whatever the batch (decode, batched decode, a verify block), so
speculative verify agrees with plain decode and a decode row does not depend on how many others
run with it (docs/kernel-notes.md).

A layer whose every row count goes to the int8 kernel never reads its fp32 weight, so it lets it
go; under int8 its blocks are held in the int8 kernels' layout, not in GGUF order (BlockBacked;
switching back to "none" restores both)."""
from __future__ import annotations

import torch
from torch import nn

from sparkserve import kernels
from sparkserve.distributed import parallel_state as ps
from sparkserve.distributed.sharding import shard_rows
from sparkserve.kernels import BlockWeight
from sparkserve.layers.block_backed import BlockBacked
from sparkserve.layers.sharded import Sharded

# Most rows that go to the block kernel rather than oneDNN fp32 (the kernel does the same fp32
# FMAs plus the block expansion; oneDNN reads 4-6x more bytes). From 8 rows the kernel expands each
# panel of weights once into L1 and runs a 4x3 register-blocked micro-kernel on it (quant_gemv.cpp).
# The cut-offs are where the kernel stops beating oneDNN (docs/kernel-notes.md has the measurements).
QUANT_MAX_M = 96
QUANT_MAX_M_WIDE_K = 64        # in_features > 1024

ACTIVATION_QUANTS = ("int8", "none")
ALL_ROWS = 1 << 62             # an M limit that takes every row count


def _version(t: torch.Tensor) -> int:
    """In-place update counter; inference tensors (made under inference_mode) have none."""
    return -1 if t.is_inference() else t._version


def _mkldnn_ok() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class Linear(Sharded, BlockBacked):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self._packed: torch.Tensor | None = None
        self._packed_version = 0
        self._pack_wanted = False
        self._blocks: BlockWeight | None = None
        self._block_fn = None
        self._blocks_version = 0
        self._max_m = 0
        self.activation_quant = "none"
        self._int8_fn = None
        self._int8_max_m = 0

    def set_blocks(self, blocks: BlockWeight | None) -> None:
        """Keep the checkpoint's block form of `weight` (same values) for the small-M kernel;
        dropped when the kernels are unavailable. The caller guarantees weight == blocks."""
        if blocks is not None and tuple(blocks.shape) != (self.out_features, self.in_features):
            raise ValueError(f"blocks {tuple(blocks.shape)} do not fit Linear "
                             f"[{self.out_features}, {self.in_features}]")
        ext = kernels.load_extension() if blocks is not None else None
        self._blocks = blocks if ext is not None else None
        self._block_fn = ext.quant_linear if ext is not None else None
        self._blocks_version = _version(self.weight)   # an in-place update of weight drops them
        self._max_m = QUANT_MAX_M if self.in_features <= 1024 else QUANT_MAX_M_WIDE_K
        self._int8_fn = ext.quant_linear_int8 if ext is not None else None
        self.set_activation_quant(self.activation_quant)

    def set_activation_quant(self, mode: str) -> None:
        """"int8": x quantized to int8 per block of 32 when the int8 kernels read the blocks (small logit
        changes, faster at decode sizes); "none": fp32 activations, exact."""
        if mode not in ACTIVATION_QUANTS:
            raise ValueError(f"activation_quant {mode!r}: use one of {', '.join(ACTIVATION_QUANTS)}")
        self.activation_quant = mode
        self._int8_max_m = self._int8_rows(mode, self._blocks)
        self._hold_blocks_packed(self._int8_max_m > 0)     # the fp32 block kernel reads GGUF order
        if self._hold_dense(self._int8_max_m < ALL_ROWS):        # the fp32 weight only if read
            self._blocks_version = _version(self.weight)
        if self._pack_wanted:
            self.pack()

    def _int8_rows(self, mode: str, blocks: BlockWeight | None) -> int:
        """The most rows int8 activations take with these blocks under `mode`. An int8 variant that
        beats oneDNN's fp32 GEMM at prefill sizes too takes every row count (docs/kernel-notes.md);
        the others stop where the block kernel does."""
        if mode != "int8" or blocks is None or blocks.gguf_type not in kernels.INT8_TYPES:
            return 0
        return ALL_ROWS if kernels.int8_beats_gemm() else self._max_m

    @staticmethod
    def reads_only_blocks(blocks: BlockWeight, mode: str) -> bool:
        """Whether a Linear with these blocks under `mode` would never read an fp32 weight."""
        return (mode == "int8" and kernels.load_extension() is not None
                and blocks.gguf_type in kernels.INT8_TYPES and kernels.int8_beats_gemm())

    @classmethod
    def from_blocks(cls, blocks: BlockWeight, mode: str) -> "Linear":
        """A Linear that holds `blocks` only (no fp32 weight; `dense_weight()` rebuilds one for a
        rare reader), served under activation mode `mode`."""
        with torch.device("meta"):
            lin = cls(blocks.in_features, blocks.out_features)
        lin._dense_dropped = True
        lin.activation_quant = mode
        lin.set_blocks(blocks)
        return lin

    def keeps_dense_with(self, blocks: BlockWeight | None) -> bool:
        return blocks is None or kernels.load_extension() is None or \
            self._int8_rows(self.activation_quant, blocks) < ALL_ROWS

    def _blocks_hold_weight(self) -> bool:
        return self.inference_blocks() is not None

    def inference_blocks(self) -> BlockWeight | None:
        """The block form of `weight` while it still holds the same values (for kernels that
        read the blocks themselves: the native forward step), else None."""
        if self._blocks is not None and _version(self.weight) == self._blocks_version:
            return self._blocks
        return None

    def pack(self) -> None:
        """Keep a oneDNN-packed copy of the weight for inference (CPU fp32 only): the row counts the
        block kernels leave run on it. None while int8 activations take every row count: it would
        go unread and hold as much memory as the weight (set_activation_quant packs on a switch)."""
        self._pack_wanted = True
        if self._int8_max_m >= ALL_ROWS:
            self._packed = None
            return
        w = self.weight
        if self._packed is None and _mkldnn_ok() and w.device.type == "cpu" and w.dtype == torch.float32:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
            self._packed_version = _version(self.weight)   # like the blocks: stale once trained

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dim() == 2 and not torch.is_grad_enabled():
            b, m = self._blocks, x.shape[0]
            if b is not None and (m <= self._max_m or m <= self._int8_max_m) and x.dtype == torch.float32:
                if _version(self.weight) == self._blocks_version:
                    fn = self._int8_fn if m <= self._int8_max_m else self._block_fn
                    return fn(x, b.blocks, b.qtype, bias)
                self._blocks = None                         # weight was trained / overwritten
                self._int8_max_m = 0
            if self._packed is not None:
                if _version(self.weight) == self._packed_version:
                    return torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [], "")
                self._packed = None
        return torch.nn.functional.linear(x, self.dense_weight(), bias)


class RowParallelLinear(Linear):
    """in_features split over the tensor-parallel ranks: each multiplies its slice of the input
    by its slice of the columns, the partial outputs are summed (all-reduce), and the bias is
    added once, after the sum. `part` (index, parts): which slice, when not the rank's tp slice
    (replicated heads); `reduce=False` returns the partial output, for a caller that sums several
    partials with one all-reduce (attention + index value, routed + shared experts)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 part: tuple[int, int] | None = None, reduce: bool = True):
        self.index, self.parts = part or (ps.tp_rank(), ps.tp_size())
        self.group = ps.layer_group()
        self.reduce = reduce and ps.tp_size() > 1
        if bias and not reduce and ps.tp_size() > 1:
            raise ValueError("a RowParallelLinear that leaves the sum to its caller takes no bias")
        super().__init__(in_features // self.parts, out_features, bias)

    def local_shard(self, tensor, blocks):
        if self.parts == 1 or tensor.dim() == 1:
            return tensor, blocks
        k0, k1 = self.index * self.in_features, (self.index + 1) * self.in_features
        return tensor[:, k0:k1], None if blocks is None else blocks.cols(k0, k1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.reduce:
            return self._matmul(x, self.bias)
        y = ps.all_reduce(self._matmul(x, None), self.group)
        return y if self.bias is None else y + self.bias


class ColumnParallelLinear(Linear):
    """out_features split over the tensor-parallel ranks (heads, MLP width): this rank keeps part
    `index` of `parts` of the checkpoint's rows, of each of `stacks` equal row blocks when one
    tensor stacks several projections (gate|up), so its output is its slice of the full one."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 part: tuple[int, int] | None = None, stacks: int = 1):
        self.index, self.parts = part or (ps.tp_rank(), ps.tp_size())
        self.stacks = stacks
        super().__init__(in_features, out_features // self.parts, bias)

    def local_shard(self, tensor, blocks):
        if self.parts == 1:
            return tensor, blocks
        rows = shard_rows(tensor.shape[0], self.index, self.parts, self.stacks)
        return tensor[rows], None if blocks is None else blocks.rows(rows)


class FusedLinear(Linear):
    """One weight holding several stacked projections; `load(shard, w)` fills one of them."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False,
                 tp_parts: dict[str, tuple[int, int]] | None = None):
        """`shard_sizes`: this rank's rows of each projection; `tp_parts`: (index, parts) of the
        checkpoint rows it keeps (column parallel), whole tensors when None."""
        self.tp_parts = tp_parts or {}
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        off = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (off, size)
            off += size
        super().__init__(in_features, off, bias)
        self._shard_blocks: dict[str, BlockWeight | None] = {}

    def load(self, shard: str, tensor: torch.Tensor, kind: str = "weight",
             blocks: BlockWeight | None = None) -> None:
        """A meta `tensor` (a GGUF tensor not read yet, loader/weights.py) takes its values from
        `blocks`, and only once every shard is in and the fused weight turns out to keep them."""
        start, size = self.shard_offsets[shard]
        target = self.weight if kind == "weight" else self.bias
        index, parts = self.tp_parts.get(shard, (0, 1))
        if parts > 1:
            rows = tensor.shape[0] // parts
            tensor = tensor[index * rows:(index + 1) * rows]
            blocks = None if blocks is None else blocks.rows(torch.arange(index * rows, (index + 1) * rows))
        if tensor.shape[0] != size:
            raise ValueError(f"shard {shard} {kind}: expected {size} rows, got {tuple(tensor.shape)}")
        if not tensor.is_meta:
            target.data[start:start + size].copy_(tensor)
        elif kind != "weight" or blocks is None:
            raise ValueError(f"shard {shard} {kind}: a tensor without values or blocks")
        if kind == "weight":
            # The fused block weight is the row concatenation of the shards' blocks: kept only
            # when every shard came with blocks of one format.
            self._shard_blocks[shard] = (blocks, tensor.is_meta)
            if self._shard_blocks.keys() == self.shard_offsets.keys():
                fused = BlockWeight.cat([self._shard_blocks[s][0] for s in self.shard_offsets])
                if self.keeps_dense_with(fused):
                    for s, (b, unread) in self._shard_blocks.items():
                        if unread:
                            off, n = self.shard_offsets[s]
                            self.weight.data[off:off + n].copy_(b.dequantize())
                self.set_blocks(fused)
                self._shard_blocks = {}
            else:
                self._blocks = None


def pack_linears(model: nn.Module) -> None:
    """Prepare a loaded model for inference: oneDNN-packed weights, and the C++ kernels built
    now (the norms use them too) rather than on the first request."""
    kernels.load_extension()
    for m in model.modules():
        if isinstance(m, Linear):
            m.pack()
