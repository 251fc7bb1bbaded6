"""ModelRunner: owns the model and its KV pool; turns scheduled work into a ForwardBatch,
runs the forward, and returns logits for the rows the scheduler asked for."""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

import torch

from sparkserve.core.device import on_device
from sparkserve.core.forward_batch import ForwardBatch, ForwardMode
from sparkserve.core.pool import Pool
from sparkserve.distributed import parallel_state as ps
from sparkserve.distributed.mirror import ForwardMirror, commit_parts, sum_counts
from sparkserve.executor.pool_rows import RankLayout, gather_layouts, gather_rows, scatter_rows
from sparkserve.layers.moe import routed_token_counts
from sparkserve.mem.transfer import RequestPages, Rows, Shapes, read_request, shapes, write_request
from sparkserve.models.causal_lm import CausalLM

log = logging.getLogger(__name__)

# Under pipeline parallel, how often a running scheduler asks the other stages for their MoE counts
# (a collective; it reads its load every step).
STAGE_COUNTS_S = 1.0


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
    def __init__(self, model: CausalLM, kv_pool: Pool, req_to_token: torch.Tensor,
                 full_to_swa: torch.Tensor | None = None, mirror: ForwardMirror | None = None):
        self.model = model
        self.device = model.device         # the batch's tensors go there; host bookkeeping stays on CPU
        self.mirror = mirror                # tensor parallel: the other ranks run each forward too
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.full_to_swa = full_to_swa      # split pool: windowed layers' slot of each full slot
        self.rank_layouts: list[RankLayout] | None = None   # PD under tp/pp: what every rank's pools hold
        self.mirrored_forwards = 0
        # the other pipeline stages' MoE counts as of their last report: (forwards then, time, counts)
        self._stage_counts: tuple[int, float, list[int]] = (0, 0.0, [])

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
        kv_start = self.first_visible_position(reqs, self.kv_pool.window)
        kv_indices = self.req_to_token[rows, kv_start:max(seq_lens)]
        out_cache_loc = torch.cat([r.slots for r in reqs])
        dev = self.device
        swa = {}
        if self.full_to_swa is not None:
            start = self.first_visible_position(reqs, self.kv_pool.swa_window)
            swa = dict(swa_out_cache_loc=self.full_to_swa[out_cache_loc].to(dev), swa_kv_start=start,
                       swa_kv_indices=self.full_to_swa[self.req_to_token[rows, start:max(seq_lens)]].to(dev))
        return ForwardBatch(
            mode=mode,
            input_ids=torch.tensor(ids, dtype=torch.long).to(dev),
            positions=torch.tensor(pos, dtype=torch.long).to(dev),
            out_cache_loc=out_cache_loc.to(dev),
            extend_lens=[len(r.tokens) for r in reqs],
            seq_lens=seq_lens,
            kv_indices=kv_indices.to(dev),
            kv_pool=self.kv_pool,
            logits_rows=torch.tensor(rows_wanted, dtype=torch.long).to(dev),
            req_rows=rows.to(dev),
            kv_start=kv_start,
            **swa,
        )

    @staticmethod
    def first_visible_position(reqs: list[ScheduledReq], window: int | None) -> int:
        """The first key position any query of the batch can see through layers whose windows
        are at most `window`: max(0, first query position - W + 1) of the earliest request;
        0 for full attention."""
        if window is None:
            return 0
        return min(max(0, r.start - window + 1) for r in reqs)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [len(logits_rows), vocab] in fp32, on the model's device."""
        hidden = self.hidden_states(batch)
        if batch.logits_rows is None or batch.logits_rows.numel() == 0:
            return hidden.new_empty(0, 0)
        if batch.logits_rows.numel() != hidden.shape[0]:
            hidden = hidden[batch.logits_rows]
        return self.compute_logits(hidden)

    @contextlib.contextmanager
    def taps(self, on: bool):
        """Forwards inside run with the model's aux taps (`on`) or without them: a DSpark step
        whose rows none keeps (every request's draft context paused) skips copying them out."""
        ids = self.model.aux_layer_ids
        if on or not ids:
            yield
            return
        self.model.set_aux_layers([])
        try:
            yield
        finally:
            self.model.set_aux_layers(ids)

    @torch.inference_mode()
    def hidden_states(self, batch: ForwardBatch) -> torch.Tensor:
        """The final normed hidden state of every row, no LM head: VERIFY asks compute_logits
        only for the rows acceptance reads."""
        if self.mirror is None:
            with on_device(self.device):
                out = self.model(batch.input_ids, batch.positions, batch)
        else:
            out = self.mirror.run(self.model, batch, self.model.aux_layer_ids)
            self.mirrored_forwards += 1
        batch.final_hidden = out
        return out

    def moe_token_counts(self, idle: bool) -> list[int]:
        """(token, slot) rows each expert received so far, summed over the MoE layers of every
        pipeline stage (/metrics). The other stages report theirs when asked (ForwardMirror.moe_counts),
        which happens when forwards ran since the last report and the scheduler is `idle`, or
        STAGE_COUNTS_S after it while it runs."""
        mine = routed_token_counts(self.model)
        if self.mirror is None or ps.pp_size() == 1:
            return mine
        forwards, when, others = self._stage_counts
        if forwards != self.mirrored_forwards and (idle or time.monotonic() - when >= STAGE_COUNTS_S):
            others = self.mirror.moe_counts()
            self._stage_counts = (self.mirrored_forwards, time.monotonic(), others)
        return sum_counts([mine, others])

    def synchronize(self) -> None:
        """Wait for the device's queued work (a GPU runs a forward after the call returns), so
        that a timer around a forward times the forward."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def idle_forward(self) -> None:
        """DP attention: this group has nothing to run this step; its forward of no tokens keeps
        the other groups' MLP collectives going."""
        self.hidden_states(ForwardBatch.idle(self.kv_pool))

    def close(self) -> None:
        """Tensor parallel: the other ranks stop, and this one leaves the world."""
        if self.mirror is None:
            return
        mirror, self.mirror = self.mirror, None
        try:
            mirror.stop()
        except RuntimeError as e:          # a rank is gone already: nothing left to tell
            log.warning("tensor-parallel ranks could not be told to stop: %s", e)
        ps.destroy()

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] fp32 logits of final hidden rows; under tensor parallelism the first
        stage's tp ranks compute them together (each its vocab slice: ForwardMirror.logits)."""
        if self.mirror is None or not self.model.vocab_sharded:
            with on_device(self.device):
                return self.model.compute_logits(hidden)
        if hidden.shape[0] == 0:
            return hidden.new_zeros(0, self.model.config.vocab_size)
        return self.mirror.logits(self.model.compute_logits, hidden)

    @torch.inference_mode()
    # ---- PD disaggregation: a request's rows as one process would hold them --------------------
    def read_rows(self, pools: list[Pool], pages: RequestPages, lo: int, state: bool) -> Rows:
        if self.mirror is None:
            return read_request(pools, pages, lo, state)
        return gather_rows(self._layouts(pools), pools, pages, lo, state)

    def write_rows(self, pools: list[Pool], pages: RequestPages, rows: Rows, lo: int, start: int) -> None:
        if self.mirror is None:
            write_request(pools, pages, rows, lo, start)
        else:
            scatter_rows(self._layouts(pools), pools, pages, rows, lo, start)

    def pool_shapes(self, pools: list[Pool]) -> Shapes:
        """Every buffer's whole item shape, over every pipeline stage."""
        if self.mirror is None:
            return shapes(pools)
        return {k: v for r in self._layouts(pools) for k, v in r.shapes.items()}

    def _layouts(self, pools: list[Pool]) -> list[RankLayout]:
        if self.rank_layouts is None:
            self.rank_layouts = gather_layouts(pools)
        return self.rank_layouts

    def commit_verify(self, batch: ForwardBatch, kept: list[int]) -> None:
        """After a VERIFY forward: request i keeps the state after its first kept[i] tokens.
        KV rows need nothing (rejected slots are just freed); recurrent state does, on every rank."""
        if self.mirror is not None and self.model.has_request_state:
            self.mirror.commit(kept)
        with on_device(self.device):
            commit_parts(self.model.commit_verify, batch, kept)
