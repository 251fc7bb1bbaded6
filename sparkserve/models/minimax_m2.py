"""MiniMax-M2 (MiniMaxM2ForCausalLM; MiniMax-M2.1 / M2.5 share it): the Llama decoder with the
departures config.py declares for the family (FAMILY_TRAITS["minimax_m2"], all ModelConfig fields):
q/k RMSNorms over the whole projection (every head at once, as OLMo 2's: WidthRMSNorm), partial
rotary (the released configs' `rotary_dim`, 64 of 128 channels), full attention on every layer, and
a MoE on every layer routed by sigmoid scores: experts chosen by score + `e_score_correction_bias`,
weighted by their plain scores renormalised (layers/moe.py grouped_topk with one group), no shared
expert. What this class adds is where the checkpoint keeps the routing bias (beside the router,
`block_sparse_moe.e_score_correction_bias`) and that the multi-token-prediction layers a released
checkpoint may carry past `num_hidden_layers` are not read."""
from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch

from sparkserve.models.llama import LlamaForCausalLM

_ROUTING_BIAS = re.compile(r"(model\.layers\.\d+)\.(?:block_sparse_moe|mlp)\.e_score_correction_bias")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class MiniMaxM2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        m = _ROUTING_BIAS.fullmatch(name)
        return f"{m[1]}.mlp.gate.e_score_correction_bias" if m else name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._decoder_layers(weights))

    def _decoder_layers(self, weights: Iterable[tuple[str, torch.Tensor]]
                        ) -> Iterator[tuple[str, torch.Tensor]]:
        n = self.config.num_hidden_layers
        for name, t in weights:
            m = _LAYER.match(name)
            if m is None or int(m[1]) < n:      # past them: the MTP modules
                yield self.checkpoint_name(name), t
