"""Context parallel for attention (--attn-cp-size C): a long prefill is split by tokens over the C
ranks of its attention group, so its attention and MLP work divide C ways.

Zigzag layout (as SGLang / Ring-Attention load balancing): a request's new tokens are cut into 2C
blocks and rank r runs blocks r and 2C-1-r, so every rank gets one early (cheap: few keys before
it) and one late (costly) block. A request shorter than 2C tokens is not cut: it runs whole on one
rank (requests taken round robin); a batch splits only when one of its requests is that long and
every rank gets a token (decode and VERIFY batches never split: each rank runs them whole).

Each rank runs its tokens through the layers. Attention needs every earlier key: a layer's
new K/V (MLA latent, index K/V) rows are gathered from all C ranks and every rank stores all of them
(ForwardBatch.store), then attends its own queries under the causal mask of their positions, so
decode later reads the whole sequence on any rank. A recurrent layer (Kimi's KDA) needs the state
after every earlier token instead: `run_in_sequence` runs the blocks in sequence order, each on its
rank, the request-row state (recurrent state and conv window) sent on from the rank of block b to
the rank of block b + 1 (0, 1, .., C-1, C-1, .., 0: rank C-1 runs two blocks in a row), and at the
end each request's state is broadcast from the rank that ran its last block, so every rank decodes
from it. The MLP runs over every rank's tokens together (layers/dp_attention.py). At the end the
final rows and the aux taps are gathered back into the batch's order, so the driver samples,
returns hidden states and feeds the DSpark draft exactly as without CP (the draft's KV is made
from taps in sequence order)."""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from sparkserve.core.forward_batch import ForwardBatch, ForwardMode
from sparkserve.distributed import parallel_state as ps

# layer(x rows, batch of those rows) -> output rows: a recurrent layer keeping request-row state
Recurrent = Callable[[torch.Tensor, ForwardBatch], torch.Tensor]


