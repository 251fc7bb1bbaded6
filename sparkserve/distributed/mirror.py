"""ForwardMirror: on the driver (global rank 0), hands each forward's batch to the other ranks
before running it, so every rank runs the same forward on its own shard of the weights and the
KV pool. Scheduling, sampling and the draft stay on the driver.

Tensor parallel: after each row-parallel layer the hidden state is summed on every rank, so the
driver holds full hidden rows and aux taps itself. Pipeline parallel: the driver is the
first stage. A batch runs as micro-batches (contiguous groups of its requests, about equal in
tokens): each stage runs its layers on micro-batch k and sends the residual stream and the taps so
far on (without waiting for the send) while it starts micro-batch k + 1, so with M micro-batches
over S stages a step takes about (M + S - 1) / M stage-times instead of S. The last stage sends
each micro-batch's final hidden rows and every tap back to the driver. The MoE layers' routed-token
counts (/metrics) are each stage's own: the driver asks the others for theirs (`moe_counts`).

Logits: the first stage's tp ranks each keep a vocab slice of the LM head. The driver's
`logits` tells the others ("logits", rows), hands its stage-0 peers the hidden rows
(ps.tp_broadcast) and gathers their slices (the model's compute_logits, on every one of them)."""
from __future__ import annotations

import itertools
from typing import Callable

import torch

from sparkserve.core.forward_batch import ForwardBatch, PPProxy
from sparkserve.distributed import parallel_state as ps

# model(input_ids, positions, batch, proxy): this rank's stage of the model
Stage = Callable[[torch.Tensor, torch.Tensor, ForwardBatch, PPProxy | None], torch.Tensor | PPProxy]
# compute_logits(hidden): the full logits on the driver, None on the other tp ranks
Head = Callable[[torch.Tensor], torch.Tensor | None]


def taps_before(aux_ids: list[int], layer: int) -> int:
    """How many taps are captured before decoder layer `layer` runs (id l: after layer l)."""
    return sum(1 for i in aux_ids if i < layer)


