"""What each rank builds and loads: a pipeline stage its layers (the first also the embedding and
the LM head, the last the final norm); under tensor parallelism each rank of the first stage keeps
its vocab slice of the embedding and LM head rows (the vocab padded up to a multiple of the tp
size, padding rows zero), tied or not, and nothing else of them."""
from __future__ import annotations

import pytest
import torch
from conftest import TINY_CONFIGS
from parallel_fixtures import act_as_rank, make_tp3_llama
from safetensors.torch import load_file

from sparkserve.config import ModelConfig
from sparkserve.distributed.sharding import vocab_shard
from sparkserve.models.causal_lm import PPMissingLayer
from sparkserve.models.llama import LlamaForCausalLM
from sparkserve.models.registry import load_model

CFG = ModelConfig.from_hf_dict(dict(TINY_CONFIGS["llama"], architectures=["LlamaForCausalLM"]))
V = CFG.vocab_size      # 320


def _build(monkeypatch, **state) -> LlamaForCausalLM:
    act_as_rank(monkeypatch, **state)
    with torch.device("meta"):
        return LlamaForCausalLM(CFG)


@pytest.mark.parametrize("state,layers,embed,head,norm,rows", [
    (dict(), range(0, 3), True, True, True, V),                                  # one process
    (dict(tp_rank=1, tp_size=2), range(0, 3), True, True, True, V // 2),         # a tp rank: its slice
    (dict(tp_rank=2, tp_size=3), range(0, 3), True, True, True, -(-V // 3)),     # padded to 321
    (dict(pp_rank=0, pp_size=2), range(0, 2), True, True, False, V),             # the driver's stage
    (dict(pp_rank=1, pp_size=2), range(2, 3), False, False, True, 0),            # the last stage
    (dict(pp_rank=1, pp_size=2, tp_rank=1, tp_size=2, world_size=4), range(2, 3), False, False, True, 0),
])
def test_each_rank_owns_its_part(monkeypatch, state, layers, embed, head, norm, rows):
    m = _build(monkeypatch, **state)
    assert m.layer_range == layers
    assert [not isinstance(layer,
                           PPMissingLayer) for layer in m.model.layers] == [i in layers for i in range(3)]
    assert (not isinstance(m.model.embed_tokens, PPMissingLayer), m.owns("model.embed_tokens.weight")) == \
        (embed, embed)
    assert (not isinstance(m.lm_head, PPMissingLayer), m.owns("lm_head.weight")) == (head, head)
    assert m.owns("model.norm.weight") == norm and (not isinstance(m.model.norm, PPMissingLayer)) == norm
    assert m.owns("model.layers.2.mlp.down_proj.weight") == (2 in layers)
    if embed:
        assert m.model.embed_tokens.weight.shape == (rows, CFG.hidden_size)
        assert m.lm_head.weight.shape == (rows, CFG.hidden_size)


def test_vocab_shard_rule(monkeypatch):
    """Slices in rank order cover the vocab once; padding only at the end."""
    for vocab, tp in ((320, 2), (320, 3), (49152, 3), (5, 4)):
        got = []
        for r in range(tp):
            act_as_rank(monkeypatch, tp_rank=r, tp_size=tp)
            got.append(vocab_shard(vocab))
        per = -(-vocab // tp)
        assert [(s, n) for s, n, _ in got] == [(r * per, per) for r in range(tp)]
        assert sum(real for _, _, real in got) == vocab
        assert all(real == per for _, _, real in got[:vocab // per])


@pytest.mark.parametrize("arch,tp", [("llama", 2), ("qwen3", 2), ("untied", 3), ("tied", 3)])
def test_each_tp_rank_loads_its_vocab_slice(monkeypatch, tiny_dirs, tmp_path, arch, tp):
    """Embedding and LM head rows of rank r are rows [r * Vp / tp, (r + 1) * Vp / tp) of the
    checkpoint's (zero past the vocab: 3 ranks pad 320 to 321); a tied head is the embedding
    slice itself."""
    path = tiny_dirs[arch] if tp == 2 else make_tp3_llama(str(tmp_path), tied=arch == "tied")
    tied = arch in ("qwen3", "tied")
    ckpt = load_file(f"{path}/model.safetensors")
    embed = ckpt["model.embed_tokens.weight"]
    head = embed if tied else ckpt["lm_head.weight"]
    per = -(-V // tp)
    for r in range(tp):
        act_as_rank(monkeypatch, tp_rank=r, tp_size=tp)
        m = load_model(path, pack=False)
        assert m.vocab_sharded and m.lm_head.out_features == per
        for got, full in ((m.model.embed_tokens.weight, embed), (m.lm_head.weight, head)):
            assert got.shape == (per, m.config.hidden_size)
            real = full[r * per:(r + 1) * per]
            assert torch.equal(got[:len(real)], real)
            assert not got[len(real):].any()
        assert (m.lm_head.weight is m.model.embed_tokens.weight) == tied
