"""ForwardMirror: on the driver (global rank 0), hands each forward's batch to the other ranks
before running it, so every rank runs the same forward on its own shard of the weights and the
KV pool. Scheduling, sampling and the draft stay on the driver.

Tensor parallel: after each row-parallel layer the hidden state is summed on every rank, so the
driver holds full hidden rows, aux taps and logits itself. Pipeline parallel: the driver is the
first stage; each stage sends the residual stream and the taps so far to the next
(`send_proxy`), and the last stage sends the final hidden rows and every tap back to the driver,
which computes the logits (it holds the LM head, and the draft's embedding)."""
from __future__ import annotations

import torch

from sparkserve.core.forward_batch import ForwardBatch, PPProxy
from sparkserve.distributed import parallel_state as ps


def taps_before(aux_ids: list[int], layer: int) -> int:
    """How many taps are captured before decoder layer `layer` runs (id l: after layer l)."""
    return sum(1 for i in aux_ids if i < layer)


def send_proxy(proxy: PPProxy, dst: int) -> None:
    ps.send(torch.stack([proxy.hidden, *proxy.aux]), dst)


def recv_proxy(num_tokens: int, hidden_size: int, num_aux: int, src: int) -> PPProxy:
    rows = ps.recv((num_aux + 1, num_tokens, hidden_size), src)
    return PPProxy(rows[0], list(rows[1:]))


class ForwardMirror:
    def __init__(self, hidden_size: int):
        self.hidden_size = hidden_size

    def forward(self, batch: ForwardBatch, aux_ids: list[int]) -> None:
        ps.broadcast_object(("forward", batch.wire(), list(aux_ids)))

    def finish(self, proxy: PPProxy, batch: ForwardBatch, aux_ids: list[int]) -> torch.Tensor:
        """Pipeline parallel: hand the first stage's output on; the final hidden rows and every
        tap come back from the last stage (its tensor-parallel rank 0)."""
        send_proxy(proxy, ps.stage_peer(1))
        last = recv_proxy(batch.num_tokens, self.hidden_size, len(aux_ids), ps.stage_peer(ps.pp_size() - 1))
        batch.aux_hidden = last.aux
        return last.hidden

    def commit(self, kept: list[int]) -> None:
        """After VERIFY: every rank commits its own recurrent state (ModelRunner.commit_verify)."""
        ps.broadcast_object(("commit", kept))

    def stop(self) -> None:
        """The other ranks leave their loop and exit."""
        ps.broadcast_object(None)
