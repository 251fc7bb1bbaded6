"""Gemma 2 and Gemma 3 (text; a Gemma 3 4B+ multimodal checkpoint serves its language model).

Their block is the Llama decoder's with the departures config.py reads into ModelConfig
(`_gemma_fields`): 1 + w norms (the offset added as the weights load), sandwich norms, GeGLU, the
embedding times sqrt(hidden), query_pre_attn_scalar, Gemma 2's attention and final soft-caps,
Gemma 3's q/k norms and local rope base on its sliding layers. What this class adds is where a
multimodal checkpoint keeps the language model's tensors."""
from __future__ import annotations

import re

from sparkserve.models.llama import LlamaForCausalLM

# transformers 4.5x: language_model.model.X / language_model.lm_head.X; 5.x: model.language_model.X
_LANGUAGE_MODEL = re.compile(r"(?:language_model\.model|model\.language_model)\.(.*)")
_OTHER_TOWERS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                 "model.multi_modal_projector.")


class GemmaForCausalLM(LlamaForCausalLM):
    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        if name.startswith(_OTHER_TOWERS):
            return None
        m = _LANGUAGE_MODEL.fullmatch(name)
        if m:
            return f"model.{m[1]}"
        return name.removeprefix("language_model.")
