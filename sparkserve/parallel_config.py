"""ParallelConfig: the rank layout the parallel flags (--tp-size, --pp-size, --nnodes, ...) give,
apart from ServerArgs so that the distributed layer reads it without the flags' validation."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelConfig:
    """How many ranks, and which of them run on this machine (distributed/parallel_state.py
    builds the groups from it)."""
    tp_size: int = 1
    pp_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    pp_layer_partition: tuple[int, ...] | None = None
    ep_size: int = 1
    dp_size: int = 1           # attention data-parallel groups inside the tp group (DP attention)
    attn_cp_size: int = 1      # ranks of an attention group that split long prefills by tokens
    socket_ifname: str | None = None   # --dist-socket-ifname: the interface the ranks talk over
    allow_public_bind: bool = False    # --dist-allow-public-bind
    moe_a2a_backend: str = "none"      # --moe-a2a-backend: a2a sends MoE tokens to their experts' ranks

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def group_size(self) -> int:
        """Ranks of one attention group (one scheduler): --tp-size / --dp-size."""
        return self.tp_size // self.dp_size

    @property
    def attn_tp_size(self) -> int:
        """Ranks that split an attention group's heads (1 under context parallel)."""
        return self.group_size // self.attn_cp_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def is_driver(self, rank: int) -> bool:
        """Whether `rank` runs a scheduler: rank 0, and with DP attention each group's first rank."""
        return rank % self.group_size == 0 if self.dp_size > 1 else rank == 0

    def local_ranks(self) -> list[int]:
        """Global ranks that run on this node (contiguous, as torchrun places them)."""
        n = self.ranks_per_node
        return list(range(self.node_rank * n, (self.node_rank + 1) * n))
