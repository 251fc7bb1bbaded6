"""CausalLM: what every decoder-only model here shares — the LM head (tied or not; split over the
tp ranks like the embedding, layers/vocab_parallel.py), aux hidden-state capture after every layer
(DSpark taps, docs/design.md contract 2), the forward loop, and the defaults of the model contract
that hybrid models override (request state, VERIFY commit, pool costs).
A model builds `self.model` (a DecoderStack) and its pools."""
from __future__ import annotations

import re
from typing import Callable

import torch
from torch import nn

from sparkserve.config import ModelConfig
from sparkserve.core.forward_batch import ForwardBatch, ForwardMode, PPProxy
from sparkserve.distributed import context_parallel
from sparkserve.distributed import parallel_state as ps
from sparkserve.distributed.sharding import Dim
from sparkserve.layers.dp_attention import run_mlp
from sparkserve.layers.rotary import RotaryEmbedding
from sparkserve.layers.vocab_parallel import ParallelLMHead
from sparkserve.mem.kv_quant import kv_dtype_name
from sparkserve.models.aux_capture import AuxCaptureMixin


class PPMissingLayer(nn.Module):
    """Stands in for what another pipeline stage owns: no weights, never called."""


def stage_layer_list(num_layers: int, make: Callable[[int], nn.Module]) -> nn.ModuleList:
    """Layer i built by `make(i)` when this pipeline stage owns it, a PPMissingLayer otherwise."""
    owned = ps.stage_layers(num_layers)
    return nn.ModuleList(make(i) if i in owned else PPMissingLayer() for i in range(num_layers))


