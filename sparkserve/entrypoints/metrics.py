"""Prometheus metrics of the HTTP server, under SGLang's names (`sglang:` prefix, `model_name`
label) so dashboards and load generators written for SGLang read them unchanged."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from sparkserve.messages import SchedulerLoad

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# SGLang's buckets (metrics/collector.py).
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
         15.0, 20.0, 25.0, 30.0)
_ITL = (0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06, 0.08, 0.1, 0.2,
        0.3, 0.4, 0.5, 0.75, 1.0, 2.0)
_TPOT = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
         0.75, 1.0, 2.5)
_E2E = (0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


class Metrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def gauge(name: str, doc: str):
            return Gauge(name, doc, labels, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str):
            return Counter(name, doc, labels, registry=self.registry).labels(model_name)

        def hist(name: str, doc: str, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        self.num_running = gauge("sglang:num_running_reqs", "The number of running requests")
        self.num_queue = gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue")
        self.num_used_tokens = gauge("sglang:num_used_tokens",
                                     "KV tokens held by requests (the prefix cache excluded)")
        self.token_usage = gauge("sglang:token_usage", "KV pool usage by requests, 0..1")
        self.cached_pool_tokens = gauge("sglang:num_prefix_cache_tokens",
                                        "KV tokens held only by the prefix cache (evictable)")
        self.max_total_num_tokens = gauge("sglang:max_total_num_tokens", "KV pool size in tokens")
        self.num_retractions = gauge("sglang:num_retracted_reqs", "Requests retracted for memory so far")
        self.prompt_tokens = counter("sglang:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("sglang:generation_tokens", "Number of generation tokens processed.")
        self.cached_tokens = counter("sglang:cached_tokens", "Prompt tokens served from the prefix cache")
        self.requests = counter("sglang:num_requests", "Number of requests finished")
        self.aborted = counter("sglang:num_aborted_requests", "Number of requests aborted")
        self.rejected = counter("sglang:num_rejected_requests", "Requests refused with 503 (queue full)")
        self.spec_accept_length = gauge("sglang:spec_accept_length",
                                        "Mean tokens committed per speculative verify (bonus included)")
        self.spec_verify_ct = gauge("sglang:spec_verify_count", "Speculative verify cycles so far")
        self.spec_accept_hist = Gauge("sparkserve:spec_accepted_drafts", "Verify cycles by accepted drafts",
                                      ["model_name", "accepted"], registry=self.registry)
        self.moe_expert_tokens = Gauge("sparkserve:moe_expert_tokens",
                                       "Tokens routed to each MoE expert since start, summed over the layers",
                                       ["model_name", "expert"], registry=self.registry)
        self.moe_rank_tokens = Gauge("sparkserve:moe_rank_tokens",
                                     "Tokens routed to each expert-parallel rank's experts since start",
                                     ["model_name", "ep_rank"], registry=self.registry)
        self._model_name = model_name
        self.ttft = hist("sglang:time_to_first_token_seconds",
                         "Histogram of time to first token in seconds.", _TTFT)
        self.itl = hist("sglang:inter_token_latency_seconds",
                        "Histogram of inter-token latency in seconds.", _ITL)
        self.tpot = hist("sglang:time_per_output_token_seconds",
                         "Histogram of time per output token in seconds.", _TPOT)
        self.e2e = hist("sglang:e2e_request_latency_seconds",
                        "Histogram of End-to-end request latency in seconds", _E2E)

    def set_load(self, load: SchedulerLoad) -> None:
        self.num_running.set(load.num_running_reqs)
        self.num_queue.set(load.num_queue_reqs)
        self.num_used_tokens.set(load.num_used_tokens)
        self.token_usage.set(load.token_usage)
        self.cached_pool_tokens.set(load.num_cached_tokens)
        self.max_total_num_tokens.set(load.max_total_num_tokens)
        self.num_retractions.set(load.num_retractions)
        hist = load.spec_accept_hist
        if hist:
            cycles = sum(hist.values())
            self.spec_verify_ct.set(cycles)
            self.spec_accept_length.set(sum((k + 1) * v for k, v in hist.items()) / cycles)
            for k, v in hist.items():
                self.spec_accept_hist.labels(self._model_name, str(k)).set(v)
        for e, n in enumerate(load.moe_expert_tokens):
            self.moe_expert_tokens.labels(self._model_name, str(e)).set(n)
        for r, n in enumerate(load.moe_rank_tokens):
            self.moe_rank_tokens.labels(self._model_name, str(r)).set(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
