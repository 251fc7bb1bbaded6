"""`train-draft --target-url`: distillation and feature capture through running `sparkserve
serve` servers (/generate with return_hidden_states, the taps set by --hidden-state-layers) write
the feature cache an in-process target writes; requests spread over two servers; the prefill
capture fallback also runs through them; a server tapping other layers is refused at start."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from server_harness import ServerProcess
from tiny_chat_fixtures import make_tiny_chat_checkpoint
from train_data_fixtures import PROMPTS, assert_same_features, data_flags, features, write_prompts

from sparkserve.cli import main

SERVE = ["--enable-return-hidden-states", "--disable-radix-cache"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    model = make_tiny_chat_checkpoint(str(root / "model"))
    servers = [ServerProcess("--model-path", model, *SERVE, "--hidden-state-layers", "0,1") for _ in range(2)]
    other = ServerProcess("--model-path", model, *SERVE, "--hidden-state-layers", "1")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield root, model, servers, other
    torch.set_num_threads(n)
    for s in servers + [other]:
        s.stop()


def _requests_served(server: ServerProcess) -> int:
    import httpx
    text = httpx.get(server.url + "/metrics").text
    return sum(int(float(line.split()[-1])) for line in text.splitlines()
               if line.startswith("sglang:num_requests_total"))


def test_served_target_writes_the_in_process_cache(served):
    root, model, servers, _ = served
    pfile = write_prompts(str(root / "prompts.jsonl"), PROMPTS)
    local = str(root / "local")
    assert main(data_flags(local, model, pfile) + ["--stages", "prompts,distill,features"]) == 0
    remote = str(root / "remote")
    urls = ",".join(s.url for s in servers)
    flags = data_flags(remote, model, pfile) + ["--target-url", urls, "--stages", "prompts,distill,features"]
    before = [_requests_served(s) for s in servers]
    assert main(flags) == 0
    assert all(_requests_served(s) > b for s, b in zip(servers, before))     # spread over both
    rows = [json.loads(line) for line in open(os.path.join(remote, "distill.jsonl"))]
    want = [json.loads(line) for line in open(os.path.join(local, "distill.jsonl"))]
    assert [r["output_ids"] for r in rows] == [w["output_ids"] for w in want]
    assert_same_features(features(remote), features(local))
    # no distillation log: the feature stage captures by prefill, through the servers too
    shutil.rmtree(os.path.join(remote, "features.log"))
    shutil.rmtree(os.path.join(remote, "features"))
    assert main(flags[:-1] + ["features"]) == 0
    assert_same_features(features(remote), features(local))


def test_server_with_other_taps_is_refused(served, capsys):
    root, model, servers, other = served
    pfile = write_prompts(str(root / "p2.jsonl"), PROMPTS[:2])
    flags = data_flags(str(root / "bad"), model, pfile) + ["--stages", "prompts,distill",
                                                           "--target-url", f"{servers[0].url},{other.url}"]
    assert main(flags) == 2
    assert "--hidden-state-layers 0,1" in capsys.readouterr().err
    assert main(flags[:-1] + [servers[0].url, "--tp-size", "2"]) == 2


def test_hidden_state_layers_flag_combinations():
    from sparkserve.args import ServerArgs
    with pytest.raises(ValueError, match="--hidden-state-layers needs --enable-return-hidden-states"):
        ServerArgs(hidden_state_layers=[1], disable_radix_cache=True).validate()
    with pytest.raises(ValueError, match="--hidden-state-layers with --speculative-algorithm"):
        ServerArgs(hidden_state_layers=[1], enable_return_hidden_states=True, disable_radix_cache=True,
                   speculative_algorithm="DSPARK").validate()
    ServerArgs(hidden_state_layers=[1], enable_return_hidden_states=True, disable_radix_cache=True).validate()
