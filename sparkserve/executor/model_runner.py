"""ModelRunner: owns the model and its KV pool; turns scheduled work into a ForwardBatch,
runs the forward, and returns logits for the rows the scheduler asked for."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from sparkserve.executor.forward_batch import ForwardBatch, ForwardMode
from sparkserve.mem.kv_pool import KVPool


@dataclass
class ScheduledReq:
    """One request's part of a forward: `tokens` at positions start.. written to `slots`;
    logits are wanted for its last `logit_rows` tokens."""
    row: int
    start: int
    tokens: list[int]
    slots: torch.Tensor
    logit_rows: int = 1


class ModelRunner:
    def __init__(self, model: nn.Module, kv_pool: KVPool, req_to_token: torch.Tensor):
        self.model = model
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token

    def build_batch(self, mode: ForwardMode, reqs: list[ScheduledReq]) -> ForwardBatch:
        ids, pos, rows_wanted = [], [], []
        offset = 0
        for r in reqs:
            ids.extend(r.tokens)
            pos.extend(range(r.start, r.start + len(r.tokens)))
            offset += len(r.tokens)
            rows_wanted.extend(range(offset - r.logit_rows, offset))
        seq_lens = [r.start + len(r.tokens) for r in reqs]
        rows = torch.tensor([r.row for r in reqs])
        kv_indices = self.req_to_token[rows, :max(seq_lens)]
        return ForwardBatch(
            mode=mode,
            input_ids=torch.tensor(ids, dtype=torch.long),
            positions=torch.tensor(pos, dtype=torch.long),
            out_cache_loc=torch.cat([r.slots for r in reqs]),
            extend_lens=[len(r.tokens) for r in reqs],
            seq_lens=seq_lens,
            kv_indices=kv_indices,
            kv_pool=self.kv_pool,
            logits_rows=torch.tensor(rows_wanted, dtype=torch.long),
            req_rows=rows,
        )

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [len(logits_rows), vocab] in fp32."""
        hidden = self.model(batch.input_ids, batch.positions, batch)
        if batch.logits_rows is None or batch.logits_rows.numel() == 0:
            return hidden.new_empty(0, 0)
        if batch.logits_rows.numel() != hidden.shape[0]:
            hidden = hidden[batch.logits_rows]
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def commit_verify(self, batch: ForwardBatch, kept: list[int]) -> None:
        """After a VERIFY forward: request i keeps the state after its first kept[i] tokens.
        KV rows need nothing (rejected slots are just freed); recurrent state does."""
        hook = getattr(self.model, "commit_verify", None)
        if hook is not None:
            hook(batch, kept)
