"""`sparkserve train-draft` end to end on the embedded SmolLM2 (tiny sizes): every stage writes
its output, the distilled answers are the engine's own greedy answers, training resumes, and
the evaluation runs the trained draft through the serving path."""
import json
import os

import pytest
import torch
from conftest import EXACT, EXACT_FLAGS
from safetensors.torch import load_file

from sparkserve import Engine
from sparkserve.cli import main
from sparkserve.training.feature_cache import FeatureCache, capture

PROMPTS = ["Name a colour.", "What is 2 + 2?", "Say hello in French.", "Write one word."]


def test_train_draft_cli_end_to_end(tmp_path):
    pfile = tmp_path / "prompts.jsonl"
    pfile.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n"
                             for p in PROMPTS))
    out = str(tmp_path / "run")
    common = ["train-draft", "--out", out, "--prompts-file", str(pfile), "--max-new-tokens", "12",
              "--seqs-per-step", "2", "--anchors-per-seq", "4", "--draft-vocab-size", "512",
              "--markov-rank", "16", "--val-prompts", "1", "--val-every", "1",
              *EXACT_FLAGS]
    assert main(common + ["--stages", "prompts,distill,features,train", "--steps", "2"]) == 0
    # the last prompt of the file is validation data: distilled and captured, never trained on
    rows = [json.loads(line) for line in open(os.path.join(out, "distill.jsonl"))]
    val_rows = [json.loads(line) for line in open(os.path.join(out, "val", "distill.jsonl"))]
    assert len(rows) == len(PROMPTS) - 1 and len(val_rows) == 1
    eng = Engine(None, **EXACT)    # the target the pipeline ran (its flags)
    want = eng.generate(messages=[[{"role": "user", "content": p}] for p in PROMPTS],
                        sampling_params={"temperature": 0, "max_new_tokens": 12})
    assert [r["output_ids"] for r in rows + val_rows] == [w["output_ids"] for w in want]
    cache = FeatureCache.open(os.path.join(out, "features"))
    assert len(cache) == len(PROMPTS) - 1
    assert cache.sequence(0)[0].tolist() == rows[0]["prompt_ids"] + rows[0]["output_ids"]
    # the cache comes from the rows the engine computed while distilling (no second pass):
    # they equal a fresh prefill capture; the last token, never run, has a NaN row
    taps_ids = cache.target_layer_ids
    for i in range(len(cache)):
        tokens, taps, final, _ = cache.sequence(i)
        want_taps, want_final = capture(eng.scheduler.runner.model, [tokens.tolist()], taps_ids)[0]
        torch.testing.assert_close(taps[:-1], want_taps[:-1].half().float(), atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(final[:-1], want_final[:-1].half().float(), atol=2e-2, rtol=1e-2)
        assert taps[-1].isnan().all() and final[-1].isnan().all()
    val = FeatureCache.open(os.path.join(out, "val", "features"))
    assert val.sequence(0)[0].tolist() == val_rows[0]["prompt_ids"] + val_rows[0]["output_ids"]
    logged = [json.loads(line) for line in open(os.path.join(out, "draft", "train_log.jsonl"))]
    assert [r["step"] for r in logged if "val_tau" in r] == [1, 2]
    assert os.path.exists(os.path.join(out, "draft", "best", "model.safetensors"))

    # resume: the train stage picks up at step 2 and runs to 3
    assert main(common + ["--stages", "train", "--steps", "3"]) == 0
    assert torch.load(os.path.join(out, "draft", "train_state.pt"), weights_only=False)["step"] == 3
    cfg = json.load(open(os.path.join(out, "draft", "config.json")))
    assert cfg["draft_vocab_size"] == 512 and cfg["block_size"] == 7

    # a second run trains on the first run's cache (data grown over several runs), some
    # anchors where greedy serving would anchor (needs greedy answers)
    more = ["train-draft", "--out", str(tmp_path / "more"), "--stages", "train", "--steps", "1",
            "--seqs-per-step", "2", "--anchors-per-seq", "4", "--draft-vocab-size", "512", "--markov-rank",
            "16",
            "--extra-features", os.path.join(out, "features"), "--walk-anchor-frac", "0.5"]
    assert main(more) == 0
    assert os.path.exists(os.path.join(tmp_path, "more", "draft", "model.safetensors"))
    assert main(more + ["--temperature", "1"]) == 2
    assert main(more + ["--walk-anchor-frac", "1.5"]) == 2

    # a run started from the first run's draft takes its config over the flags, and with lr 0
    # (weight decay and dropout on) it saves exactly the weights it started from
    start = load_file(os.path.join(out, "draft", "model.safetensors"))
    cont = ["train-draft", "--stages", "train", "--steps", "1", "--lr", "0", "--seqs-per-step", "2",
            "--anchors-per-seq", "4", "--markov-rank", "8", "--weight-decay", "0.1", "--dropout", "0.5",
            "--extra-features", os.path.join(out, "features"), "--init-draft", os.path.join(out, "draft")]
    assert main(cont + ["--out", str(tmp_path / "init")]) == 0
    saved = load_file(str(tmp_path / "init" / "draft" / "model.safetensors"))
    assert start.keys() == saved.keys() and all(torch.equal(start[k], saved[k]) for k in start)
    # --draft-vocab-size re-picks its vocab from the data; the rows of ids it knew stay
    assert main(cont + ["--out", str(tmp_path / "revocab"), "--draft-vocab-size", "64"]) == 0
    saved = load_file(str(tmp_path / "revocab" / "draft" / "model.safetensors"))
    assert json.load(open(tmp_path / "revocab" / "draft" / "config.json"))["draft_vocab_size"] == 64
    old_ids = (torch.arange(512) + start["d2t"]).tolist()
    new_ids = (torch.arange(64) + saved["d2t"]).tolist()
    assert set(new_ids) <= set(old_ids)            # the data's ids: the first vocab had them all
    torch.testing.assert_close(saved["lm_head.weight"],
                               start["lm_head.weight"][[old_ids.index(i) for i in new_ids]])
    assert main(cont + ["--out", str(tmp_path / "bad"), "--draft-vocab-size", "0"]) == 2

    assert main(common + ["--stages", "eval", "--eval-prompts", "1", "--eval-max-new-tokens", "8"]) == 0
    ev = json.load(open(os.path.join(out, "eval.json")))
    assert ev.pop("draft") == os.path.join(out, "draft", "best")
    best = max(r["val_tau"] for r in logged if "val_tau" in r)
    assert ev.pop("val_greedy_offline")["tau"] == pytest.approx(best)     # all of val = val_seqs
    served = ev.pop("val_greedy_serving")             # the parity check: the val sequences served again
    assert served["same_tokens"] == 1.0 and served["blocks"] > 0 and 1.0 <= served["tau"] <= 8.0
    quick = ev.pop("val_quick")                       # the quick metrics over every validation position
    assert quick["positions"] == len(val_rows[0]["output_ids"]) - 1
    assert 0 <= quick["slot1_acc"] <= quick["slot1_acc_in_vocab"] <= 1
    assert [r for r in logged if "val_tau" in r][-1]["positions"] == quick["positions"]
    assert set(ev) == {"sharegpt_heldout_T0", "sharegpt_heldout_T1", "humaneval_T0", "humaneval_T1"}
    assert all(v["cycles"] > 0 and 1.0 <= v["tau"] <= 8.0 for v in ev.values()), ev


def test_distill_resumes_with_requests_in_flight(tmp_path, capsys):
    """Distillation keeps distill_batch requests in flight and writes finished lines in prompt
    order: a run stopped after the first prompt and resumed on the longer file gives the
    engine's own greedy answers, an empty line for a prompt over --max-prompt-tokens, and
    logged hidden rows that equal a fresh prefill capture (rows logged past the last written
    line, as a stop mid-batch leaves them, are ignored)."""
    from sparkserve.training.pipeline import PipelineConfig, distill, stage_features
    from sparkserve.training.target_source import EngineTarget
    prompts = PROMPTS[:2] + [" ".join(["word"] * 60)] + PROMPTS[2:]
    cfg = PipelineConfig(model_path=None, out=str(tmp_path), max_new_tokens=8, distill_batch=2,
                         max_prompt_tokens=40, target_layer_ids=[2, 20])
    eng = Engine(None, max_total_tokens=2048, enable_return_hidden_states=True, disable_radix_cache=True,
                 **EXACT)

    def write(ps):
        (tmp_path / "prompts.jsonl").write_text(
            "".join(json.dumps({"prompt": p}) + "\n" for p in ps))
    write(prompts[:1])
    distill(cfg, EngineTarget(eng, 2), str(tmp_path))
    write(prompts)
    distill(cfg, EngineTarget(eng, 2), str(tmp_path))
    rows = [json.loads(line) for line in open(tmp_path / "distill.jsonl")]
    assert len(rows) == len(prompts) and rows[2]["output_ids"] == [] and "feature_rows" not in rows[2]
    short = [[{"role": "user", "content": p}] for i, p in enumerate(prompts) if i != 2]
    want = eng.generate(messages=short, sampling_params={"temperature": 0, "max_new_tokens": 8})
    assert [r["output_ids"] for r in rows if r["output_ids"]] == [w["output_ids"] for w in want]
    for name in ("taps.bin", "final.bin"):      # rows of answers cut off before their lines
        with open(tmp_path / "features.log" / name, "ab") as f:
            f.write(b"\x00" * 4096)
    stage_features(cfg, EngineTarget(eng, 2))
    assert "capturing by prefill" not in capsys.readouterr().out    # built from the distill log
    cache = FeatureCache.open(str(tmp_path / "features"))
    assert len(cache) == len(short)
    for i in range(len(cache)):
        tokens, taps, _, _ = cache.sequence(i)
        want_taps, _ = capture(eng.scheduler.runner.model, [tokens.tolist()], [2, 20])[0]
        torch.testing.assert_close(taps[:-1], want_taps[:-1].half().float(), atol=2e-2, rtol=1e-2)
    # --cache-format int8: the same log read into the int8 cache, no fp16 copy: taps within half a
    # step of the fp16 cache's, the teacher's top-1 the argmax of the target's head on the final rows
    import dataclasses
    import shutil

    from sparkserve.models.dspark_draft import target_vocab_weights
    from sparkserve.training.int8_cache import Int8FeatureCache
    q = tmp_path / "q"
    q.mkdir()
    for name in ("prompts.jsonl", "distill.jsonl"):
        shutil.copy(tmp_path / name, q / name)
    os.symlink(tmp_path / "features.log", q / "features.log")
    stage_features(dataclasses.replace(cfg, out=str(q), cache_format="int8"), EngineTarget(eng, 2))
    qc = FeatureCache.open(str(q / "features"))
    assert isinstance(qc, Int8FeatureCache) and not os.path.exists(q / "features" / "taps.npy")
    head = target_vocab_weights(eng.scheduler.runner.model)["lm_head.weight"].float()
    for i in range(len(cache)):
        tokens, taps, final, plen = cache.sequence(i)
        qt, qtaps, _, qplen = qc.sequence(i)
        assert torch.equal(qt, tokens) and qplen == plen
        step = taps[:-1].view(len(tokens) - 1, 2, -1).abs().amax(-1, keepdim=True) / 127
        assert ((qtaps[:-1] - taps[:-1]).view(len(tokens) - 1, 2, -1).abs() <= step / 2 + 1e-3).all()
        assert torch.equal(qc.sequence_greedy(i)[plen:-1], (final[plen:-1] @ head.T).argmax(-1))
