"""When the frontend sees a stop string before the scheduler does (its text decodes the whole output,
the scheduler only a tail), the finish reason names the stop string that matched (SGLang's
`matched_stop`), not the first one listed. A scheduler link that answers with the tokens of a fixed
text and no finish stands in for the scheduler; the real SmolLM2 tokenizer decodes them."""
from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from sparkserve.args import ServerArgs
from sparkserve.entrypoints.http_server import create_app
from sparkserve.entrypoints.metrics import Metrics
from sparkserve.entrypoints.tokenizer_manager import TokenizerManager
from sparkserve.frontend.tokenizer import load_tokenizer_for
from sparkserve.messages import AbortReq, BatchOut, GenerateReq, ReqOutput, SchedulerLoad, SchedulerReady

TEXT = "Hello world. The end of the story."


class UnfinishedAnswer:
    """Answers each GenerateReq with TEXT's tokens, unfinished (the scheduler saw no stop)."""

    def __init__(self) -> None:
        args = ServerArgs().validate()
        self.tokenizer = load_tokenizer_for(args)
        ready = SchedulerReady(pid=0, vocab_size=49152, context_length=512, max_total_num_tokens=2048,
                               max_running_requests=8, eos_token_ids=[2], architecture="LlamaForCausalLM")
        self.tm = TokenizerManager(args, self.tokenizer, ready, self, None, Metrics("m"), lambda: None)
        self.client = TestClient(create_app(args, self.tm), raise_server_exceptions=False)
        self.aborted: list[str] = []

    def send_pyobj(self, msg, *a) -> None:
        if isinstance(msg, GenerateReq):
            ids = self.tokenizer.encode(TEXT, add_special_tokens=False)
            self.tm._on_batch(BatchOut([ReqOutput(msg.rid, ids, None, len(msg.input_ids), len(ids), 0)],
                                       SchedulerLoad()))
        elif isinstance(msg, AbortReq):
            self.aborted.append(msg.rid)


@pytest.fixture(scope="module")
def link() -> UnfinishedAnswer:
    return UnfinishedAnswer()


@pytest.mark.parametrize("stops,matched", [(["story", "world"], "world"), (["never", "end"], "end"),
                                           (["The end", "The"], "The end")])
def test_the_matched_stop_string_is_reported(link, stops, matched):
    r = link.client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 64,
                                                                             "stop": stops}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": matched}
    assert body["text"] == TEXT[:TEXT.index(matched)]
    assert link.aborted                     # the scheduler is told to stop the request
    chat = link.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 64, "stop": stops})
    assert chat.status_code == 200 and chat.json()["choices"][0]["finish_reason"] == "stop"
