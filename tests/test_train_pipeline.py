"""`sparkserve train-draft` end to end on the embedded SmolLM2 (tiny sizes): every stage writes
its output, the distilled answers are the engine's own greedy answers, training resumes, and
the evaluation runs the trained draft through the serving path."""
import json
import os

import torch

from sparkserve import Engine
from sparkserve.cli import main
from sparkserve.training.feature_cache import FeatureCache

PROMPTS = ["Name a colour.", "What is 2 + 2?", "Say hello in French.", "Write one word."]


def test_train_draft_cli_end_to_end(tmp_path):
    pfile = tmp_path / "prompts.jsonl"
    pfile.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n"
                             for p in PROMPTS))
    out = str(tmp_path / "run")
    common = ["train-draft", "--out", out, "--prompts-file", str(pfile), "--max-new-tokens", "12",
              "--seqs-per-step", "2", "--anchors-per-seq", "4", "--draft-vocab-size", "512",
              "--markov-rank", "16"]
    assert main(common + ["--stages", "prompts,distill,features,train", "--steps", "2"]) == 0
    rows = [json.loads(line) for line in open(os.path.join(out, "distill.jsonl"))]
    assert len(rows) == len(PROMPTS)
    eng = Engine(None)
    want = eng.generate(messages=[[{"role": "user", "content": p}] for p in PROMPTS],
                        sampling_params={"temperature": 0, "max_new_tokens": 12})
    assert [r["output_ids"] for r in rows] == [w["output_ids"] for w in want]
    cache = FeatureCache.open(os.path.join(out, "features"))
    assert len(cache) == len(PROMPTS)
    assert cache.sequence(0)[0].tolist() == rows[0]["prompt_ids"] + rows[0]["output_ids"]

    # resume: the train stage picks up at step 2 and runs to 3
    assert main(common + ["--stages", "train", "--steps", "3"]) == 0
    assert torch.load(os.path.join(out, "draft", "train_state.pt"), weights_only=False)["step"] == 3
    cfg = json.load(open(os.path.join(out, "draft", "config.json")))
    assert cfg["draft_vocab_size"] == 512 and cfg["block_size"] == 7

    assert main(common + ["--stages", "eval", "--eval-prompts", "1", "--eval-max-new-tokens", "8"]) == 0
    ev = json.load(open(os.path.join(out, "eval.json")))
    assert set(ev) == {"sharegpt_heldout_T0", "sharegpt_heldout_T1", "humaneval_T0", "humaneval_T1"}
    assert all(v["cycles"] > 0 and 1.0 <= v["tau"] <= 8.0 for v in ev.values()), ev