def micro_batch_bounds(extend_lens: list[int], parts: int, min_tokens: int = 1) -> list[tuple[int, int]]:
    """Up to `parts` contiguous request ranges [lo, hi) of about equal token counts, no more of
    them than leave `min_tokens` per range on average (a long prefill chunk is one of its own)."""
    n = len(extend_lens)
    cum, total = list(itertools.accumulate(extend_lens)), sum(extend_lens)
    parts = max(1, min(parts, n, total // min_tokens))
    cuts = [0]
    for k in range(1, parts):
        c = next(i + 1 for i, s in enumerate(cum) if s * parts >= total * k)
        cuts.append(min(max(c, cuts[-1] + 1), n - (parts - k)))
    cuts.append(n)
    return list(zip(cuts, cuts[1:]))


def split(batch: ForwardBatch, bounds: list[tuple[int, int]]) -> None:
    if len(bounds) > 1:
        batch.micro_batches = [(lo, hi, batch.select(lo, hi)) for lo, hi in bounds]


def commit_parts(commit: Callable[[ForwardBatch, list[int]], None], batch: ForwardBatch,
                 kept: list[int]) -> None:
    """After VERIFY: each micro-batch commits its own requests' kept lengths (its recurrent-state
    bookkeeping is its own)."""
    for lo, hi, part in batch.parts():
        commit(part, kept[lo:hi])


def _rows(proxy: PPProxy) -> torch.Tensor:
    return torch.stack([proxy.hidden, *proxy.aux])


def recv_proxy(num_tokens: int, hidden_size: int, num_aux: int, src: int) -> PPProxy:
    rows = ps.recv((num_aux + 1, num_tokens, hidden_size), src)
    return PPProxy(rows[0], list(rows[1:]))


def run_worker_logits(head: Head, rows: int, hidden_size: int) -> None:
    """A first-stage tp rank other than the driver: its vocab slice of the logits of the driver's
    `rows` hidden rows (which it receives), gathered on the driver."""
    head(ps.tp_broadcast(torch.empty(rows, hidden_size)))


def run_worker_stage(stage: Stage, batch: ForwardBatch, bounds: list[tuple[int, int]], taps_in: int,
                     hidden_size: int) -> None:
    """A rank other than the driver: its stage of every micro-batch in order, receiving `taps_in`
    taps with each (unless it is the first stage); each result goes on to the next stage (the
    last stage's tensor-parallel rank 0 answers the driver) while it runs the next."""
    split(batch, bounds)
    pending = []
    for _, _, part in batch.parts():
        proxy = None
        if not ps.is_first_stage():
            proxy = recv_proxy(part.num_tokens, hidden_size, taps_in, ps.stage_peer(ps.pp_rank() - 1))
        out = stage(part.input_ids, part.positions, part, proxy)
        if isinstance(out, PPProxy):
            pending.append(ps.PendingSend(_rows(out), ps.stage_peer(ps.pp_rank() + 1)))
        elif ps.pp_size() > 1 and ps.tp_rank() == 0:
            pending.append(ps.PendingSend(_rows(PPProxy(out, part.aux_hidden)), 0))
    for p in pending:
        p.wait()


class ForwardMirror:
    def __init__(self, hidden_size: int, micro_batches: int, min_micro_tokens: int):
        """`micro_batches` per pipeline step, each of at least `min_micro_tokens` tokens: a step
        of few tokens is bound by reading the stage's weights, and each micro-batch reads them
        again, so such a step runs whole (decode); prefill chunks split."""
        self.hidden_size = hidden_size
        self.micro_batches = micro_batches if ps.pp_size() > 1 else 1
        self.min_micro_tokens = min_micro_tokens

    def run(self, stage: Stage, batch: ForwardBatch, aux_ids: list[int]) -> torch.Tensor:
        """Every rank runs `batch`; returns the final hidden rows (and sets batch.aux_hidden)."""
        bounds = micro_batch_bounds(batch.extend_lens, self.micro_batches, self.min_micro_tokens)
        ps.broadcast_object(("forward", batch.wire(), list(aux_ids), bounds))
        if ps.pp_size() == 1:
            return stage(batch.input_ids, batch.positions, batch, None)
        split(batch, bounds)
        parts = [part for _, _, part in batch.parts()]
        pending = [ps.PendingSend(_rows(stage(p.input_ids, p.positions, p, None)), ps.stage_peer(1))
                   for p in parts]
        last = ps.stage_peer(ps.pp_size() - 1)
        outs = [recv_proxy(p.num_tokens, self.hidden_size, len(aux_ids), last) for p in parts]
        for p in pending:
            p.wait()
        batch.aux_hidden = [torch.cat(taps) for taps in zip(*(o.aux for o in outs))]
        return torch.cat([o.hidden for o in outs])

    def logits(self, head: Head, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] logits of `hidden` from the LM head split over the first stage's tp ranks
        (`head`: the model's compute_logits, which each of them runs on the same rows)."""
        ps.broadcast_object(("logits", hidden.shape[0]))
        return head(ps.tp_broadcast(hidden.contiguous()))

    def commit(self, kept: list[int]) -> None:
        """After VERIFY: every rank commits its own recurrent state (ModelRunner.commit_verify)."""
        ps.broadcast_object(("commit", kept))

    def moe_counts(self) -> list[int]:
        """The routed-token counts of the other pipeline stages' MoE layers, summed: each stage's
        tensor-parallel rank 0's (every rank of a stage counts its whole group's tokens)."""
        ps.broadcast_object(("moe_counts",))
        got = ps.control_gather_object((ps.pp_rank(), ps.tp_rank(), []))
        return sum_counts([counts for stage, tp, counts in got if stage > 0 and tp == 0])

    def stop(self) -> None:
        """The other ranks leave their loop and exit."""
        ps.broadcast_object(None)


def report_moe_counts(counts: list[int]) -> None:
    """A mirroring rank's answer to ForwardMirror.moe_counts: its stage's routed-token counts."""
    ps.control_gather_object((ps.pp_rank(), ps.tp_rank(), counts))


def sum_counts(lists: list[list[int]]) -> list[int]:
    """Per-expert count lists summed element by element ([]: a stage without MoE layers)."""
    out: list[int] = []
    for counts in lists:
        out = [a + b for a, b in zip(out, counts)] if out and counts else out or list(counts)
    return out
