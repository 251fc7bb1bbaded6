"""A trained draft grown by architecture options (train-draft --init-draft with --prev-context-fusion,
a larger --num-layers, a wider --draft-kv-heads; training/grow_draft.py): at step 0 the grown draft
computes the init draft's logits, and, per option, its serving paths (Python and native) compute
its training path's logits, at step 0 and once the added weights have moved."""
from __future__ import annotations

import pytest
import torch
from dspark_fixtures import dspark_single_thread  # noqa: F401 (autouse)
from test_draft_options import make_draft, sequence, serving_logits, target_dir, training_logits  # noqa: F401

from sparkserve.training.grow_draft import grow_draft, grown_config

GROWTHS = {
    "fusion": dict(prev_context_fusion=True),
    "layers": dict(num_layers=3),
    "wide_kv": dict(kv_heads=4),             # the target's 4 attention heads (the init's KV heads: 2)
    "all": dict(prev_context_fusion=True, num_layers=2, kv_heads=4),
}


def move_added_weights(grown, init) -> None:
    """The weights grow_draft started at zero (or copied), moved as training would move them."""
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in grown.named_parameters():
            added = name.startswith("fuse_proj.") and init.fuse_proj is None
            added |= name.startswith("layers.") and int(name.split(".")[1]) >= init.config.num_hidden_layers
            if added or ".kv_proj." in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)


@pytest.mark.parametrize("init_option", ["base", "tap_norm"])
@pytest.mark.parametrize("growth", list(GROWTHS))
@torch.inference_mode()
def test_grown_draft_starts_as_its_init_and_serves_as_it_trains(target_dir, init_option, growth):  # noqa: F811
    init = make_draft(target_dir, init_option).eval()
    grown = grow_draft(init, grown_config(init.config.raw, "D", **GROWTHS[growth])).eval()
    c = grown.config
    assert (c.prev_context_fusion, c.num_hidden_layers, c.num_key_value_heads, c.tap_norm) == (
        GROWTHS[growth].get("prev_context_fusion", False), GROWTHS[growth].get("num_layers", 1),
        GROWTHS[growth].get("kv_heads", 2), init_option == "tap_norm")
    tokens, taps, anchors = sequence(init)
    want = training_logits(init, tokens, taps, anchors)
    got = training_logits(grown, tokens, taps, anchors)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    if "kv_heads" not in GROWTHS[growth]:
        assert torch.equal(got, want)           # added as exact zeros: bit for bit
    for step in ("start", "moved"):
        if step == "moved":
            move_added_weights(grown, init)
            got = training_logits(grown, tokens, taps, anchors)
            assert (got - want).abs().max() > 1e-2       # the added weights count once they move
        for native in (False, True):
            torch.testing.assert_close(serving_logits(grown, tokens, taps, anchors, native=native), got,
                                       atol=2e-4, rtol=1e-4)
