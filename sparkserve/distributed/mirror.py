"""ForwardMirror: on the driver (global rank 0), hands each forward's batch to the other ranks
before running it, so every rank runs the same forward on its own shard of the weights and the
KV pool (the collectives inside need them all). Scheduling, sampling and the draft stay on the
driver: after each row-parallel layer the hidden state is summed on every rank, so the driver
holds full hidden rows, aux taps and logits."""
from __future__ import annotations

from sparkserve.core.forward_batch import ForwardBatch
from sparkserve.distributed import parallel_state as ps


class ForwardMirror:
    def forward(self, batch: ForwardBatch) -> None:
        ps.broadcast_object(batch.wire())

    def stop(self) -> None:
        """The other ranks leave their loop and exit."""
        ps.broadcast_object(None)
