"""CausalLM: what every decoder-only model here shares — the LM head (tied or not), aux
hidden-state capture after every layer (DSpark taps, DESIGN.md contract 2) and the forward loop.
A model builds `self.model` (embed_tokens, layers, norm, optional rotary) and its pools."""
from __future__ import annotations

import torch
from torch import nn

from sparkserve.config import ModelConfig
from sparkserve.executor.forward_batch import ForwardBatch
from sparkserve.layers.linear import Linear
from sparkserve.models.aux_capture import AuxCaptureMixin


class CausalLM(AuxCaptureMixin, nn.Module):
    model: nn.Module

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
        rotary = getattr(self.model, "rotary", None)
        if rotary is not None:
            rotary.build()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        """Final normed hidden states [T, d]; taps go to batch.aux_hidden."""
        x = self.model.embed_tokens(input_ids)
        if -1 in self.aux_layer_set:
            batch.aux_hidden.append(x)
        rotary = getattr(self.model, "rotary", None)
        extra = (rotary.cos_sin(positions),) if rotary is not None else ()
        for i, layer in enumerate(self.model.layers):
            x = layer(x, *extra, batch)
            if i in self.aux_layer_set:
                batch.aux_hidden.append(x)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    # Pool contract (DESIGN.md 3) defaults: what a model without request_row state or a second
    # (sliding-window) slot space costs beyond pool_bytes_per_token.
    def pool_bytes_per_request(self) -> int:
        return 0

    def pool_bytes_per_swa_token(self) -> int:
        return 0
