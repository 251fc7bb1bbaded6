"""ServerArgs: every engine/server option under SGLang's flag names, one validate() that
refuses bad combinations at start-up naming the flags, and the CLI flags generated from the fields."""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from sparkserve.addresses import check_rendezvous_ip, is_loopback, split_host_port
from sparkserve.dataclass_cli import add_dataclass_args, dataclass_from_args
from sparkserve.embedded import EMBEDDED_NAME, default_model_path, is_embedded, shipped_draft_path
from sparkserve.parallel_config import ParallelConfig
from sparkserve.priority_args import DEFAULT_PREEMPTION_THRESHOLD, validate_priority
from sparkserve.speculative_args import NGRAM_FLAGS, PLANNER_MODES, SpeculativeArgs

LOG_LEVELS = ("debug", "info", "warning", "error")
GRAMMAR_BACKENDS = ("llguidance", "xgrammar", "none")    # as SGLang's --grammar-backend
LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue")
# SGLang's --moe-a2a-backend values taken; a2a: torch.distributed all-to-all (DeepEP-style dispatch /
# combine), which SGLang's `deepep` names (an alias: DeepEP's kernels are GPU-only)
MOE_A2A_BACKENDS = ("none", "a2a", "deepep")
MOE_A2A_ALIASES = {"deepep": "a2a"}
DISAGGREGATION_MODES = ("null", "prefill", "decode")
TRANSFER_BACKENDS = ("tcp", "nixl", "mooncake")
MIN_SECRET_BYTES = 16        # a PD auth secret shorter than this is guessed too easily
ACTIVATION_QUANTS = ("int8", "none")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2")
DEVICES = ("auto", "cpu", "cuda")
# names of frontend/tool_parsers and frontend/reasoning_parser (test_tool_parsers checks they agree)
TOOL_CALL_PARSERS = ("hermes", "qwen25", "llama3", "mistral", "deepseekv3", "deepseekv31", "gpt-oss")
REASONING_PARSERS = ("deepseek-r1", "qwen3", "gpt-oss")


def _opt(help_: str, **meta: Any) -> dict[str, Any]:
    return {"help": help_, **meta}


