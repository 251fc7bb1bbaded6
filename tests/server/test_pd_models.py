"""Every model kind through both PD routers, DSpark on and off, across parallel layouts: one
prefill server (with a DSpark draft, so its draft KV goes over) and two decode servers, one with
the same draft (it drafts from its first step) and one without (it takes the model's rows and
leaves the draft's), each behind a router (sglang-router's PD mode and `sparkserve router`,
alternating). The decode servers' greedy tokens and logprobs equal one process's (Engine), and
neither decode server runs a prefill batch. Layouts differ on the two sides, so rows are merged
from the prefill server's ranks and cut for the decode server's (tests/distributed/
test_pd_layouts.py has the cut's unit test)."""
from __future__ import annotations

import httpx
import pytest
import torch
from dspark_fixtures import make_oracle_draft
from kimi_fixtures import make_kimi
from minimax_fixtures import make_minimax, with_index_value
from parallel_fixtures import bigram_of
from pd_fixtures import start_router
from server_harness import ServerProcess, free_port

from sparkserve import Engine
from sparkserve.config import ModelConfig

PROMPTS = [list(range(5, 45)), [7, 3, 9] * 4]
SP = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
COMMON = ("--max-total-tokens", "1024", "--chunked-prefill-size", "16")
EP2 = ("--tp-size", "2", "--ep-size", "2")
CASES = {    # model: (prefill layout, DSpark decode layout, plain decode layout, router of the DSpark one)
    "windowed": (("--pp-size", "2"), ("--tp-size", "2"), (), "sglang-router"),
    "kimi": ((), EP2, ("--pp-size", "2"), "sparkserve-router"),
    "minimax": (EP2, ("--pp-size", "2"), (), "sglang-router"),
}
OTHER = {"sglang-router": "sparkserve-router", "sparkserve-router": "sglang-router"}


def _model(name: str, root, tiny_dirs) -> str:
    if name == "windowed":
        return tiny_dirs["mistral"]                                    # sliding window 8
    if name == "kimi":
        return make_kimi(str(root / "kimi"), "kda_mla")
    return with_index_value(make_minimax(str(root / "minimax")))     # K-only and index-value layers


@pytest.mark.parametrize("name", list(CASES))
def test_model_through_both_routers(name, tmp_path, tiny_dirs):
    path = _model(name, tmp_path, tiny_dirs)
    want = Engine(path, num_threads=1, max_total_tokens=1024, chunked_prefill_size=16).generate(
        input_ids=PROMPTS, sampling_params=dict(SP, return_logprob=True))
    vocab = ModelConfig.from_hf_dir(path).vocab_size
    draft = make_oracle_draft(path, str(tmp_path / "draft"),
                              bigram_of(PROMPTS, [w["output_ids"] for w in want], vocab), block_size=4)
    dspark = ("--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", draft,
              "--speculative-dspark-verify-mode", "full")
    prefill_layout, on_layout, off_layout, on_router = CASES[name]
    port = free_port()
    model = ("--model-path", path, *COMMON)
    servers = {"prefill": ServerProcess(*model, *prefill_layout, *dspark, "--disaggregation-mode", "prefill",
                                        "--disaggregation-bootstrap-port", str(port)),
               "on": ServerProcess(*model, *on_layout, *dspark, "--disaggregation-mode", "decode"),
               "off": ServerProcess(*model, *off_layout, "--disaggregation-mode", "decode")}
    routers = []
    try:
        for decode, kind in (("on", on_router), ("off", OTHER[on_router])):
            proc, url = start_router(kind, servers["prefill"], port, servers[decode])
            routers.append(proc)
            accepted = 0
            for ids, w in zip(PROMPTS, want):
                got = httpx.post(url + "/generate", json={"input_ids": ids, "sampling_params": SP,
                                                          "return_logprob": True}, timeout=120)
                assert got.status_code == 200, got.text
                got = got.json()
                assert got["output_ids"] == w["output_ids"], (decode, kind)
                lp = torch.tensor([x[0] for x in got["meta_info"]["output_token_logprobs"]])
                ref = torch.tensor([x[0] for x in w["meta_info"]["output_token_logprobs"]])
                torch.testing.assert_close(lp, ref, atol=1e-4, rtol=0)
                accepted += got["meta_info"].get("spec_accept_token_num", 0)
            assert (accepted > 0) == (decode == "on")
            assert "Prefill batch" not in servers[decode].log_tail(1 << 30)
    finally:
        for proc in routers:
            proc.terminate()
            proc.wait(10)
        for s in servers.values():
            s.stop()
            s.remove_log()


@pytest.mark.parametrize("name", ["windowed", "minimax"])
def test_quantized_kv_through_sglang_router(name, tmp_path, tiny_dirs):
    """--kv-cache-dtype int8 on both sides of sglang-router's PD mode: the scales move with the rows
    (Mistral's window; MiniMax-M3's K/V, index K and index V), and the decode server's greedy tokens
    and logprobs equal one int8 process's, prompt by prompt (a batch's other roundings could flip a
    value across a quantization step)."""
    path = _model(name, tmp_path, tiny_dirs)
    sp = dict(SP, return_logprob=True)
    eng = Engine(path, num_threads=1, max_total_tokens=1024, chunked_prefill_size=16, kv_cache_dtype="int8")
    want = [eng.generate(input_ids=ids, sampling_params=sp) for ids in PROMPTS]
    port = free_port()
    model = ("--model-path", path, *COMMON, "--kv-cache-dtype", "int8")
    prefill = ServerProcess(*model, "--disaggregation-mode", "prefill",
                            "--disaggregation-bootstrap-port", str(port))
    decode = ServerProcess(*model, "--disaggregation-mode", "decode")
    proc = None
    try:
        proc, url = start_router("sglang-router", prefill, port, decode)
        for ids, w in zip(PROMPTS, want):
            got = httpx.post(url + "/generate", json={"input_ids": ids, "sampling_params": SP,
                                                      "return_logprob": True}, timeout=120)
            assert got.status_code == 200, got.text
            got = got.json()
            assert got["output_ids"] == w["output_ids"]
            lp = torch.tensor([x[0] for x in got["meta_info"]["output_token_logprobs"]])
            ref = torch.tensor([x[0] for x in w["meta_info"]["output_token_logprobs"]])
            torch.testing.assert_close(lp, ref, atol=1e-4, rtol=0)
        assert "Prefill batch" not in decode.log_tail(1 << 30)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        for s in (prefill, decode):
            s.stop()
            s.remove_log()
