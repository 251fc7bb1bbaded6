"""ServerArgs: every engine/server option under SGLang's flag names, one validate() that
refuses bad combinations at start-up naming the flags, and the argparse wiring for the CLI."""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from sparkserve.loader.gguf_file import default_model_path


@dataclass
class ServerArgs:
    model_path: str | None = field(default=None, metadata={"help": "HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)"})
    tokenizer_path: str | None = field(default=None, metadata={"help": "tokenizer directory or .gguf (default: the model path)"})
    served_model_name: str | None = field(default=None, metadata={"help": "model name reported by the API (default: the model path)"})
    skip_tokenizer_init: bool = field(default=False, metadata={"help": "no tokenizer: requests must give input_ids"})
    context_length: int | None = field(default=None, metadata={"help": "max prompt + output tokens (default: the model's)"})
    # memory
    max_total_tokens: int | None = field(default=None, metadata={"help": "KV pool size in tokens (overrides --mem-fraction-static)"})
    mem_fraction_static: float = field(default=0.05, metadata={"help": "fraction of RAM for the KV pool on CPU"})
    page_size: int = field(default=1, metadata={"help": "tokens per KV page"})
    disable_radix_cache: bool = field(default=False, metadata={"help": "turn off prefix caching"})
    enable_return_hidden_states: bool = field(default=False, metadata={
        "help": "let requests ask for their final (and tapped aux) hidden states; needs --disable-radix-cache"})
    # scheduling
    max_running_requests: int = field(default=64, metadata={"help": "max requests decoding at once"})
    chunked_prefill_size: int = field(default=512, metadata={"help": "max prompt tokens per prefill step (-1: no chunking)"})
    max_prefill_tokens: int = field(default=8192, metadata={"help": "max tokens in one prefill batch when chunking is off"})
    max_queued_requests: int | None = field(default=None, metadata={"help": "waiting requests beyond which new ones get 503"})
    # runtime
    num_threads: int | None = field(default=None, metadata={"help": "torch CPU threads (default: torch's)"})
    random_seed: int | None = field(default=None, metadata={"help": "seed of the global RNG"})
    # server
    host: str = field(default="127.0.0.1", metadata={"help": "HTTP host"})
    port: int = field(default=30000, metadata={"help": "HTTP port"})
    api_key: str | None = field(default=None, metadata={"help": "require 'Authorization: Bearer KEY' on every endpoint but /health"})
    log_level: str = field(default="info", metadata={"help": "logging level"})
    # speculative decoding
    speculative_algorithm: str | None = field(default=None, metadata={"help": "DSPARK to enable DSpark speculative decoding"})
    speculative_draft_model_path: str | None = field(default=None, metadata={"help": "DSpark draft checkpoint (DeepSpec format); default: the draft shipped for the embedded model"})
    speculative_dspark_block_size: int | None = field(default=None, metadata={"help": "draft block size gamma (default: the checkpoint's block_size)"})
    speculative_dspark_verify_mode: str | None = field(default=None, metadata={"help": "full | threshold | adaptive (default: threshold if a threshold is given, else full)"})
    speculative_dspark_confidence_threshold: float | None = field(default=None, metadata={"help": "verify the leading drafts whose confidence is >= this"})
    speculative_dspark_sps_table_path: str | None = field(default=None, metadata={"help": "step-cost table (JSON) for adaptive verify; measured at start-up if unset"})
    disaggregation_mode: str = field(default="null", metadata={"help": "PD disaggregation role: null (not disaggregated); prefill/decode are not built yet"})
    # parallelism (one process for now; the flags exist so that refusals are explicit)
    tp_size: int = field(default=1, metadata={"help": "tensor parallel size"})
    pp_size: int = field(default=1, metadata={"help": "pipeline parallel size"})
    dp_size: int = field(default=1, metadata={"help": "data parallel size"})

    def __post_init__(self) -> None:
        if self.model_path is None:
            self.model_path = default_model_path()
        if self.tokenizer_path is None:
            self.tokenizer_path = self.model_path
        if self.served_model_name is None:
            self.served_model_name = self.model_path

    def validate(self) -> "ServerArgs":
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(msg)
        need(self.page_size >= 1, f"--page-size must be >= 1, got {self.page_size}")
        need(self.max_running_requests >= 1, f"--max-running-requests must be >= 1, got {self.max_running_requests}")
        need(0 < self.mem_fraction_static < 1, f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}")
        need(self.max_total_tokens is None or self.max_total_tokens >= self.page_size,
             f"--max-total-tokens must be at least one page (--page-size {self.page_size})")
        need(self.chunked_prefill_size != 0, "--chunked-prefill-size must be positive, or -1 to disable chunking")
        need(self.max_queued_requests is None or self.max_queued_requests >= 0,
             "--max-queued-requests must be >= 0")
        if self.speculative_algorithm is not None:
            need(self.speculative_algorithm.upper() == "DSPARK",
                 f"--speculative-algorithm {self.speculative_algorithm}: only DSPARK is supported")
            self.speculative_algorithm = "DSPARK"
            mode = self.speculative_dspark_verify_mode
            need(mode in (None, "full", "threshold", "adaptive"),
                 f"--speculative-dspark-verify-mode {mode}: use full, threshold or adaptive")
            thr = self.speculative_dspark_confidence_threshold
            need(thr is None or 0.0 <= thr <= 1.0,
                 f"--speculative-dspark-confidence-threshold must be in [0, 1], got {thr}")
            need(not (mode == "threshold" and thr is None),
                 "--speculative-dspark-verify-mode threshold needs --speculative-dspark-confidence-threshold")
            need(self.speculative_dspark_block_size is None or self.speculative_dspark_block_size >= 1,
                 "--speculative-dspark-block-size must be >= 1")
        else:
            need(self.speculative_draft_model_path is None,
                 "--speculative-draft-model-path needs --speculative-algorithm DSPARK")
        need(os.path.exists(self.model_path), f"--model-path {self.model_path} does not exist")
        need(not self.enable_return_hidden_states or self.disable_radix_cache,
             "--enable-return-hidden-states needs --disable-radix-cache: a prompt prefix served from the "
             "cache is not recomputed, so it has no hidden states to return")
        need(self.disaggregation_mode == "null",
             f"--disaggregation-mode {self.disaggregation_mode}: PD disaggregation is not built yet; use null")
        need(0 <= self.port <= 65535, f"--port must be in [0, 65535], got {self.port}")
        for name in ("tp_size", "pp_size", "dp_size"):
            need(getattr(self, name) == 1,
                 f"--{name.replace('_', '-')} {getattr(self, name)}: multi-process parallelism is not built yet; "
                 f"run with --{name.replace('_', '-')} 1")
        return self

    # ---- argparse --------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            help_ = f.metadata.get("help", "")
            if f.type in ("bool", bool):
                parser.add_argument(flag, action="store_true", help=help_)
                continue
            typ = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
            parser.add_argument(flag, type=typ, default=f.default, help=help_)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "ServerArgs":
        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
