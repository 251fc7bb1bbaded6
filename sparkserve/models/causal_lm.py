"""CausalLM: what every decoder-only model here shares — the LM head (tied or not), aux
hidden-state capture after every layer (DSpark taps, docs/design.md contract 2), the forward loop,
and the defaults of the model contract that hybrid models override (request state, VERIFY commit,
pool costs). A model builds `self.model` (a DecoderStack) and its pools."""
from __future__ import annotations

import torch
from torch import nn

from sparkserve.config import ModelConfig
from sparkserve.core.forward_batch import ForwardBatch
from sparkserve.layers.linear import Linear
from sparkserve.layers.rotary import RotaryEmbedding
from sparkserve.models.aux_capture import AuxCaptureMixin


class DecoderStack(nn.Module):
    """The body of a model: embed_tokens, layers, norm, and the rotary table its layers share
    (None when the layers bring their own position handling)."""

    def __init__(self) -> None:
        super().__init__()
        self.rotary: RotaryEmbedding | None = None


class CausalLM(AuxCaptureMixin, nn.Module):
    model: DecoderStack
    # Per-request recurrent state (linear attention): a state summarises a whole prefix, so
    # such a model runs without the prefix cache.
    has_request_state = False

    def __init__(self, cfg: ModelConfig, model: nn.Module, lm_head_bias: bool = False):
        super().__init__()
        self.config = cfg
        self.model = model
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=lm_head_bias)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.init_aux_capture(cfg.num_hidden_layers)

    def post_materialize(self) -> None:
        """After `to_empty`: re-tie the LM head and refill the rope tables."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if self.model.rotary is not None:
            self.model.rotary.build()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        """Final normed hidden states [T, d]; taps go to batch.aux_hidden."""
        x = self.model.embed_tokens(input_ids)
        if -1 in self.aux_layer_set:
            batch.aux_hidden.append(x)
        rotary = self.model.rotary
        extra = (rotary.cos_sin(positions),) if rotary is not None else ()
        for i, layer in enumerate(self.model.layers):
            x = layer(x, *extra, batch)
            if i in self.aux_layer_set:
                batch.aux_hidden.append(x)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def commit_verify(self, batch: ForwardBatch, kept: list[int]) -> None:
        """After a VERIFY forward: request i keeps the state after its first kept[i] tokens.
        KV rows need nothing (rejected slots are just freed); recurrent state does."""

    # Pool contract (docs/design.md, contract 3) defaults: what a model without request_row state or a second
    # (sliding-window) slot space costs beyond pool_bytes_per_token.
    def pool_bytes_per_request(self) -> int:
        return 0

    def pool_bytes_per_swa_token(self) -> int:
        return 0
