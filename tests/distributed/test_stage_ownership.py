"""What each rank builds and loads: a pipeline stage its layers (the first also the embedding, the
last the final norm), and only the driver the LM head (the other ranks never compute logits)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import TINY_CONFIGS

from sparkserve.config import ModelConfig
from sparkserve.distributed import parallel_state as ps
from sparkserve.models.causal_lm import PPMissingLayer
from sparkserve.models.llama import LlamaForCausalLM

CFG = ModelConfig.from_hf_dict(dict(TINY_CONFIGS["llama"], architectures=["LlamaForCausalLM"]))


def _build(monkeypatch, **state) -> LlamaForCausalLM:
    monkeypatch.setattr(ps, "_state", dataclasses.replace(ps._state, **state))
    with torch.device("meta"):
        return LlamaForCausalLM(CFG)


@pytest.mark.parametrize("state,layers,embed,head,norm", [
    (dict(), range(0, 3), True, True, True),                                  # one process
    (dict(tp_rank=1, tp_size=2), range(0, 3), True, False, True),             # a tp rank but the driver
    (dict(pp_rank=0, pp_size=2), range(0, 2), True, True, False),             # the driver's stage
    (dict(pp_rank=1, pp_size=2), range(2, 3), False, False, True),            # the last stage
])
def test_each_rank_owns_its_part(monkeypatch, state, layers, embed, head, norm):
    m = _build(monkeypatch, **state)
    assert m.layer_range == layers
    assert [not isinstance(layer,
                           PPMissingLayer) for layer in m.model.layers] == [i in layers for i in range(3)]
    assert (not isinstance(m.model.embed_tokens, PPMissingLayer)) == embed
    assert (not isinstance(m.lm_head, PPMissingLayer), m.owns("lm_head.weight")) == (head, head)
    assert m.owns("model.norm.weight") == norm and (not isinstance(m.model.norm, PPMissingLayer)) == norm
    assert m.owns("model.layers.2.mlp.down_proj.weight") == (2 in layers)
