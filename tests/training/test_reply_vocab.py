"""--vocab-count-replies: the draft vocab picked on the distilled answers' counts (x20) plus the
training conversations' own replies, checked against a direct count: on the tiny chat model
with one character per id, a reply's token counts are its character counts."""
import json
import os
from collections import Counter

import pytest
import torch
from train_data_fixtures import data_flags, make_char_chat_checkpoint, one_thread, train_flags  # noqa: F401

from sparkserve.cli import main
from sparkserve.frontend.tokenizer import load_tokenizer
from sparkserve.training.draft_vocab import select_draft_vocab

PROMPTS = ["Name a colour.", "What is 2 + 2?", "Say hello.", "Count to three."]
# long replies rich in characters the target's own answers rarely write
REPLIES = [s * 30 for s in ("QQQQ XXXX ZZZZ", "QQ jjjj kkkk ##", "ZZZZ %%% QQ", "kk jj ~~~~ ~~")]


def char_id(c: str) -> int:
    return 95 if c == "\n" else ord(c) - 32        # the fixture's vocab: printable ASCII, newline, ...


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_char_chat_checkpoint(str(tmp_path_factory.mktemp("charchat")))


def run(tmp_path, model: str, name: str, extra: list[str]) -> str:
    pfile = tmp_path / "prompts.jsonl"
    pfile.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": p}, {"role": "assistant", "content": a}]}) + "\n"
        for p, a in zip(PROMPTS, REPLIES)))
    out = str(tmp_path / name)
    flags = data_flags(out, model, str(pfile)) + train_flags(1) + ["--draft-vocab-size", "24"] + extra
    assert main(flags) == 0
    return out


def saved_vocab(out: str) -> list[int]:
    from safetensors.torch import load_file
    d2t = load_file(os.path.join(out, "draft", "model.safetensors"))["d2t"]
    return (torch.arange(len(d2t)) + d2t).tolist()


def test_vocab_counts_the_replies_beside_the_distilled_answers(tmp_path, model):
    out = run(tmp_path, model, "replies", ["--vocab-count-replies"])
    tok = load_tokenizer(model)
    V = 320
    distilled = Counter(t for line in open(os.path.join(out, "distill.jsonl"))
                        for t in json.loads(line)["output_ids"])
    replies = Counter(char_id(c) for r in REPLIES for c in r)
    direct = torch.zeros(V, dtype=torch.float64)
    for i, n in distilled.items():
        direct[i] += 20 * n
    for i, n in replies.items():
        direct[i] += n
    saved = json.load(open(os.path.join(out, "reply_counts.json")))
    assert saved["tokens"] == sum(map(len, REPLIES))
    assert {i: n for i, n in enumerate(saved["counts"]) if n} == dict(replies)
    want = select_draft_vocab(direct, 24, tok.eos_token_ids)[0].tolist()
    assert saved_vocab(out) == want
    assert char_id("~") in want and char_id("Q") in want       # reply-only characters made it in
    # without the flag the vocab is the distilled answers' alone
    plain = run(tmp_path, model, "plain", [])
    only = torch.zeros(V, dtype=torch.float64)
    for i, n in distilled.items():
        only[i] += n
    assert saved_vocab(plain) == select_draft_vocab(only, 24, tok.eos_token_ids)[0].tolist() != want


def test_reply_counts_need_a_reduced_vocab(tmp_path, model):
    pfile = tmp_path / "p.jsonl"
    pfile.write_text(json.dumps({"prompt": "Hi."}) + "\n")
    assert main(data_flags(str(tmp_path / "x"), model, str(pfile)) + ["--vocab-count-replies"]) == 2


def test_sharegpt_replies_come_from_the_training_part_only():
    from sparkserve.training.prompts import humaneval_prompts, sharegpt_training_conversations, split_sharegpt
    convs = sharegpt_training_conversations()
    train, held = split_sharegpt()
    banned = {p[0]["content"] for p in held + humaneval_prompts()}
    assert 14000 < len(convs) < 15545                 # 17,545 in the file, 2,000 held out
    assert not [c for c in convs if any(m["role"] == "user" and m["content"] in banned for m in c)]
    firsts = {p[0]["content"] for p in train if len(p) == 1}
    assert {c[0]["content"] for c in convs if c[0]["role"] == "user"} <= firsts | {
        c[0]["content"] for c in convs if len(c[0]["content"]) > 2000}
