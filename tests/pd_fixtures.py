"""PD disaggregation helpers: in one process, a request's prompt run on one engine and its state
(every rank's pieces, merged) moved into another engine, which decodes it; across processes, a PD
router (sglang-router's PD mode or `sparkserve router`) in front of a prefill and a decode server."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import torch
from server_harness import ServerProcess, free_port

from sparkserve import Engine
from sparkserve.core.forward_batch import ForwardMode
from sparkserve.core.req import Req
from sparkserve.core.sampling_state import RequestSamplingState
from sparkserve.frontend.prepare import params_list


class Exploit:
    """What an attacker sends a server that unpickles: unpickling it runs `touch marker`."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def disaggregated(prefill: Engine, decode: Engine, ids: list[int], sp: dict) -> dict:
    """Run `ids` on `prefill` up to its first token, move its state, finish it on `decode`."""
    params = params_list(sp, 1)[0]
    [src] = prefill._submit(ids, params)
    while not src.output_ids:
        prefill.scheduler.step()
    data = prefill.scheduler.request_rows(src, len(ids)).read(0, True)     # every rank's pieces, merged
    prefill.scheduler.abort(src.rid)                        # the prefill side frees it at once
    dst = Req(src.rid, list(ids), params, RequestSamplingState(params, ids, decode.scheduler.eos_ids),
              output_ids=list(src.output_ids), output_logprobs=list(src.output_logprobs),
              output_top_logprobs=list(src.output_top_logprobs))
    dst.sampling.resume_rng(src.sampling.rng_state())   # seeded sampling goes on
    assert decode.scheduler.add_prebuilt(dst, data)
    if decode.scheduler.spec is not None and decode.scheduler.spec.draft_pools():   # the draft's KV rows
        # arrived where decode reads them (NGRAM has none)
        here = decode.scheduler.request_rows(dst, len(ids)).read(0, True)
        draft = [key for key in data if key[0] == 1]
        assert draft
        for key in draft:
            torch.testing.assert_close(here[key], data[key], rtol=0, atol=0)
    return decode._run_to_completion([[dst]])[0]


def assert_disaggregated_as_colocated(path: str, kw: dict, prompts: list[list[int]], sp: dict,
                                      atol: float = 1e-5) -> tuple[Engine, Engine]:
    """Each prompt colocated (one at a time, as a disaggregated pair runs them: a batch's other
    roundings of quantized K/V could flip a value across a step) and disaggregated give the same
    tokens and logprobs, the decode engine never running a prompt. Returns (prefill, decode)."""
    colocated = Engine(path, **kw)
    want = [colocated.generate(input_ids=ids, sampling_params=sp) for ids in prompts]
    prefill, decode = Engine(path, **kw), Engine(path, **kw)
    got = [disaggregated(prefill, decode, ids, sp) for ids in prompts]
    assert decode.scheduler.forward_count[ForwardMode.EXTEND] == 0      # the prompt never ran here
    for g, w in zip(got, want):
        assert g["output_ids"] == w["output_ids"]
        torch.testing.assert_close(torch.tensor([x[0] for x in g["meta_info"]["output_token_logprobs"]]),
                                   torch.tensor([x[0] for x in w["meta_info"]["output_token_logprobs"]]),
                                   atol=atol, rtol=0)
    return prefill, decode


def _start(cmd: list[str], url: str, ready_path: str) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    end = time.monotonic() + 60
    while time.monotonic() < end:
        assert proc.poll() is None, f"{cmd[2]} exited"
        try:
            if httpx.get(url + ready_path, timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise RuntimeError(f"{cmd} did not come up")


def start_router(kind: str, prefill: ServerProcess, bootstrap: int,
                 decode: ServerProcess) -> tuple[subprocess.Popen, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if kind == "sglang-router":
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
               "--prefill", prefill.url, str(bootstrap), "--decode", decode.url, "--host", "127.0.0.1",
               "--port", str(port), "--prometheus-port", str(free_port()), "--log-level", "warn"]
    else:
        cmd = [sys.executable, "-m", "sparkserve.cli", "router", "--prefill", prefill.url, str(bootstrap),
               "--decode", decode.url, "--port", str(port), "--log-level", "warning"]
    proc = _start(cmd, url, "/v1/models")
    if kind == "sglang-router":      # it answers once one worker is in; it adds the other by itself
        _wait_for_workers(proc, url, {prefill.url, decode.url})
    return proc, url


def _wait_for_workers(proc: subprocess.Popen, url: str, want: set[str]) -> None:
    end = time.monotonic() + 60
    while time.monotonic() < end:
        workers = httpx.get(url + "/workers", timeout=5).json()["workers"]
        if want <= {w["url"] for w in workers}:
            return
        time.sleep(0.25)
    proc.kill()
    raise RuntimeError(f"sglang-router at {url} did not register {sorted(want)} within 60 s")
