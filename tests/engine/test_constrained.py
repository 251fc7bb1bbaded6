"""Constrained decoding on the Engine: json_schema / regex / ebnf outputs obey their grammar (checked
with jsonschema and re, not with the grammar engine that made them), the unconstrained rows of a
batch are untouched by a constrained neighbour, n > 1 and streaming keep the constraint, the matcher
state survives retraction and replays (PD), and bad constraints are refused naming the field.
A tiny random Llama with a byte-level tokenizer (its unconstrained output is noise: only the grammar
can make it valid JSON) and the embedded SmolLM2 (GGUF tokenizer)."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from tiny_chat_fixtures import make_tiny_chat_checkpoint

from sparkserve.constrained.bitmask import mask_rows

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150}}}
CODE = r"[0-9]{3}-[a-z]{2,4}"
YES_NO = 'root ::= "yes" | "no" | "maybe " [0-9]'
CHAT = [{"role": "user", "content": "Describe a person named Alice who is 30, as JSON."}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from sparkserve import Engine
    path = make_tiny_chat_checkpoint(str(tmp_path_factory.mktemp("tiny_chat") / "llama"))
    return Engine(path, max_total_tokens=2048, max_running_requests=8)


def _json(text: str, schema: dict) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


def test_json_schema_tiny_greedy_and_sampled(tiny):
    """The random model's free output is not JSON; under the schema it is, greedy and sampled."""
    free = tiny.generate("hi", {"temperature": 0, "max_new_tokens": 40})["text"]
    with pytest.raises(ValueError):
        json.loads(free)
    out = tiny.generate("hi", {"json_schema": json.dumps(PERSON), "temperature": 0, "max_new_tokens": 250})
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    _json(out["text"], PERSON)
    for seed in range(3):
        out = tiny.generate("hi", {"json_schema": json.dumps(PERSON), "temperature": 1.0, "seed": seed,
                                   "max_new_tokens": 250})
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        _json(out["text"], PERSON)


def test_regex_and_ebnf_tiny(tiny):
    for seed in range(3):
        out = tiny.generate("x", {"regex": CODE, "temperature": 1.0, "seed": seed, "max_new_tokens": 30})
        assert re.fullmatch(CODE, out["text"]), out["text"]
        out = tiny.generate("x", {"ebnf": YES_NO, "temperature": 1.0, "seed": seed, "max_new_tokens": 30})
        assert re.fullmatch(r"yes|no|maybe [0-9]", out["text"]), out["text"]


def test_unconstrained_rows_untouched_by_constrained_neighbours(tiny):
    """Greedy and seeded sampled free rows give the same tokens alone and beside constrained ones."""
    free = [{"temperature": 0, "max_new_tokens": 24}, {"temperature": 1.0, "seed": 5, "max_new_tokens": 24}]
    alone = [o["output_ids"] for o in tiny.generate(["ab", "cd"], free)]
    schema = {"json_schema": json.dumps(PERSON), "temperature": 0, "max_new_tokens": 250}
    mixed = tiny.generate(["ab", "zz", "cd", "yy"],
                          [free[0], schema, free[1], {"regex": CODE, "temperature": 1.0, "seed": 5,
                                                      "max_new_tokens": 24}])
    assert [mixed[0]["output_ids"], mixed[2]["output_ids"]] == alone
    _json(mixed[1]["text"], PERSON)
    assert re.fullmatch(CODE, mixed[3]["text"])


