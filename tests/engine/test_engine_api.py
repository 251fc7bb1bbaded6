"""Engine input handling: a prompt of the wrong kind is a TypeError naming the argument that
takes it; generate_many takes text as well as token ids; each scheduled batch is logged."""
from __future__ import annotations

import logging

import pytest

from sparkserve import Engine


@pytest.fixture(scope="module")
def eng(smollm2_path):
    # exact activations: batched and one-by-one prompts must answer alike (int8 rounding can
    # resolve a near-tie differently when a prompt is prefilled among others)
    return Engine(smollm2_path, max_total_tokens=2048, decode_log_interval=2, activation_quant="none")


CHATS = [[{"role": "user", "content": "Say hi."}], [{"role": "user", "content": "Count to three."}]]
GREEDY = {"temperature": 0, "max_new_tokens": 4}


def test_wrong_prompt_kind_names_the_argument(eng):
    with pytest.raises(TypeError, match=r"prompt: .*got a list of a list of chat messages.*messages="):
        eng.generate(CHATS)                                  # conversations given positionally
    with pytest.raises(TypeError, match=r"prompt: .*got a list of a list of token ids.*input_ids="):
        eng.generate([[1, 2, 3]])
    with pytest.raises(TypeError, match=r"input_ids: .*got a list of a string.*prompt="):
        eng.generate(input_ids=["hello"])
    with pytest.raises(TypeError, match=r"messages: .*got str.*prompt="):
        eng.generate(messages="hello")
    with pytest.raises(TypeError, match=r"prompt: .*got int"):
        eng.generate(7)
    with pytest.raises(ValueError, match="prompt: the batch is empty"):
        eng.generate([])
    # and the right kinds still work, single and batched
    assert len(eng.generate(messages=CHATS, sampling_params=GREEDY)) == 2
    assert isinstance(eng.generate("Hi", GREEDY), dict)


def test_generate_many_takes_text(eng):
    texts = ["The capital of France is", "1, 2, 3,"]
    want = [eng.generate(t, GREEDY)["output_ids"] for t in texts]
    got = [r["output_ids"] for r in eng.generate_many(texts, GREEDY, max_in_flight=2)]
    assert got == want
    mixed = [texts[0], eng.tokenizer.encode(texts[1], add_special_tokens=True)]
    assert [r["output_ids"] for r in eng.generate_many(mixed, GREEDY)] == want
    with pytest.raises(TypeError, match="generate_many: each prompt is a string or a list of token ids"):
        list(eng.generate_many([{"role": "user"}], GREEDY))
    assert not eng.scheduler.has_work()


def test_batches_are_logged(eng, caplog):
    with caplog.at_level(logging.INFO, logger="sparkserve.scheduler"):
        eng.generate(["Hello there", "Tell me a story"], {"temperature": 0, "max_new_tokens": 5,
                                                          "ignore_eos": True})
    lines = [r.getMessage() for r in caplog.records if r.name == "sparkserve.scheduler"]
    prefill = [line for line in lines if line.startswith("Prefill batch.")]
    decode = [line for line in lines if line.startswith("Decode batch.")]
    assert prefill and "#new-seq: 2" in prefill[0] and "#queue-req: 0" in prefill[0]
    # 4 decode steps after the prefill, one line every 2 (--decode-log-interval 2)
    assert len(decode) == 2 and all("#running-req: 2" in line or "#running-req: 0" in line for line in decode)
    assert "gen throughput (token/s)" in decode[0] and "token usage" in decode[0]
