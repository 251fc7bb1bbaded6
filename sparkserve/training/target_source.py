"""Where distillation and feature capture run the target: an in-process Engine, or running
`sparkserve serve` servers (a GPU serving fleet, a sharded target, a router) reached through
their /generate with return_hidden_states. Both yield the same results: output_ids and, per
position run, meta_info "hidden_states" (final normed) and "aux_hidden_states" (the taps)."""
from __future__ import annotations

import json
import urllib.request
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator, Protocol

import torch


class TargetSource(Protocol):
    model_config: object
    tokenizer: object

    def tap(self, layer_ids: list[int]) -> None:
        """Make (or check) the target return these layers as aux_hidden_states."""

    def run(self, seqs: list[list[int]], params: list[dict]) -> Iterator[dict]:
        """One result per sequence, in order, with its hidden states as float tensors."""

    def head_weight(self) -> torch.Tensor:
        """The target's whole LM head on CPU (the int8 cache's teacher)."""


class EngineTarget:
    """The target in this process (any --tp-size / --pp-size the Engine runs)."""

    def __init__(self, engine, max_in_flight: int):
        self.engine, self.max_in_flight = engine, max_in_flight
        self.model_config, self.tokenizer = engine.model_config, engine.tokenizer

    def tap(self, layer_ids: list[int]) -> None:
        self.engine.scheduler.runner.model.set_aux_layers(layer_ids)

    def run(self, seqs: list[list[int]], params: list[dict]) -> Iterator[dict]:
        return self.engine.generate_many(seqs, params, max_in_flight=self.max_in_flight,
                                         return_hidden_states=True)

    def head_weight(self) -> torch.Tensor:
        from sparkserve.models.dspark_draft import target_vocab_weights
        return target_vocab_weights(self.engine.scheduler.runner.model)["lm_head.weight"].cpu()


class HttpTarget:
    """Servers at `urls`, requests dealt round-robin, up to max_in_flight at once. The servers
    must run the same model as model_config / tokenizer (read locally from --model-path) and tap
    the draft's layers (`serve --hidden-state-layers`), which tap() checks."""

    def __init__(self, urls: list[str], model_config, tokenizer, max_in_flight: int, timeout_s: float = 3600):
        self.urls = [u.rstrip("/") for u in urls]
        self.model_config, self.tokenizer = model_config, tokenizer
        self.max_in_flight, self.timeout_s = max_in_flight, timeout_s

    def tap(self, layer_ids: list[int]) -> None:
        for url in self.urls:
            with urllib.request.urlopen(url + "/server_info", timeout=60) as r:
                info = json.load(r)
            if not info.get("enable_return_hidden_states"):
                raise ValueError(f"--target-url {url}: the server runs without --enable-return-hidden-states")
            if info.get("hidden_state_layers") != list(layer_ids):
                raise ValueError(f"--target-url {url} taps layers {info.get('hidden_state_layers')}, the "
                                 f"draft needs {list(layer_ids)}: start it with --hidden-state-layers "
                                 f"{','.join(map(str, layer_ids))}")
            if info.get("vocab_size") != self.model_config.vocab_size:
                raise ValueError(f"--target-url {url} serves a vocab of {info.get('vocab_size')}, "
                                 f"--model-path has {self.model_config.vocab_size}: not the same model")
        self.layer_ids = list(layer_ids)

    def _post(self, n: int, ids: list[int], params: dict) -> dict:
        body = json.dumps({"input_ids": ids, "sampling_params": params, "return_hidden_states": True})
        req = urllib.request.Request(self.urls[n % len(self.urls)] + "/generate", body.encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
            res = json.load(r)
        meta = res["meta_info"]
        d = self.model_config.hidden_size
        meta["hidden_states"] = torch.tensor(meta["hidden_states"], dtype=torch.float32).view(-1, d)
        aux = torch.tensor(meta["aux_hidden_states"], dtype=torch.float32)
        meta["aux_hidden_states"] = aux.view(-1, len(self.layer_ids) * d)
        return res

    def run(self, seqs: list[list[int]], params: list[dict]) -> Iterator[dict]:
        """Up to max_in_flight requests past the one the consumer waits for: finished answers
        (hidden states are large) never pile up behind a slow one."""
        items = iter(enumerate(zip(seqs, params)))
        pending: deque[Future] = deque()
        with ThreadPoolExecutor(self.max_in_flight) as pool:
            try:
                while True:
                    while len(pending) < self.max_in_flight and (item := next(items, None)) is not None:
                        n, (ids, p) = item
                        pending.append(pool.submit(self._post, n, ids, p))
                    if not pending:
                        return
                    yield pending.popleft().result()
            finally:          # a failure or a consumer that stops early sends nothing more
                for f in pending:
                    f.cancel()
