"""The ranks of a scaled-out `train-draft` (torchrun sets RANK / WORLD_SIZE / MASTER_ADDR): each
rank distils and captures its contiguous share of the prompts, and trains on its share of every
global batch with gradients averaged over the ranks. One rank without torchrun is the same code
with every collective a no-op, so a run's numbers do not depend on how many ranks made them.

The ranks' device is where training runs (--device); their process group reduces there: gloo on
CPU, NCCL on CUDA (which takes CUDA tensors only, one GPU per rank)."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sparkserve.distributed.world import init_world
from sparkserve.training.config import DEVICES

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")
    # A process group exists (torchrun, even of one rank): the collectives run through it.
    group: bool = False

    @property
    def is_main(self) -> bool:
        """Rank 0 writes what is written once: merged data, checkpoints, logs."""
        return self.rank == 0

    def share(self, n: int) -> range:
        """This rank's contiguous part of n items; the parts in rank order are 0..n-1, so data
        concatenated by rank is in the order one rank would have made it."""
        return range(n * self.rank // self.world, n * (self.rank + 1) // self.world)

    def barrier(self) -> None:
        if self.group:
            dist.barrier()

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """All-reduce (sum) in place over the ranks; returns t (on the ranks' device)."""
        if self.group:
            dist.all_reduce(t)
        return t

    def average_grads(self, params: list[torch.Tensor]) -> None:
        """Gradient all-reduce as DDP does it, in one flat bucket (the draft is small); a weight
        this rank's blocks did not reach counts as a zero gradient."""
        if not self.group:
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
        if self.group:
            for t in tensors:
                dist.broadcast(t, 0)


def train_device(name: str) -> torch.device:
    """--device as this process's torch device: auto is cuda when torch sees a GPU for every rank
    on this node; a cuda rank takes GPU LOCAL_RANK (modulo the GPUs torch sees). A request this
    machine cannot run is a ValueError (a start-up error naming the flag), raised before any
    process group forms."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() and local <= torch.cuda.device_count() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if name != "cuda":
        raise ValueError(f"--device {name}: use one of {', '.join(DEVICES)}")
    if not torch.cuda.is_available():
        raise ValueError(f"--device cuda: torch {torch.__version__} sees no CUDA device (built for CUDA "
                         f"{torch.version.cuda or 'none'}, CUDA_VISIBLE_DEVICES="
                         f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); train with --device cpu "
                         "(or auto), or install a CUDA build of torch on a machine with a GPU")
    gpus = torch.cuda.device_count()
    if local > gpus:     # NCCL refuses two ranks on one GPU
        raise ValueError(f"--device cuda: {local} ranks on this node and {gpus} GPU(s); NCCL needs a GPU "
                         f"per rank: start at most {gpus} with --nproc-per-node, or use --device cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % gpus)


def init_ranks(device: torch.device = torch.device("cpu")) -> Ranks:
    """The ranks torchrun started, in a process group on `device`'s backend (gloo for CPU
    tensors, NCCL for CUDA ones), or one rank without a group when not launched by torchrun."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    launched = all(v in os.environ for v in _LAUNCH_VARS) or int(os.environ.get("WORLD_SIZE", "1")) > 1
    if not launched:
        return Ranks(device=device)
    if not dist.is_initialized():
        if device.type == "cuda":
            init_world("nccl", device_id=device)
        else:
            init_world("gloo")
    ranks = Ranks(dist.get_rank(), dist.get_world_size(), device, group=True)
    if ranks.is_main:
        print(f"train-draft: {ranks.world} rank(s), process group over {dist.get_backend()}, "
              f"training on {device.type}")
    return ranks


def close_ranks(ranks: Ranks, finished: bool) -> None:
    """A finished run waits for every rank before the group goes, so none leaves while a peer is
    still in a collective with it. A failed one does not wait (its peers may never come)."""
    if ranks.group and dist.is_initialized():
        if finished:
            dist.barrier()
        dist.destroy_process_group()
