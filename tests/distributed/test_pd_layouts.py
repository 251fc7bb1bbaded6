"""PD disaggregation between servers of different parallel layouts: the prefill server's driver
gathers every rank's pieces of a request's rows (heads cut over tp ranks, KV heads replicated when
fewer than ranks, KDA conv channels cut inside each q|k|v block, layers over pipeline stages) into
the rows one process holds, and the decode server's driver cuts them into its own ranks' pieces
(executor/pool_rows.py). A request posted to both with the same bootstrap room gives the
decode server's answer, which equals one process's (Engine) tokens and logprobs."""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch
from server_harness import ServerProcess, free_port

from sparkserve import Engine
from sparkserve.core.pool import Split
from sparkserve.mem.transfer import merge, piece

PROMPTS = [list(range(5, 45)), [7, 3, 9] * 4]
SP = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
COMMON = ("--max-total-tokens", "1024", "--chunked-prefill-size", "16")


def test_merge_and_piece_round_trip():
    """Whole rows cut for each rank of 4 and merged back: KV heads held twice (2 parts over 4
    ranks), a dim cut inside 3 blocks, a whole buffer."""
    full = {(0, "k", 0): torch.randn(5, 2, 3), (0, "conv", 1): torch.randn(1, 2, 12),
            (0, "latent", 0): torch.randn(5, 7)}
    lay = {(0, "k", 0): ("token_page", Split(0, 2)), (0, "conv", 1): ("request_row", Split(1, 4, groups=3)),
           (0, "latent", 0): ("token_page", None)}
    pieces = [piece(full, lay, r, 4) for r in range(4)]
    assert torch.equal(pieces[1][(0, "k", 0)], full[(0, "k", 0)][:, :1])        # rank 1 shares rank 0's head
    assert torch.equal(pieces[2][(0, "k", 0)], full[(0, "k", 0)][:, 1:])
    assert torch.equal(pieces[1][(0, "conv", 1)], full[(0, "conv", 1)][:, :, [1, 5, 9]])   # q|k|v blocks of 4
    back = merge([(r, 4, pieces[r], lay) for r in range(4)])
    assert back.keys() == full.keys()
    for key in full:
        assert torch.equal(back[key], full[key])


def _pd_generate(prefill: ServerProcess, decode: ServerProcess, port: int, ids: list[int]) -> dict:
    body = {"input_ids": ids, "sampling_params": SP, "return_logprob": True, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": port, "bootstrap_room": random.getrandbits(63)}
    with ThreadPoolExecutor(2) as pool:
        p = pool.submit(httpx.post, prefill.url + "/generate", json=body, timeout=120)
        d = pool.submit(httpx.post, decode.url + "/generate", json=body, timeout=120)
        assert p.result().status_code == 200, p.result().text
        got = d.result()
    assert got.status_code == 200, got.text
    return got.json()


def test_llama_tp2_prefill_to_one_process_decode(llama_dir):
    """(The other models, and layouts with DSpark, behind the routers: server/test_pd_models.py.)"""
    path = llama_dir
    port = free_port()
    prefill = ServerProcess("--model-path", path, *COMMON, "--tp-size", "2", "--disaggregation-mode",
                            "prefill", "--disaggregation-bootstrap-port", str(port))
    decode = ServerProcess("--model-path", path, *COMMON, "--disaggregation-mode", "decode")
    try:
        want = Engine(path, num_threads=1, max_total_tokens=1024, chunked_prefill_size=16).generate(
            input_ids=PROMPTS, sampling_params=dict(SP, return_logprob=True))
        for ids, w in zip(PROMPTS, want):
            got = _pd_generate(prefill, decode, port, ids)
            assert got["output_ids"] == w["output_ids"]
            lp = torch.tensor([x[0] for x in got["meta_info"]["output_token_logprobs"]])
            ref = torch.tensor([x[0] for x in w["meta_info"]["output_token_logprobs"]])
            torch.testing.assert_close(lp, ref, atol=1e-4, rtol=0)
        assert "Prefill batch" not in decode.log_tail(1 << 30)
    finally:
        for s in (prefill, decode):
            s.stop()
            s.remove_log()