def cut_blocks(n: int, parts: int) -> list[range]:
    """range(n) cut into 2 * parts near-equal blocks, in order."""
    k = 2 * parts
    sizes = [n // k + (i < n % k) for i in range(k)]
    starts = [sum(sizes[:i]) for i in range(k)]
    return [range(a, a + s) for a, s in zip(starts, sizes)]


def zigzag_blocks(n: int, parts: int) -> list[list[range]]:
    """For each of `parts` ranks, its two of 2 * parts near-equal blocks of range(n): r, 2P-1-r."""
    blocks = cut_blocks(n, parts)
    return [[blocks[r], blocks[2 * parts - 1 - r]] for r in range(parts)]


def owned_rows(extend_lens: list[int], parts: int) -> list[torch.Tensor] | None:
    """Each rank's flat rows of a batch with these new-token counts (ascending), or None when the
    batch runs whole on every rank: no request of at least 2 * parts tokens, or a rank left empty."""
    if parts == 1 or max(extend_lens, default=0) < 2 * parts:
        return None
    rows: list[list[int]] = [[] for _ in range(parts)]
    start, short = 0, 0
    for n in extend_lens:
        if n >= 2 * parts:
            for r, blocks in enumerate(zigzag_blocks(n, parts)):
                rows[r] += [start + i for b in blocks for i in b]
        else:
            rows[_whole_owner(short, parts)] += range(start, start + n)
            short += 1
        start += n
    if not all(rows):
        return None
    return [torch.tensor(sorted(r), dtype=torch.long) for r in rows]


class ContextShard:
    """This rank's share of `full` (see the module docstring); the TokenShard of its batch."""

    def __init__(self, full: ForwardBatch, rows: list[torch.Tensor]):
        self.full = full
        self.rows = rows
        self.counts = [len(r) for r in rows]
        self.order = torch.cat(rows)
        self.size = len(rows)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty(self.full.num_tokens, *x.shape[1:])
        out[self.order] = cp_gather(x, self.counts)
        return out

    def mine(self, x: torch.Tensor) -> torch.Tensor:
        return x[self.rows[cp_rank()]]

    def batch(self) -> ForwardBatch:
        """The batch of this rank's tokens."""
        return subset(self.full, self.rows[cp_rank()], self)

    def run_in_sequence(self, layer: Recurrent, x: torch.Tensor, state: list[torch.Tensor]) -> torch.Tensor:
        """`layer` over this rank's rows x, the recurrence carried across the ranks in sequence
        order (module docstring); `state`: the layer's request-row pool buffers."""
        full, me, C = self.full, cp_rank(), self.size
        mine = self.rows[me]
        out: torch.Tensor | None = None
        starts = [0] + list(torch.tensor(full.extend_lens).cumsum(0).tolist())
        cut = [i for i, n in enumerate(full.extend_lens) if n >= 2 * C]
        whole = [i for i in range(full.batch_size) if i not in cut]
        owner = {i: _whole_owner(k, C) for k, i in enumerate(whole)}      # the rank of an uncut one
        cut_rows = full.req_rows[cut]

        def run(flat: torch.Tensor) -> None:
            nonlocal out
            at = torch.searchsorted(mine, flat)
            y = layer(x[at], subset(full, flat))
            out = y.new_zeros(x.shape[0], *y.shape[1:]) if out is None else out
            out[at] = y

        def blocks(b: int) -> torch.Tensor:
            return torch.tensor([starts[i] + t for i in cut for t in cut_blocks(full.extend_lens[i], C)[b]],
                                dtype=torch.long)

        owned = [i for i in whole if owner[i] == me]
        if owned:
            run(torch.tensor([t for i in owned for t in range(starts[i], starts[i + 1])], dtype=torch.long))
        order = [b if b < C else 2 * C - 1 - b for b in range(2 * C)]    # the rank of block b
        for b in (range(2 * C) if cut else ()):
            if order[b] != me:
                continue
            if b > 0 and order[b - 1] != me:
                for buf in state:
                    buf[cut_rows] = ps.recv(tuple(buf[cut_rows].shape), cp_peer(order[b - 1]))
            run(blocks(b))
            if b < 2 * C - 1 and order[b + 1] != me:
                for buf in state:
                    ps.PendingSend(buf[cut_rows], cp_peer(order[b + 1])).wait()
        for r in range(C):           # each request's state from the rank of its last block
            last = [full.req_rows[i] for i in whole if owner[i] == r]
            rows = torch.stack(last) if last else cut_rows[:0]
            if r == 0:
                rows = torch.cat([rows, cut_rows])
            if not len(rows):        # the same on every rank: the plan is
                continue
            for buf in state:
                buf[rows] = cp_broadcast(buf[rows].contiguous(), r)
        return out


def _whole_owner(k: int, parts: int) -> int:
    """The rank that runs the k-th uncut request of a batch (round robin)."""
    return k % parts


def subset(full: ForwardBatch, rows: torch.Tensor, cp: ContextShard | None = None) -> ForwardBatch:
    """The requests of `full` that have some of the flat `rows` (ascending), with only those
    tokens' ids, positions and slots; keys as in the full batch."""
    starts = torch.tensor([0] + full.extend_lens[:-1]).cumsum(0)
    req = torch.searchsorted(starts, rows, right=True) - 1          # request of each row
    lens = torch.bincount(req, minlength=full.batch_size)
    keep = (lens > 0).nonzero().flatten()
    seq = [full.seq_lens[i] for i in keep.tolist()]
    swa = {}
    if full.swa_kv_indices is not None:
        swa = dict(swa_out_cache_loc=full.swa_out_cache_loc[rows], swa_kv_start=full.swa_kv_start,
                   swa_kv_indices=full.swa_kv_indices[keep, :max(seq) - full.swa_kv_start])
    return ForwardBatch(ForwardMode.EXTEND, full.input_ids[rows], full.positions[rows],
                        full.out_cache_loc[rows], lens[keep].tolist(), seq,
                        full.kv_indices[keep, :max(seq) - full.kv_start], full.kv_pool,
                        req_rows=None if full.req_rows is None else full.req_rows[keep],
                        kv_start=full.kv_start, cp=cp, **swa)


def shard(full: ForwardBatch) -> ForwardBatch | None:
    """This rank's share of a prefill under context parallel, or None when it runs whole."""
    if cp_size() == 1 or full.mode != ForwardMode.EXTEND:
        return None
    rows = owned_rows(full.extend_lens, cp_size())
    return None if rows is None else ContextShard(full, rows).batch()


# ---- the cp group (this rank's attention group under CP) -------------------------------------------
def cp_rank() -> int:
    return ps.group_of("cp").rank


def cp_size() -> int:
    return ps.group_of("cp").size


def cp_peer(index: int) -> int:
    """The global rank of cp rank `index` of this rank's group."""
    return ps.group_of("cp").ranks[index]


def cp_broadcast(x: torch.Tensor, index: int) -> torch.Tensor:
    """cp rank `index`'s x on every rank of the cp group (in place)."""
    cp = ps.group_of("cp")
    if index == cp.rank:
        ps.count_sent(x.numel() * x.element_size())
    dist.broadcast(x, cp.ranks[index], group=cp.handle)
    return x


def cp_gather(x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Every cp rank's rows of x (counts[r] each), concatenated in cp-rank order."""
    return ps.gather_rows(x, counts, ps.group_of("cp"))
