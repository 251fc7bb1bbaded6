"""The ranks of a scaled-out `train-draft` (torchrun sets RANK / WORLD_SIZE / MASTER_ADDR): each
rank distils and captures its contiguous share of the prompts, and trains on its share of every
global batch with gradients averaged over the ranks. One rank (no torchrun) is the same code
with every collective a no-op, so a run's numbers do not depend on how many ranks made them."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1

    @property
    def is_main(self) -> bool:
        """Rank 0 writes what is written once: merged data, checkpoints, logs."""
        return self.rank == 0

    def share(self, n: int) -> range:
        """This rank's contiguous part of n items; the parts in rank order are 0..n-1, so data
        concatenated by rank is in the order one rank would have made it."""
        return range(n * self.rank // self.world, n * (self.rank + 1) // self.world)

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """All-reduce (sum) in place over the ranks; returns t."""
        if self.world > 1:
            dist.all_reduce(t)
        return t

    def average_grads(self, params: list[torch.Tensor]) -> None:
        """Gradient all-reduce as DDP does it, in one flat bucket (the draft is small); a weight
        this rank's blocks did not reach counts as a zero gradient."""
        if self.world == 1:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        flat /= self.world
        i = 0
        for p in params:
            p.grad.copy_(flat[i:i + p.numel()].view_as(p))
            i += p.numel()

    def broadcast_(self, tensors: list[torch.Tensor]) -> None:
        """Rank 0's values everywhere (the starting weights, as DDP's constructor does)."""
        if self.world > 1:
            for t in tensors:
                dist.broadcast(t, 0)


def init_ranks() -> Ranks:
    """The ranks torchrun started (a process group over gloo: training runs on CPU tensors), or
    one rank when not launched by torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Ranks()
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return Ranks(dist.get_rank(), dist.get_world_size())


def close_ranks(ranks: Ranks, finished: bool) -> None:
    """A finished run waits for every rank before the group goes: gloo torn down under a peer
    still talking to it aborts that peer ("terminate called without an active exception"). A
    failed one does not wait (its peers may never come)."""
    if ranks.world > 1 and dist.is_initialized():
        if finished:
            dist.barrier()
        dist.destroy_process_group()
