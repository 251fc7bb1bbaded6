"""Prefill labels (`train-draft --labels prefill|mix`): one teacher-forced pass of the target
over answers the prompts file brings. Where those answers are the target's own greedy answers
the labels (the target's argmax after each position) are exactly their next tokens; where an
answer leaves the greedy path, the consistency mask stops supervising a block's later slots."""
from __future__ import annotations

import json
import os

import pytest
import torch
from train_data_fixtures import PROMPTS, data_flags, make_char_chat_checkpoint, train_flags, write_prompts

from sparkserve import Engine
from sparkserve.cli import main
from sparkserve.models.dspark_draft import init_dspark_draft
from sparkserve.models.registry import load_config, load_model
from sparkserve.training.config import TrainConfig
from sparkserve.training.feature_cache import FeatureCache
from sparkserve.training.train_dspark import block_losses, consistent_slots

N = 4


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """The tiny chat target and its own greedy answers (up to a special token: as text that
    encodes back to them)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("prefill")
    model = make_char_chat_checkpoint(str(root / "model"))
    with Engine(model, max_total_tokens=2048) as eng:
        outs = eng.generate(messages=[[{"role": "user", "content": p}] for p in PROMPTS[:N]],
                            sampling_params={"temperature": 0, "max_new_tokens": 12})
        tok = eng.tokenizer
        special = set(tok.all_special_ids)
        ids = [o["output_ids"][:next((k for k, t in enumerate(o["output_ids"]) if t in special), 12)]
               for o in outs]
        answers = [tok.decode(a) for a in ids]
        assert [tok.encode(a, add_special_tokens=False) for a in answers] == ids
        assert min(map(len, ids)) >= 8
    yield root, model, answers, ids
    torch.set_num_threads(n)


def _run(root, model, name: str, answers: list[str], extra: list[str]) -> str:
    out = str(root / name)
    pfile = write_prompts(str(root / f"{name}.jsonl"), PROMPTS[:N], answers)
    assert main(data_flags(out, model, pfile) + train_flags(1) + extra) == 0
    return out


def test_labels_are_the_targets_greedy_tokens(target):
    root, model, answers, ids = target
    out = _run(root, model, "own", answers, ["--labels", "prefill"])
    rows = [json.loads(line) for line in open(os.path.join(out, "distill.jsonl"))]
    assert [r["output_ids"] for r in rows] == ids and all(r["prefill_labelled"] for r in rows)
    cache = FeatureCache.open(os.path.join(out, "features"))
    assert cache.greedy is not None and all(cache.prefill_labelled(i) for i in range(len(cache)))
    for i in range(len(cache)):
        tokens, _, _, plen = cache.sequence(i)
        greedy = cache.sequence_greedy(i)
        assert torch.equal(greedy[plen:-1], tokens[plen + 1:])       # the answer is the greedy path
        assert (greedy[:plen] == -1).all()                           # prompt rows are never labels


def test_consistency_mask_stops_at_an_off_path_answer_token(target):
    root, model, answers, _ = target
    changed = list(answers)
    j = 4                                       # the answer's 5th token is not the target's choice
    changed[0] = answers[0][:j] + ("a" if answers[0][j] != "a" else "b") + answers[0][j + 1:]
    out = _run(root, model, "changed", changed, ["--labels", "prefill"])
    cache = FeatureCache.open(os.path.join(out, "features"))
    tokens, taps, final, plen = cache.sequence(0)
    greedy = cache.sequence_greedy(0)
    off = [p for p in range(plen, len(tokens) - 1) if tokens[p + 1] != greedy[p]]
    m = off[0]
    assert m == plen + j - 1                    # the changed token is where the path leaves
    # slot k of the block at anchor a counts while tokens a+1..a+k are greedy; m+1 is not
    slots = consistent_slots(tokens, greedy, torch.tensor([m - 2, m - 1, m]), 4)
    T, F = True, False
    assert slots.tolist() == [[T, T, T, F], [T, T, F, F], [T, F, F, F]]
    # in the loss: fewer supervised slots than with the answer's own tokens as labels
    tgt = load_model(model, load_config(model))
    d = init_dspark_draft(json.load(open(os.path.join(out, "draft", "config.json"))), tgt)
    anchors = torch.tensor([m - 1])
    cfg = TrainConfig()
    masked = block_losses(d, tokens, taps, final, anchors, cfg, greedy=greedy)["wsum"]
    full = block_losses(d, tokens, taps, final, anchors, cfg)["wsum"]
    assert masked < full


def test_mix_and_flag_errors(target, capsys):
    root, model, answers, ids = target
    out = _run(root, model, "mix", answers, ["--labels", "mix", "--prefill-frac", "0.5"])
    rows = [json.loads(line) for line in open(os.path.join(out, "distill.jsonl"))]
    assert [bool(r.get("prefill_labelled")) for r in rows] == [False, True, False, True]
    assert [r["output_ids"] for r in rows] == ids          # generated ones: the same greedy answers
    cache = FeatureCache.open(os.path.join(out, "features"))
    assert [cache.prefill_labelled(i) for i in range(len(cache))] == [False, True, False, True]
    # validation data follows the target's own answers (offline tau replays greedy serving)
    val = str(root / "val")
    flags = data_flags(val, model, write_prompts(str(root / "v.jsonl"), PROMPTS[:N], answers))
    assert main(flags + ["--labels", "prefill", "--val-prompts", "1", "--stages", "prompts,distill"]) == 0
    rows = [json.loads(line) for line in open(os.path.join(val, "distill.jsonl"))]
    val_rows = [json.loads(line) for line in open(os.path.join(val, "val", "distill.jsonl"))]
    assert all(r.get("prefill_labelled") for r in rows) and not val_rows[0].get("prefill_labelled")
    assert val_rows[0]["output_ids"] == ids[N - 1]
    base = data_flags(str(root / "bad"), model, write_prompts(str(root / "q.jsonl"), PROMPTS[:2]))
    assert main(base + ["--prefill-frac", "0.5"]) == 2
    assert main(base + ["--labels", "mix"]) == 2
    assert main(base + ["--labels", "prefill", "--stages", "prompts,distill"]) == 2
    assert "brings no answer" in capsys.readouterr().err


def test_training_taps_a_subset_of_the_captured_layers(target, capsys):
    """One capture of taps 0,1 trains a draft of tap 1 (training and validation read the subset);
    a tap the cache lacks is refused naming the capture flag."""
    root, model, _, _ = target
    out = str(root / "taps")
    flags = data_flags(out, model, write_prompts(str(root / "taps.jsonl"), PROMPTS))
    assert main(flags + train_flags(2) + ["--val-prompts", "2",
                                          "--val-every", "1", "--stages", "prompts,distill,features"]) == 0
    assert FeatureCache.open(os.path.join(out, "val", "features")).target_layer_ids == [0, 1]
    assert main(flags + train_flags(2) + ["--target-layer-ids", "1", "--val-prompts", "2",
                                          "--val-every", "1", "--stages", "train"]) == 0
    cfg = json.load(open(os.path.join(out, "draft", "config.json")))
    assert cfg["target_layer_ids"] == [1]
    log = [json.loads(line) for line in open(os.path.join(out, "draft", "train_log.jsonl"))]
    assert any("val_tau" in r for r in log)
    other = str(root / "taps_other")
    assert main(data_flags(other, model, str(root / "taps.jsonl")) + train_flags(1)
                + ["--extra-features", os.path.join(out, "features"), "--target-layer-ids=-1,1",
                   "--stages", "train"]) == 2
    assert "holds taps [0, 1], not [-1]: capture with --target-layer-ids -1,1" in capsys.readouterr().err


def test_unanswered_sharegpt_turn_is_skipped_not_fatal(target):
    """ShareGPT has a few user turns nobody answered: with prefill labels from ShareGPT they are
    skipped (an empty distill line, as too-long prompts), while a prompts file must answer every
    prompt it hands to prefill labels."""
    from sparkserve.training.config import PipelineConfig
    from sparkserve.training.pipeline import _distill_item, _local_config_and_tokenizer
    _, model, answers, _ = target
    _, tok = _local_config_and_tokenizer(model)
    bare = [{"role": "user", "content": PROMPTS[0]}]
    answered = bare + [{"role": "assistant", "content": answers[0]}]
    sharegpt = PipelineConfig(out="unused", labels="prefill")
    assert _distill_item(sharegpt, "prefill", tok, 0, answered)["run"]
    assert not _distill_item(sharegpt, "prefill", tok, 1, bare)["run"]
    with pytest.raises(ValueError, match="prompt 1 brings no answer"):
        _distill_item(PipelineConfig(out="unused", labels="prefill", prompts_file="p.jsonl"), "prefill",
                      tok, 1, bare)