def test_n_and_streaming_keep_the_constraint(tiny):
    outs = tiny.generate("hi", {"json_schema": json.dumps(PERSON), "temperature": 1.0, "seed": 11, "n": 3,
                                "max_new_tokens": 250})
    assert len(outs) == 3
    for o in outs:
        _json(o["text"], PERSON)
    params = {"regex": CODE, "temperature": 1.0, "seed": 2, "max_new_tokens": 30}
    chunks = list(tiny.generate("q", params, stream=True))
    text = "".join(c["text"] for c in chunks)
    assert re.fullmatch(CODE, text)
    assert text == tiny.generate("q", params)["text"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "stop"


def test_logprobs_are_the_masked_distribution(tiny):
    """Reported logprobs are log-softmax of the grammar-masked logits: every top alternative is a
    token the grammar allows, and the allowed tokens' probabilities sum to 1."""
    out = tiny.generate("q", {"regex": "[0-9]+x", "temperature": 0, "max_new_tokens": 6,
                              "return_logprob": True, "top_logprobs_num": 20})
    tops = out["meta_info"]["output_top_logprobs"]
    first = [(lp, t) for lp, t in tops[0] if lp > float("-inf")]
    digits = {tiny.tokenizer.encode(str(d))[0] for d in range(10)}
    assert {t for _, t in first} == digits             # only 10 tokens are allowed first
    assert abs(torch.tensor([lp for lp, _ in first]).exp().sum().item() - 1.0) < 1e-4
    assert out["meta_info"]["output_token_logprobs"][0][0] == max(lp for lp, _ in first)   # greedy


def test_bad_constraints_refused(tiny):
    for sp, field in [({"regex": "a(b"}, "regex"), ({"json_schema": "{not json"}, "json_schema"),
                      ({"json_schema": json.dumps({"type": "nonsense"})}, "json_schema"),
                      ({"ebnf": "root ::= undefined_rule"}, "ebnf"),
                      ({"regex": "a", "json_schema": "{}"}, "json_schema"),
                      ({"regex": "a", "min_new_tokens": 2}, "min_new_tokens")]:
        with pytest.raises(ValueError, match=f"^{field}"):
            tiny.generate("q", sp)
    assert tiny.generate("q", {"regex": "ok", "max_new_tokens": 5})["text"] == "ok"   # still serving


def test_retraction_keeps_the_matcher(tmp_path):
    """A pool too small for every request at once retracts some mid-generation; their outputs still
    obey the schema and equal a run that never retracted."""
    from sparkserve import Engine
    path = make_tiny_chat_checkpoint(str(tmp_path / "llama"))
    params = [{"json_schema": json.dumps(PERSON), "temperature": 1.0, "seed": s, "max_new_tokens": 120}
              for s in range(6)]
    roomy = Engine(path, max_total_tokens=2048, max_running_requests=8)
    ref = [o["output_ids"] for o in roomy.generate(["hi"] * 6, params)]
    tight = Engine(path, max_total_tokens=128, page_size=1, max_running_requests=8)
    outs = tight.generate(["hi"] * 6, params)
    assert tight.scheduler.num_retractions > 0
    assert [o["output_ids"] for o in outs] == ref
    for o in outs:
        _json(o["text"], PERSON)


def test_replayed_matcher_equals_stepped_one(tiny):
    """PD's decode side (and a retraction) rebuild the state from the output tokens: the mask after
    a replay equals the mask of a matcher that took the tokens one by one."""
    backend = tiny.scheduler.grammar
    ids = tiny.tokenizer.encode('{"name": "Al')
    stepped, replayed = backend.matcher("json_schema", json.dumps(PERSON)), None
    bits = torch.empty(2, backend.words, dtype=torch.int32)
    for k in range(1, len(ids) + 1):
        stepped.advance(ids[:k])
    replayed = backend.matcher("json_schema", json.dumps(PERSON))
    stepped.fill(bits, 0, ids)
    replayed.fill(bits, 1, ids)
    assert torch.equal(bits[0], bits[1]) and not torch.equal(bits[0], torch.full_like(bits[0], -1))


def test_mask_rows_against_a_dense_mask():
    g = torch.Generator().manual_seed(0)
    vocab = 77
    allowed = torch.rand(3, vocab, generator=g) < 0.3
    bits = torch.zeros(3, (vocab + 31) // 32, dtype=torch.int64)
    for r, t in allowed.nonzero().tolist():
        bits[r, t // 32] |= 1 << (t % 32)
    bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    logits = torch.randn(3, vocab, generator=g)
    masked = mask_rows(logits, bits)
    assert torch.equal(masked, torch.where(allowed, logits, torch.tensor(float("-inf"))))


def test_smollm2_json_schema_and_regex(smollm2_engine):
    out = smollm2_engine.generate(messages=CHAT, sampling_params={
        "json_schema": json.dumps(PERSON), "temperature": 0, "max_new_tokens": 80})
    value = _json(out["text"], PERSON)
    assert value["name"] == "Alice" and value["age"] == 30      # the model still answers the question
    for seed in range(2):
        out = smollm2_engine.generate(messages=CHAT, sampling_params={
            "json_schema": json.dumps(PERSON), "temperature": 1.0, "seed": seed, "max_new_tokens": 120})
        _json(out["text"], PERSON)
    out = smollm2_engine.generate(messages=[{"role": "user", "content": "What is 12+30?"}],
                                  sampling_params={"regex": "[0-9]+", "temperature": 0, "max_new_tokens": 8})
    assert re.fullmatch("[0-9]+", out["text"])


def test_grammar_backend_flag(tmp_path):
    """--grammar-backend none refuses constraints naming the field; xgrammar is refused at start-up
    with the reason (its wheel requires triton), never silently."""
    from sparkserve import Engine
    from sparkserve.args import ServerArgs
    path = make_tiny_chat_checkpoint(str(tmp_path / "llama"))
    with pytest.raises(ValueError, match="^--grammar-backend xgrammar: not offered .*requires triton"):
        ServerArgs(model_path=path, grammar_backend="xgrammar").validate()
    off = Engine(path, max_total_tokens=1024, grammar_backend="none")
    assert off.scheduler.grammar is None
    with pytest.raises(ValueError, match=r"^regex: constrained decoding is off .*--grammar-backend none"):
        off.generate("q", {"regex": "a"})
    assert len(off.generate("q", {"max_new_tokens": 3})["output_ids"]) == 3


def test_draft_masks_leave_the_matcher_as_it_was(tiny):
    """DSpark's per-draft masks walk the drafts, EOS included, without moving the request's state
    (llguidance's rollback after an EOS drops a token too many: the walk must not use it)."""
    backend, tok = tiny.scheduler.grammar, tiny.tokenizer
    x, y = tok.encode("x")[0], tok.encode("y")[0]
    m, fresh = backend.matcher("regex", "xyx"), backend.matcher("regex", "xyx")
    rows = m.draft_masks([y, x, tok.eos_token_id], [x])
    assert rows.shape[0] == 4 and m.cut_drafts([y, x, tok.eos_token_id, y], [x]) == 4
    bits = torch.empty(2, backend.words, dtype=torch.int32)
    m.fill(bits, 0, [x])
    fresh.fill(bits, 1, [x])
    assert torch.equal(bits[0], bits[1])
    m.advance([x, y, x])
    assert m.terminated and m.error is None


def test_constraint_after_a_token(tiny):
    """grammar_after_token (a reasoning model's </think>): every token is free until it comes, the
    constraint applies from the token after it (in the output, in drafts crossing it, and in the
    verify masks of the rows after it), and it holds the same on the Engine: free text first."""
    backend, tok = tiny.scheduler.grammar, tiny.tokenizer
    x, y, z = (tok.encode(c)[0] for c in "xyz")
    end = tok.encode("!")[0]
    m = backend.matcher("regex", "xyx", after_token=end)
    everything = torch.full((1, backend.words), -1, dtype=torch.int32)
    bits = torch.empty(1, backend.words, dtype=torch.int32)
    m.fill(bits, 0, [z, y])
    assert torch.equal(bits, everything) and not m.terminated and m.walker([z, y]) is None
    assert m.cut_drafts([z, z, z], [z]) == 3               # no end among them: all free
    assert m.cut_drafts([z, end, x, y, y, x], [z]) == 5    # free up to the end, then x y, y the first refused
    rows = m.draft_masks([z, end, x], [z])
    allowed = mask_rows(torch.zeros(4, backend.n_vocab), rows)
    assert torch.isfinite(allowed[:2]).all()                          # before the end: free
    assert torch.isfinite(allowed[2]).sum() == 1 and torch.isfinite(allowed[2, x])   # after: x only
    assert torch.isfinite(allowed[3]).sum() == 1 and torch.isfinite(allowed[3, y])
    m.advance([z, y, end, x, y])
    assert m.error is None and not m.terminated
    m.fill(bits, 0, [z, y, end, x, y])
    assert torch.isfinite(mask_rows(torch.zeros(1, backend.n_vocab), bits)).sum() == 1
    m.advance([z, y, end, x, y, x])
    assert m.terminated
    with pytest.raises(ValueError, match="grammar_after_token: needs a constraint"):
        tiny.generate("q", {"grammar_after_token": end})
    sp = {"regex": "xyx", "grammar_after_token": end, "temperature": 1, "max_new_tokens": 40,
          "logit_bias": {end: 4.0}}
    ended = 0
    for seed in range(4):
        out = tiny.generate("q", dict(sp, seed=seed))
        ids = out["output_ids"]
        if end in ids:
            ended += 1
            assert tok.decode(ids[ids.index(end) + 1:]).startswith("xyx")
    assert ended >= 2
