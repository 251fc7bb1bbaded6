"""DP attention and context parallel in a decoder layer (SGLang's layers/dp_attention.py):
attention ran on this rank's own tokens (its attention group's requests; under CP its share of a
long prefill); the MLP / MoE, split over every rank of the stage, runs over all of the ranks'
tokens at once, so each layer gathers their rows before it and keeps this rank's rows of the
summed output after it. `batch.mlp_rows` (the rows each rank brings, exchanged once per forward
by CausalLM.forward) sizes both. A MoE block on the all-to-all backend instead dispatches the
rows this rank holds itself (layers/moe_a2a.py): no gather, no all-reduce."""
from __future__ import annotations

from typing import Callable

import torch

from sparkserve.core.forward_batch import ForwardBatch
from sparkserve.distributed import expert_parallel as ep
from sparkserve.distributed import parallel_state as ps
from sparkserve.layers.moe import MoEBlock


def run_mlp(mlp: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
            batch: ForwardBatch) -> torch.Tensor:
    """mlp(x) for this rank's rows x; with DP attention or CP, over every rank's rows together."""
    if isinstance(mlp, MoEBlock) and mlp.a2a:
        return mlp(x, ep.row_holders(batch.cp is not None))
    if batch.mlp_rows is None:
        return mlp(x)
    counts, source = batch.mlp_rows
    return ps.mlp_scatter(mlp(ps.mlp_gather(x, counts)), counts, source)