@dataclass
class ServerArgs(SpeculativeArgs):
    model_path: str | None = field(default=None, metadata=_opt(
        "HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)"))
    tokenizer_path: str | None = field(default=None, metadata=_opt(
        "tokenizer directory or .gguf (default: the model path)"))
    served_model_name: str | None = field(default=None, metadata=_opt(
        f"model name the API reports (default: {EMBEDDED_NAME} for the embedded model, else the model "
        "path); 'default' is accepted as an alias", server_only=True))
    skip_tokenizer_init: bool = field(default=False, metadata=_opt(
        "no tokenizer: requests must give input_ids", server_only=True))
    context_length: int | None = field(default=None, metadata=_opt(
        "max prompt + output tokens (default: the model's)"))
    # chat API
    chat_template: str | None = field(default=None, metadata=_opt(
        "chat template for /v1/chat/completions: a Jinja file, or the template itself (default: the "
        "tokenizer's)", server_only=True))
    tool_call_parser: str | None = field(default=None, metadata=_opt(
        "format of the model's tool calls: parse them into message.tool_calls (needed for tools with "
        "tool_choice auto)", choices=TOOL_CALL_PARSERS, server_only=True))
    reasoning_parser: str | None = field(default=None, metadata=_opt(
        "format of the model's thinking (<think>...</think>; gpt-oss: the analysis channel) for "
        "message.reasoning_content",
        choices=REASONING_PARSERS, server_only=True))
    # memory
    max_total_tokens: int | None = field(default=None, metadata=_opt(
        "KV pool size in tokens (overrides --mem-fraction-static)"))
    mem_fraction_static: float = field(default=0.05, metadata=_opt(
        "fraction of the machine's RAM (of the GPU's memory on --device cuda) for the KV pool"))
    page_size: int = field(default=1, metadata=_opt("tokens per KV page"))
    disable_radix_cache: bool = field(default=False, metadata=_opt("turn off prefix caching"))
    enable_return_hidden_states: bool = field(default=False, metadata=_opt(
        "let requests ask for their final (and tapped aux) hidden states; needs --disable-radix-cache",
        server_only=True))
    # A target serving draft-training data (train-draft --target-url) taps the draft's layers
    # without a draft of its own; a DSpark server returns its draft's taps instead.
    hidden_state_layers: list[int] | None = field(default=None, metadata=_opt(
        "comma-separated layers whose outputs return_hidden_states returns as aux_hidden_states "
        "(train-draft --target-layer-ids); needs --enable-return-hidden-states, not with "
        "--speculative-algorithm (its draft's taps are returned)"))
    # scheduling
    max_running_requests: int = field(default=64, metadata=_opt("max requests decoding at once"))
    chunked_prefill_size: int = field(default=512, metadata=_opt(
        "max prompt tokens per prefill step (-1: no chunking)"))
    max_prefill_tokens: int = field(default=8192, metadata=_opt(
        "max tokens in one prefill batch when chunking is off"))
    enable_mixed_chunk: bool = field(default=False, metadata=_opt(
        "run the decoding requests' next tokens in the same forward as a prefill batch, so they do not "
        "stall while prompts prefill (the batch's prompt tokens shrink by as many); not with "
        "--speculative-algorithm"))
    decode_log_interval: int = field(default=40, metadata=_opt("log one decode batch in this many steps"))
    max_queued_requests: int | None = field(default=None, metadata=_opt(
        "waiting requests beyond which new ones get 503 (default: no limit)", server_only=True))
    enable_priority_scheduling: bool = field(default=False, metadata=_opt(
        "admit waiting requests by their `priority` field (SGLang's; higher values first unless "
        "--schedule-low-priority-values-first; equal ones first come, first served). Without it a "
        "request with a priority other than 0 is refused (400)"))
    schedule_low_priority_values_first: bool = field(default=False, metadata=_opt(
        "with --enable-priority-scheduling: lower priority values go first"))
    disable_priority_preemption: bool = field(default=False, metadata=_opt(
        "with --enable-priority-scheduling: never preempt a running request for a waiting one of "
        "higher priority (by default one that outranks it by more than the threshold does)"))
    priority_scheduling_preemption_threshold: int | None = field(default=None, metadata=_opt(
        "with --enable-priority-scheduling: a waiting request preempts a running one (its KV kept in "
        "the prefix cache, it resumes later where it stopped) when its priority beats the running "
        f"one's by more than this (default {DEFAULT_PREEMPTION_THRESHOLD}, SGLang's; >= 0)"))
    # runtime
    activation_quant: str = field(default="int8", metadata=_opt(
        "activations of layers with quantized (GGUF) weights on CPU: int8 (default, as llama.cpp and "
        "vLLM's GGUF kernels) quantizes them per block of 32 for integer dot products (several times "
        "faster; logits move slightly, perplexity +0.3-1.0%% on SmolLM2: docs/kernel-notes.md); none "
        "keeps fp32 activations (exact). Other weights always run fp32 activations",
        choices=ACTIVATION_QUANTS))
    kv_cache_dtype: str = field(default="auto", metadata=_opt(
        "what the KV pool stores: float16 or bfloat16 halve the pool's bytes per token (twice the "
        "tokens in the same memory, half the bytes a decode step's attention reads), rounding each "
        "K/V value once; float32 keeps the compute dtype. auto: float16 for a GGUF checkpoint of a "
        "Llama-family model (llama.cpp's default cache for the same file), else float32 (the "
        "model's compute dtype on CPU, as vLLM and SGLang keep the model's). int8 / fp8_e4m3 / "
        "fp8_e5m2 store each K/V value in one byte with a float16 scale per block of 32 of a head's "
        "row (llama.cpp's q8_0 cache): ~3.8x float32's tokens in the same memory. Half and quantized "
        "types: Llama-family models; quantized also the MLA latents (DeepSeek-V2, Kimi-Linear) and "
        "MiniMax-M3", choices=KV_CACHE_DTYPES))
    device: str = field(default="auto", metadata=_opt(
        "where the model, its pools and the forward run: cpu (this project's own kernels) or cuda (torch's "
        "kernels, fp32 weights dequantized from GGUF); auto: cuda when torch sees a GPU, else cpu",
        choices=DEVICES))
    num_threads: int | None = field(default=None, metadata=_opt("torch CPU threads (default: torch's)"))
    random_seed: int | None = field(default=None, metadata=_opt("seed of the global RNG"))
    disable_native_step: bool = field(default=False, metadata=_opt(
        "run every forward layer by layer from Python instead of one native call per small forward "
        "(decode, verify) of a Llama-family model: for debugging and comparison"))
    disable_huge_pages: bool = field(default=False, metadata=_opt(
        "hold the CPU weights in ordinary 4 KiB pages instead of 2 MiB transparent huge pages (Linux, "
        "where THP is madvise or always): for comparison"))
    # server
    host: str = field(default="127.0.0.1", metadata=_opt("HTTP host", server_only=True))
    port: int = field(default=30000, metadata=_opt("HTTP port", server_only=True))
    api_key: str | None = field(default=None, metadata=_opt(
        "require 'Authorization: Bearer KEY' on every endpoint but /health", server_only=True))
    log_level: str = field(default="info", metadata=_opt("logging level", choices=LOG_LEVELS))
    allowed_origins: list[str] | None = field(default=None, metadata=_opt(
        "comma-separated origins whose browser pages may call the API (CORS; '*': any); default: none",
        server_only=True))
    request_timeout: float | None = field(default=None, metadata=_opt(
        "seconds after which a request still running is aborted (a 504; a stream ends with a 504 "
        "error event) and its KV freed; default: none", server_only=True))
    # constrained decoding
    grammar_backend: str = field(default="llguidance", metadata=_opt(
        "grammar engine of json_schema / regex / ebnf and response_format (none: refuse them)",
        choices=GRAMMAR_BACKENDS))
    # speculative decoding
    speculative_algorithm: str | None = field(default=None, metadata=_opt(
        "DSPARK: DSpark speculative decoding (a draft model); NGRAM: drafts copied from the request's own "
        "prompt and output where its latest tokens occurred before (no draft model)"))
    speculative_draft_model_path: str | None = field(default=None, metadata=_opt(
        "DSpark draft checkpoint (DeepSpec format) (default: the draft shipped for the embedded model)"))
    speculative_dspark_block_size: int | None = field(default=None, metadata=_opt(
        "draft block size gamma (default: the checkpoint's block_size)"))
    speculative_dspark_verify_mode: str | None = field(default=None, metadata=_opt(
        "which drafts to verify: full (all), threshold, adaptive (those that pay, by the step costs measured "
        "at start-up; never slower than plain decoding) (default: threshold if a threshold is given, else "
        "adaptive)",
        choices=PLANNER_MODES))
    speculative_dspark_confidence_threshold: float | None = field(default=None, metadata=_opt(
        "verify the leading drafts whose confidence is >= this"))
    speculative_dspark_sps_table_path: str | None = field(default=None, metadata=_opt(
        "step-cost table (JSON) for adaptive verify: {tokens, seconds} of one request's forwards, "
        "optionally {requests, request_seconds} of decode steps and draft_seconds (default: measured at "
        "start-up)"))
    # parallelism: one process per rank, on torch.distributed
    tp_size: int = field(default=1, metadata=_opt("tensor parallel size (Llama-family models so far)"))
    pp_size: int = field(default=1, metadata=_opt("pipeline parallel size (stages of contiguous layers)"))
    pp_layer_partition: list[int] | None = field(default=None, metadata=_opt(
        "comma-separated layer counts per pipeline stage (default: as even as they split)"))
    pp_micro_batches: int = field(default=0, metadata=_opt(
        "micro-batches a pipeline step splits its requests into, so the stages overlap (0: one per stage)"))
    pp_micro_batch_min_tokens: int = field(default=64, metadata=_opt(
        "fewest tokens a pipeline micro-batch keeps; smaller steps run whole (a step of few tokens is bound "
        "by reading the stage's weights, which every micro-batch reads again)"))
    ep_size: int = field(default=1, metadata=_opt(
        "expert parallel size: MoE models' routed experts split over each tensor-parallel group (--tp-size); "
        "1: every rank holds a slice of every expert's width (TP MoE)"))
    moe_a2a_backend: str = field(default="none", metadata=_opt(
        "how MoE layers meet their experts under --ep-size: none (every rank routes every token, one "
        "all-reduce) or a2a (each rank routes its own tokens, dispatched to and combined back from the ranks "
        "owning their experts with all-to-alls); deepep (SGLang's name) runs a2a", choices=MOE_A2A_BACKENDS))
    dp_size: int = field(default=1, metadata=_opt(
        "data parallel size: with --enable-dp-attention, attention groups of --tp-size / --dp-size ranks"))
    enable_dp_attention: bool = field(default=False, metadata=_opt(
        "run attention data parallel: each of --dp-size groups of the tp ranks schedules its own requests "
        "with its own KV pool and prefix cache; the MLP/MoE runs over every group's tokens"))
    enable_dp_lm_head: bool = field(default=False, metadata=_opt(
        "the LM head split over each attention group's ranks (with DP attention this is how sparkserve "
        "always runs it; accepted for SGLang compatibility)"))
    attn_cp_size: int = field(default=1, metadata=_opt(
        "context parallel size of attention: long prefills split by tokens (zigzag) over this many ranks of "
        "each attention group (--tp-size / --dp-size ranks)"))
    load_balance_method: str = field(default="round_robin", metadata=_opt(
        "how DP attention assigns a request to a group (unless the request names routed_dp_rank)",
        choices=LOAD_BALANCE_METHODS))
    nnodes: int = field(default=1, metadata=_opt("machines the ranks run on"))
    node_rank: int = field(default=0, metadata=_opt(
        "this machine's index; nodes above 0 run their ranks only (node 0 serves)"))
    dist_init_addr: str | None = field(default=None, metadata=_opt(
        "HOST:PORT where the ranks meet (default with one node: a free port on 127.0.0.1)"))
    dist_timeout: float = field(default=300.0, metadata=_opt(
        "seconds the ranks wait for each other to join, and a collective for a rank, before the server "
        "fails"))
    dist_socket_ifname: str | None = field(default=None, metadata=_opt(
        "network interface the ranks of this node talk over (as GLOO_SOCKET_IFNAME; default: that "
        "variable, else the interface whose route leads to --dist-init-addr)"))
    dist_allow_public_bind: bool = field(default=False, metadata=_opt(
        "allow --dist-init-addr on a wildcard or globally routable address: the ranks' rendezvous trusts "
        "every peer that reaches it (pickled control messages), so only on a firewalled network"))
    # prefill/decode disaggregation
    disaggregation_mode: str = field(default="null", metadata=_opt(
        "prefill: run prompts and send their state to decode servers; decode: take that state and "
        "generate; null: both here", choices=DISAGGREGATION_MODES, server_only=True))
    disaggregation_bootstrap_port: int = field(default=8998, metadata=_opt(
        "port of a prefill server's bootstrap service, where decode servers ask for requests' state",
        server_only=True))
    disaggregation_transfer_backend: str = field(default="tcp", metadata=_opt(
        "how request state moves between the servers", choices=TRANSFER_BACKENDS, server_only=True))
    disaggregation_bootstrap_timeout: float = field(default=60.0, metadata=_opt(
        "seconds one side waits for the other (the decode side's reservation, the prefill side's "
        "state) before the request fails", server_only=True))
    disaggregation_bootstrap_host: str | None = field(default=None, metadata=_opt(
        "address a prefill server's bootstrap service listens on (default: --host); an address other "
        "machines reach needs --disaggregation-auth-key-file", server_only=True))
    disaggregation_auth_key_file: str | None = field(default=None, metadata=_opt(
        "file holding a secret every prefill and decode server of the deployment shares (for example "
        "`openssl rand -hex 32`): their control channel is then authenticated and encrypted (CurveZMQ)",
        server_only=True))
    disaggregation_auth_key: str | None = field(default=None, metadata=_opt(
        "that secret itself (other users of the machine can read a process's flags: prefer "
        "--disaggregation-auth-key-file)", server_only=True))

    def __post_init__(self) -> None:
        if self.model_path is None:
            self.model_path = default_model_path()
        if self.tokenizer_path is None:
            self.tokenizer_path = self.model_path
        if self.served_model_name is None:
            self.served_model_name = EMBEDDED_NAME if is_embedded(self.model_path) else self.model_path

    @property
    def bootstrap_host(self) -> str:
        """Where a prefill server's bootstrap service listens: its flag, else the HTTP host."""
        return self.disaggregation_bootstrap_host or self.host

    def disaggregation_secret(self) -> bytes | None:
        """The secret PD peers share, from --disaggregation-auth-key-file or --disaggregation-auth-key
        (None: none given); a start-up error when it cannot be read or is short enough to guess."""
        if self.disaggregation_auth_key_file is not None:
            flag = "--disaggregation-auth-key-file"
            try:
                with open(self.disaggregation_auth_key_file, "rb") as f:
                    raw = f.read().strip()
            except OSError as e:
                raise ValueError(f"{flag} {self.disaggregation_auth_key_file}: cannot read it "
                                 f"({e.strerror})") from None
        elif self.disaggregation_auth_key is not None:
            flag, raw = "--disaggregation-auth-key", self.disaggregation_auth_key.encode()
        else:
            return None
        if len(raw) < MIN_SECRET_BYTES:
            raise ValueError(f"{flag}: give a secret of at least {MIN_SECRET_BYTES} characters (for example "
                             "`openssl rand -hex 32`), the same on every prefill and decode server")
        return raw

    @property
    def verify_mode(self) -> str:
        """The DSpark verify mode in force (threshold when only a threshold is given; else adaptive,
        the mode that never loses to plain decoding)."""
        if self.speculative_dspark_verify_mode:
            return self.speculative_dspark_verify_mode
        return "threshold" if self.speculative_dspark_confidence_threshold is not None else "adaptive"

    def _validate_grammar_backend(self, need) -> None:
        name = self.grammar_backend
        need(name in GRAMMAR_BACKENDS, f"--grammar-backend {name}: use one of {', '.join(GRAMMAR_BACKENDS)}")
        # SGLang's name, refused by its reason: xgrammar's Linux x86-64 wheel requires triton (a GPU
        # compiler this CPU server never installs); llguidance serves every constraint xgrammar would
        need(name != "xgrammar", "--grammar-backend xgrammar: not offered (xgrammar's Linux wheel requires "
                                 "triton); use --grammar-backend llguidance (the default), which serves "
                                 "the same json_schema / regex / ebnf / structural_tag")

    def validate(self) -> "ServerArgs":
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(msg)
        need(self.page_size >= 1, f"--page-size must be >= 1, got {self.page_size}")
        need(self.max_running_requests >= 1,
             f"--max-running-requests must be >= 1, got {self.max_running_requests}")
        need(0 < self.mem_fraction_static < 1,
             f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}")
        need(self.max_total_tokens is None or self.max_total_tokens >= self.page_size,
             f"--max-total-tokens must be at least one page (--page-size {self.page_size})")
        need(self.chunked_prefill_size != 0,
             "--chunked-prefill-size must be positive, or -1 to disable chunking")
        need(self.max_queued_requests is None or self.max_queued_requests >= 0,
             "--max-queued-requests must be >= 0")
        need(self.request_timeout is None or self.request_timeout > 0,
             f"--request-timeout must be > 0 seconds, got {self.request_timeout}")
        validate_priority(self, need)
        need(self.activation_quant in ACTIVATION_QUANTS,
             f"--activation-quant {self.activation_quant}: use one of {', '.join(ACTIVATION_QUANTS)}")
        need(self.kv_cache_dtype in KV_CACHE_DTYPES,
             f"--kv-cache-dtype {self.kv_cache_dtype}: use one of {', '.join(KV_CACHE_DTYPES)}")
        need(self.device in DEVICES, f"--device {self.device}: use one of {', '.join(DEVICES)}")
        self._validate_grammar_backend(need)
        need(self.log_level.lower() in LOG_LEVELS,
             f"--log-level {self.log_level}: use one of {', '.join(LOG_LEVELS)}")
        need(os.path.exists(self.model_path), f"--model-path {self.model_path} does not exist")
        self._validate_chat(need)
        if self.speculative_algorithm is not None:
            self._validate_speculative(need)
        else:
            need(self.speculative_draft_model_path is None,
                 "--speculative-draft-model-path needs --speculative-algorithm DSPARK")
            self._refuse_flags(need, NGRAM_FLAGS, "needs --speculative-algorithm NGRAM")
        need(not self.enable_return_hidden_states or self.disable_radix_cache,
             "--enable-return-hidden-states needs --disable-radix-cache: a prompt prefix served from the "
             "cache is not recomputed, so it has no hidden states to return")
        need(self.hidden_state_layers is None or self.enable_return_hidden_states,
             "--hidden-state-layers needs --enable-return-hidden-states")
        need(not (self.enable_mixed_chunk and self.speculative_algorithm),
             "--enable-mixed-chunk with --speculative-algorithm: a verify step does not share a forward with "
             "a prefill batch; drop one of the two flags")
        need(self.hidden_state_layers is None or self.speculative_algorithm in (None, "NGRAM"),
             "--hidden-state-layers with --speculative-algorithm DSPARK: a DSpark target taps its draft's "
             "layers (NGRAM taps none)")
        need(0 <= self.port <= 65535, f"--port must be in [0, 65535], got {self.port}")
        self._validate_parallel(need)
        self._validate_disaggregation(need)
        self._validate_cuda(need)
        return self

    def _validate_cuda(self, need) -> None:
        reason = self.cuda_refusal()
        need(self.device != "cuda" or reason is None, f"--device cuda {reason}")

    def cuda_refusal(self) -> str | None:
        """Why these flags cannot run on CUDA (None: they can). What runs there so far is one rank,
        plain or DSpark decoding; the collectives (gloo) and the PD transfer backends move CPU
        tensors. --device auto falls back to cpu for the same reasons."""
        if self.parallel_config().world_size > 1 or self.enable_dp_attention:
            return (f"with --tp-size {self.tp_size} --pp-size {self.pp_size}"
                    f"{' --enable-dp-attention' if self.enable_dp_attention else ''}: parallel ranks run on "
                    "CPU (gloo) so far; use one rank on the GPU, or --device cpu")
        if self.disaggregation_mode != "null":
            return (f"with --disaggregation-mode {self.disaggregation_mode}: the transfer backends move CPU "
                    "pools so far; use --device cpu for disaggregated serving")
        return None

    def _validate_disaggregation(self, need) -> None:
        mode = self.disaggregation_mode
        need(mode in DISAGGREGATION_MODES,
             f"--disaggregation-mode {mode}: use one of {', '.join(DISAGGREGATION_MODES)}")
        need(self.disaggregation_transfer_backend in TRANSFER_BACKENDS,
             f"--disaggregation-transfer-backend {self.disaggregation_transfer_backend}: use one of "
             f"{', '.join(TRANSFER_BACKENDS)}")
        need(0 < self.disaggregation_bootstrap_port <= 65535,
             f"--disaggregation-bootstrap-port must be in [1, 65535], got "
             f"{self.disaggregation_bootstrap_port}")
        need(self.disaggregation_bootstrap_timeout > 0,
             f"--disaggregation-bootstrap-timeout must be positive, got "
             f"{self.disaggregation_bootstrap_timeout}")
        need(self.disaggregation_auth_key is None or self.disaggregation_auth_key_file is None,
             "--disaggregation-auth-key with --disaggregation-auth-key-file: give one of the two")
        if mode == "null":
            return
        self.disaggregation_secret()
        host = self.bootstrap_host
        need(mode != "prefill" or self.disaggregation_auth_key is not None
             or self.disaggregation_auth_key_file is not None or is_loopback(host),
             f"--disaggregation-bootstrap-host {host}: decode servers on other machines could reach this "
             "prefill server's bootstrap port, so its peers must prove a shared secret: give every prefill "
             "and decode server the same --disaggregation-auth-key-file (or listen on 127.0.0.1)")
        need(not self.enable_dp_attention and self.attn_cp_size == 1,
             f"--disaggregation-mode {mode} with --enable-dp-attention or --attn-cp-size: not supported yet; "
             "use --tp-size / --pp-size (the two sides may differ)")
        world = self.parallel_config().world_size
        need(world == 1 or self.disaggregation_transfer_backend == "tcp",
             f"--disaggregation-transfer-backend {self.disaggregation_transfer_backend} with --tp-size "
             f"{self.tp_size} --pp-size {self.pp_size}: registered-memory backends move one rank's pools; "
             "use --disaggregation-transfer-backend tcp, which gathers every rank's rows")

    def _validate_parallel(self, need) -> None:
        need(self.tp_size >= 1, f"--tp-size must be >= 1, got {self.tp_size}")
        need(self.pp_size >= 1, f"--pp-size must be >= 1, got {self.pp_size}")
        need(self.pp_micro_batch_min_tokens >= 1, f"--pp-micro-batch-min-tokens must be >= 1, got "
                                                  f"{self.pp_micro_batch_min_tokens}")
        need(self.pp_micro_batches >= 0, f"--pp-micro-batches must be >= 0 (0: one per stage), got "
                                         f"{self.pp_micro_batches}")
        self._validate_dp_attention(need)
        need(self.ep_size in (1, self.tp_size),
             f"--ep-size {self.ep_size}: experts split over a tensor-parallel group; use 1 or --tp-size "
             f"({self.tp_size})")
        need(self.moe_a2a_backend in MOE_A2A_BACKENDS,
             f"--moe-a2a-backend {self.moe_a2a_backend}: use one of {', '.join(MOE_A2A_BACKENDS)} "
             "(deepep runs sparkserve's a2a backend)")
        need(self.moe_a2a_backend == "none" or self.ep_size > 1,
             f"--moe-a2a-backend {self.moe_a2a_backend} dispatches tokens to the ranks owning their experts; "
             f"give --ep-size {max(2, self.tp_size)} (= --tp-size) as well")
        need(self.pp_layer_partition is None or len(self.pp_layer_partition) == self.pp_size,
             f"--pp-layer-partition needs one layer count per stage (--pp-size {self.pp_size})")
        world = self.parallel_config().world_size
        need(self.nnodes >= 1 and world % self.nnodes == 0,
             f"--nnodes {self.nnodes}: the {world} ranks (--tp-size x --pp-size) must spread evenly over "
             "the nodes")
        need(0 <= self.node_rank < self.nnodes, f"--node-rank {self.node_rank}: must be in [0, --nnodes)")
        need(self.nnodes == 1 or self.dist_init_addr is not None,
             "--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address, reachable from every node)")
        need(self.dist_timeout > 0, f"--dist-timeout must be positive, got {self.dist_timeout}")
        if self.dist_init_addr is not None:     # a name is checked once resolved, in init_distributed
            host, _ = split_host_port(self.dist_init_addr)
            check_rendezvous_ip(host, host, self.dist_allow_public_bind)

    def _validate_chat(self, need) -> None:
        need(self.tool_call_parser in (None, *TOOL_CALL_PARSERS),
             f"--tool-call-parser {self.tool_call_parser}: use one of {', '.join(TOOL_CALL_PARSERS)}")
        need(self.reasoning_parser in (None, *REASONING_PARSERS),
             f"--reasoning-parser {self.reasoning_parser}: use one of {', '.join(REASONING_PARSERS)}")
        t = self.chat_template
        need(t is None or "{" in t or os.path.isfile(t),
             f"--chat-template {t}: no such file (give a Jinja file or the template itself)")

    def _validate_dp_attention(self, need) -> None:
        need(self.dp_size >= 1, f"--dp-size must be >= 1, got {self.dp_size}")
        need(self.dp_size == 1 or self.enable_dp_attention,
             f"--dp-size {self.dp_size} without --enable-dp-attention (whole replicas): run {self.dp_size} "
             "servers behind a router, or add --enable-dp-attention")
        need(not self.enable_dp_lm_head or self.enable_dp_attention,
             "--enable-dp-lm-head needs --enable-dp-attention")
        need(self.load_balance_method in LOAD_BALANCE_METHODS,
             f"--load-balance-method {self.load_balance_method}: use one of "
             f"{', '.join(LOAD_BALANCE_METHODS)}")
        cp = self.attn_cp_size
        need(cp >= 1, f"--attn-cp-size must be >= 1, got {cp}")
        if not self.enable_dp_attention and cp == 1:
            return
        dp = self.dp_size if self.enable_dp_attention else 1
        need(self.tp_size % (dp * cp) == 0,
             f"--tp-size {self.tp_size} must be a multiple of --dp-size {dp} x --attn-cp-size {cp} (each "
             "attention group takes --tp-size / --dp-size ranks, which --attn-cp-size splits)")
        need(cp == 1 or self.tp_size == dp * cp,
             f"--attn-cp-size {cp} with attention heads split too (--tp-size {self.tp_size} > --dp-size {dp} "
             f"x --attn-cp-size {cp}): not supported; give --tp-size {dp * cp}")
        flag = "--enable-dp-attention" if cp == 1 else "--attn-cp-size"
        need(self.pp_size == 1, f"{flag} with --pp-size {self.pp_size}: not supported; use --pp-size 1")

    def parallel_config(self) -> ParallelConfig:
        partition = tuple(self.pp_layer_partition) if self.pp_layer_partition else None
        return ParallelConfig(self.tp_size, self.pp_size, self.nnodes, self.node_rank, partition,
                              self.ep_size, self.dp_size if self.enable_dp_attention else 1,
                              self.attn_cp_size, self.dist_socket_ifname, self.dist_allow_public_bind,
                              self.moe_a2a_backend_run)

    @property
    def moe_a2a_backend_run(self) -> str:
        """The MoE backend that runs for --moe-a2a-backend (an alias resolved: deepep -> a2a)."""
        return MOE_A2A_ALIASES.get(self.moe_a2a_backend, self.moe_a2a_backend)

    def _validate_dspark(self, need) -> None:
        """DSpark flags, and the draft checked before any model loads (a one-line error, not a
        traceback after the target's load)."""
        self.speculative_algorithm = "DSPARK"
        self._validate_planner(need)
        need(self.speculative_dspark_block_size is None or self.speculative_dspark_block_size >= 1,
             "--speculative-dspark-block-size must be >= 1")
        if self.speculative_draft_model_path is None:
            self.speculative_draft_model_path = shipped_draft_path(self.model_path)
        path = self.speculative_draft_model_path
        need(os.path.isfile(os.path.join(path, "config.json")),
             f"--speculative-draft-model-path {path}: not a draft checkpoint directory "
             "(no config.json there)")

    # ---- argparse --------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, server: bool = True) -> None:
        """The flags of every field; `server=False` leaves out those only a server uses."""
        add_dataclass_args(parser, cls, skip=lambda f: not server and f.metadata.get("server_only", False))

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "ServerArgs":
        return dataclass_from_args(cls, ns)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
