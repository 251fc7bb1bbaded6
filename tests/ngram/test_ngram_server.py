"""`sparkserve serve --speculative-algorithm NGRAM` on the embedded SmolLM2, through the real
`openai` client: greedy answers (a copy-heavy one among them, a stop string that ends an answer
inside an accepted block, max_tokens) equal the offline plain Engine's, and the copy-heavy answer
commits several tokens per verify. One process, and DP attention over two groups (each group's
scheduler has its own NGRAM worker)."""
from __future__ import annotations

import httpx
import openai
import pytest
from conftest import EXACT, EXACT_FLAGS
from server_harness import SERVER_THREADS, ServerProcess

TEXT = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
        "How vexingly quick daft zebras jump. Sphinx of black quartz, judge my vow.")
CHATS = [
    [{"role": "user", "content": f"Repeat this text exactly, word for word:\n\n{TEXT}"}],
    [{"role": "user", "content": "What is the capital of France?"}],
]
MAX_TOKENS = 48
LAYOUTS = {"single": [], "dp2": ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention"]}


@pytest.fixture(scope="module")
def reference():
    import torch

    from sparkserve import Engine
    n = torch.get_num_threads()
    torch.set_num_threads(SERVER_THREADS)
    try:
        eng = Engine(max_total_tokens=8192, **EXACT)
        greedy = [o["text"] for o in eng.generate(messages=CHATS, sampling_params=dict(
            temperature=0, max_new_tokens=MAX_TOKENS))]
        stopped = eng.generate(messages=CHATS[:1], sampling_params=dict(
            temperature=0, max_new_tokens=MAX_TOKENS, stop=["liquor"]))[0]["text"]
    finally:
        torch.set_num_threads(n)
    return greedy, stopped


@pytest.fixture(scope="module", params=list(LAYOUTS))
def server(request):
    s = ServerProcess("--speculative-algorithm", "NGRAM", "--max-total-tokens", "8192", *EXACT_FLAGS,
                      "--max-running-requests", "4",      # the step costs measured at start-up: 4 requests
                      *LAYOUTS[request.param])
    yield s
    s.stop()
    s.remove_log()


def test_greedy_answers_equal_plain_decoding(server, reference):
    greedy, stopped = reference
    assert "quick brown fox" in greedy[0], greedy[0]         # the model really copies
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    for msgs, want in zip(CHATS, greedy):
        out = client.chat.completions.create(model="default", messages=msgs, temperature=0,
                                             max_tokens=MAX_TOKENS)
        assert out.choices[0].message.content == want
    out = client.chat.completions.create(model="default", messages=CHATS[0], temperature=0,
                                         max_tokens=MAX_TOKENS, stop=["liquor"])
    assert out.choices[0].message.content == stopped and out.choices[0].finish_reason == "stop"
    info = httpx.get(server.url + "/server_info", timeout=30).json()
    assert info["speculative_algorithm"] == "NGRAM"
    # only NGRAM's fields: none of DSpark's (its draft path, block size, verify mode names)
    assert not [k for k in info if k.startswith("speculative_dspark") or k == "speculative_draft_model_path"]
    assert (info["speculative_ngram_verify_mode"], info["speculative_num_draft_tokens"]) == ("adaptive", 12)
    assert info["speculative_ngram_match_type"] == "BFS"
    hist = {int(k): v for k, v in info["internal_states"][0]["spec_accept_hist"].items()}
    verifies, committed = sum(hist.values()), sum((k + 1) * v for k, v in hist.items())
    assert verifies and committed / verifies > 1.5, hist