class DecoderStack(nn.Module):
    """The body of a model: embed_tokens, layers, norm, and the rotary table its layers share
    (None when the layers bring their own position handling). Each decoder layer has `mlp`
    (x -> y, its MLP or MoE), which DP attention runs over every attention group's tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.rotary: RotaryEmbedding | None = None

    def layer_rope(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor] | None] | None:
        """Each layer's (cos, sin) rows for `positions` (indexed by layer id), or None when the
        layers bring their own position handling: one table for all layers here."""
        if self.rotary is None:
            return None
        return [self.rotary.cos_sin(positions)] * len(self.layers)


class CausalLM(AuxCaptureMixin, nn.Module):
    model: DecoderStack
    # Per-request recurrent state (linear attention): a state summarises a whole prefix, so
    # such a model runs without the prefix cache.
    has_request_state = False
    # Device types whose torch kernels run every layer of the model (--device); the CPU kernels of
    # sparkserve.kernels run only on CPU.
    DEVICES: tuple[str, ...] = ("cpu",)

    def __init__(self, cfg: ModelConfig, model: nn.Module, lm_head_bias: bool = False):
        """Under pipeline parallelism a stage keeps its layers only, the first one also the
        embedding and the LM head, the last one the final norm. Under tensor parallelism each
        rank of the first stage keeps its vocab slice of both (`vocab_shard`); logits are
        gathered on the driver (compute_logits)."""
        super().__init__()
        self.config = cfg
        self.model = model
        self.layer_range = ps.stage_layers(cfg.num_hidden_layers)
        self.first_stage, self.last_stage = ps.is_first_stage(), ps.is_last_stage()
        self.has_lm_head = self.first_stage
        self.vocab_sharded = ps.tp_size() > 1      # embedding and LM head hold a vocab slice
        self.checkpoint_path: str | None = None    # set by load_model (a draft may read the full head)
        self.checkpoint_for_int8 = False            # its GGUF weights in the int8 kernels' types
        self.kv_dtype = torch.float32               # what the KV pool stores (--kv-cache-dtype)
        self.device = torch.device("cpu")           # where it runs (--device; registry.to_device)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, bias=lm_head_bias) \
            if self.has_lm_head else PPMissingLayer()
        if not self.first_stage:
            self.model.embed_tokens = PPMissingLayer()
        if not self.last_stage:
            self.model.norm = PPMissingLayer()
        self._tie()
        self.init_aux_capture(cfg.num_hidden_layers)

    def _tie(self) -> None:
        if self.config.tie_word_embeddings and self.has_lm_head:
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """The model's name for an HF checkpoint tensor, or None for one it does not hold (a
        multimodal checkpoint's vision tower): loader/hf.py reads only what maps."""
        return name

    def owns(self, name: str) -> bool:
        """Whether this pipeline stage holds the checkpoint tensor `name`."""
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if m:
            return int(m[1]) in self.layer_range
        if name.startswith("lm_head."):
            return self.has_lm_head
        if name.startswith("model.embed_tokens."):
            return self.first_stage
        if name.startswith("model.norm."):
            return self.last_stage
        return True

    def post_materialize(self) -> None:
        """After `to_empty`: re-tie the LM head and refill the rope tables."""
        self._tie()
        for m in self.modules():
            if isinstance(m, RotaryEmbedding):
                m.build()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                proxy: PPProxy | None = None) -> torch.Tensor | PPProxy:
        """Final normed hidden states [T, d] on the last pipeline stage, else a PPProxy for the
        next one (which passes it in as `proxy`); taps go to batch.aux_hidden. Under context
        parallel a long prefill runs as this rank's share of its tokens, the rows gathered back
        at the end (distributed/context_parallel.py)."""
        full, batch = batch, context_parallel.shard(batch) or batch
        if batch is not full:
            input_ids, positions = batch.input_ids, batch.positions
        if ps.mlp_gathers():
            self._agree_mlp_rows(batch)
        if batch.mode == ForwardMode.IDLE:
            x = torch.zeros(0, self.config.hidden_size)
            for i in self.layer_range:
                run_mlp(self.model.layers[i].mlp, x, batch)
            return x
        if proxy is None:
            x = self.model.embed_tokens(input_ids)
            if -1 in self.aux_layer_set:
                batch.aux_hidden.append(x)
        else:
            x = proxy.hidden
            batch.aux_hidden[:0] = proxy.aux
        rope = self.model.layer_rope(positions)
        for i in self.layer_range:
            x = self.model.layers[i](x, *((rope[i],) if rope is not None else ()), batch)
            if i in self.aux_layer_set:
                batch.aux_hidden.append(x)
        if batch is not full:
            full.aux_hidden = [batch.cp.gather(a) for a in batch.aux_hidden]
            x = batch.cp.gather(x)
        return self.model.norm(x) if self.last_stage else PPProxy(x, full.aux_hidden)

    @staticmethod
    def _agree_mlp_rows(batch: ForwardBatch) -> None:
        """DP attention / context parallel: the ranks of the MLP group hold different tokens;
        each layer's MLP runs over all of them (layers/dp_attention.py). A rank brings its own
        rows when it runs a share of a split prefill, else its attention group's first rank
        brings the group's rows for all of it (an IDLE group brings none)."""
        own = batch.cp is not None
        brings = batch.num_tokens if own or ps.is_driver() else 0
        batch.mlp_rows = (ps.mlp_row_counts(brings), ps.mlp_index() if own else ps.group_leader_index())

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[rows, vocab] fp32 logits. Under tensor parallelism every first-stage tp rank runs this
        on the same rows at once (the driver's ModelRunner tells them: ForwardMirror.logits):
        each computes its vocab slice, the driver gets them all (padding cut), the others None.
        Granite's logits divisor and a final soft-cap (Gemma 2) apply to what the driver gets."""
        logits = self.lm_head(hidden).float()
        if self.vocab_sharded:
            logits = ps.tp_gather(logits)
            if logits is None:
                return None
            logits = logits[:, :self.config.vocab_size]
        cap, divisor = self.config.final_softcap, self.config.logits_scaling
        if divisor != 1.0:            # Granite
            logits = logits / divisor
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @staticmethod
    def tp_dims(cfg: ModelConfig) -> list[Dim]:
        """What the model splits over the tensor-parallel ranks (distributed/sharding.py checks
        them at start-up); every model lists its own."""
        raise NotImplementedError

    def enable_native_step(self, on: bool) -> None:
        """Whether small forwards may run as one native call (models/llama_native.py); a model
        without a native step always runs its layers from Python."""

    # What make_pool's K/V buffers may hold: a model whose pools keep other state (latents,
    # recurrent state, index keys) stays float32.
    KV_CACHE_DTYPES: tuple[torch.dtype, ...] = (torch.float32,)

    def set_kv_cache_dtype(self, dtype: torch.dtype) -> None:
        """What make_pool's K/V buffers hold (--kv-cache-dtype), set before the pool is sized."""
        if dtype not in self.KV_CACHE_DTYPES:
            name = kv_dtype_name(dtype)
            takes = ", ".join(kv_dtype_name(d) for d in self.KV_CACHE_DTYPES)
            raise ValueError(f"--kv-cache-dtype {name}: {type(self).__name__} keeps its pools in {takes}; "
                             f"use one of them, or auto")
        self.kv_dtype = dtype

    def commit_verify(self, batch: ForwardBatch, kept: list[int]) -> None:
        """After a VERIFY forward: request i keeps the state after its first kept[i] tokens.
        KV rows need nothing (rejected slots are just freed); recurrent state does."""

    # Pool contract (docs/design.md, contract 3) defaults: what a model without request_row state or a second
    # (sliding-window) slot space costs beyond pool_bytes_per_token.
    def pool_bytes_per_request(self) -> int:
        return 0

    def pool_bytes_per_swa_token(self) -> int:
        return 0
