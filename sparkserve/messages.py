"""Messages between the HTTP frontend and the scheduler process (pickled over ZMQ).

frontend -> scheduler (one PUSH/PULL pair, in order):
    GenerateReq       tokenized request, one sequence (n already fanned out)
    AbortReq          drop a request now and free its KV (client gone, /abort_request, shutdown)
    FlushCacheReq     drop the prefix cache (refused while requests run)       -> FlushCacheOut
    LoadReq           current load and KV usage                                -> SchedulerLoad
    ShutdownReq       stop the loop and exit

scheduler -> frontend (a second PUSH/PULL pair):
    SchedulerReady    once, after the model is loaded: the facts requests are checked against
    SchedulerFailed   start-up or step failure (the process exits right after)
    BatchOut          everything one step produced (and aborts since the last step) + load
    FlushCacheOut / SchedulerLoad   replies, matched to the request by `cid`

Only plain data, finish reasons and SamplingParams travel; the frontend never imports torch.
The messages sit below the frontend and the scheduler alike, so neither imports the other."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sparkserve.core.finish_reason import BaseFinishReason
from sparkserve.sampling_params import SamplingParams


# ---- frontend -> scheduler -----------------------------------------------------------------
@dataclass
class Bootstrap:
    """PD disaggregation: where a request's prefill server is and the room (an id both servers
    got from the router) that pairs its two halves."""
    host: str
    port: int
    room: int


@dataclass
class GenerateReq:
    """One sequence to generate, checked and with n fanned out (rid-0, rid-1, ...)."""
    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_hidden_states: bool = False
    index: int = 0              # the choice's index in the HTTP response (frontend bookkeeping)
    prompt_index: int = 0       # which prompt of the request it answers (usage counts each once)
    routed_dp_rank: int | None = None   # DP attention: the group to run it on (None: load balancing)
    bootstrap: Bootstrap | None = None  # PD disaggregation: the pairing the router gave it
    priority: int = 0                   # --enable-priority-scheduling (SGLang's `priority`)


@dataclass
class AbortReq:
    rid: str
    reason: str = "aborted"


@dataclass
class FlushCacheReq:
    cid: int


@dataclass
class LoadReq:
    cid: int


@dataclass
class ShutdownReq:
    pass


# ---- scheduler -> frontend -----------------------------------------------------------------
@dataclass
class SchedulerReady:
    pid: int
    vocab_size: int
    context_length: int
    max_total_num_tokens: int          # KV pool size in tokens (SGLang's name)
    max_running_requests: int
    eos_token_ids: list[int]
    architecture: str
    bos_token_id: int | None = None
    # Most prompt + output tokens one request can reach (Scheduler.max_sequence_tokens): the pool,
    # or unbounded when pages leave a sliding window as the request runs. None: the pool.
    max_sequence_tokens: int | None = None
    speculative: dict[str, Any] | None = None   # DSpark: the resolved draft path, verify mode, gamma
    device: str = "cpu"                          # where the model runs (--device, auto resolved)

    @property
    def sequence_limit(self) -> int:
        return self.max_total_num_tokens if self.max_sequence_tokens is None else self.max_sequence_tokens


@dataclass
class SchedulerFailed:
    message: str
    traceback: str = ""


@dataclass
class SchedulerLoad:
    cid: int = -1                      # -1: attached to a BatchOut, not a reply
    num_running_reqs: int = 0
    num_queue_reqs: int = 0
    num_used_tokens: int = 0           # KV slots held by requests (prefix cache excluded)
    num_cached_tokens: int = 0         # KV slots held only by the prefix cache (evictable)
    max_total_num_tokens: int = 0
    num_retractions: int = 0
    num_preemptions: int = 0           # running requests preempted by higher-priority ones
    spec_accept_hist: dict[int, int] = field(default_factory=dict)   # accepted drafts -> verifies
    # MoE load since start: (token, slot) rows each routed expert got, and per expert-parallel rank
    moe_expert_tokens: list[int] = field(default_factory=list)
    moe_rank_tokens: list[int] = field(default_factory=list)

    @property
    def token_usage(self) -> float:
        return self.num_used_tokens / self.max_total_num_tokens if self.max_total_num_tokens else 0.0


@dataclass
class ReqOutput:
    """New tokens of one request after a scheduler step (empty for a prefill chunk)."""
    rid: str
    new_token_ids: list[int]
    finished_reason: BaseFinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    new_logprobs: list[float] = field(default_factory=list)
    new_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    spec_verify_ct: int = 0            # DSpark verify cycles so far
    spec_draft_token_num: int = 0      # drafts those cycles verified
    spec_accept_token_num: int = 0     # drafts they accepted (bonus tokens not counted, as SGLang)
    # prompt logprobs (logprob_start_len), once, on the first output with tokens or a finish (Req)
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    # return_hidden_states, on the finishing output: rows [position][hidden] (Req.hidden_states)
    hidden_states: list[list[float]] | None = None
    aux_hidden_states: list[list[float]] | None = None


@dataclass
class BatchOut:
    outputs: list[ReqOutput]
    load: SchedulerLoad


@dataclass
class FlushCacheOut:
    cid: int
    success: bool
    message: str = ""
