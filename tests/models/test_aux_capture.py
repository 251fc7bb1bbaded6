"""Aux hidden-state capture (DSpark taps) against transformers' hidden_states."""
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from sparkserve.models.registry import load_model
from sparkserve.training.feature_cache import capture


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory):
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(request.param, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                               max_position_embeddings=256, head_dim=16, initializer_range=0.1)
    ref = AutoModelForCausalLM.from_config(cfg).eval()
    path = str(tmp_path_factory.mktemp(request.param))
    ref.save_pretrained(path)
    return load_model(path), ref


@pytest.mark.parametrize("ids", [[-1, 0, 2], [1], [0, 1, 2]])
def test_taps_equal_hf_hidden_states(tiny, ids):
    model, ref = tiny
    seqs = [[1, 5, 9, 2, 7], [3, 3, 4, 8, 10, 11, 12, 13]]
    got = capture(model, seqs, ids)
    for seq, (taps, final) in zip(seqs, got):
        with torch.no_grad():
            hs = ref(torch.tensor([seq]), output_hidden_states=True).hidden_states
        torch.testing.assert_close(taps, torch.cat([hs[l + 1][0] for l in ids], -1), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(final, hs[-1][0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("ids,msg", [([3], "last layer"), ([0, 0], "unique"), ([4], "out of range"),
                                     ([-2], "out of range"), ([2, 1], "increasing")])
def test_bad_tap_ids(tiny, ids, msg):
    model, _ = tiny
    with pytest.raises(ValueError, match=msg):
        model.set_aux_layers(ids)
