"""The rule for when a forward runs as one native call, shared by every family with a C++ step
(models/llama_native.py, models/deepseek_v2_native.py): decode, VERIFY and small extends on one
CPU rank, outside autograd; the step is built the first time a batch could use it (or the reason
it cannot is logged once), dropped by `reset()` after the weights change, and rebuilt when the
activation mode changes the blocks' form."""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod

import torch

from sparkserve.core.forward_batch import ForwardBatch, ForwardMode
from sparkserve.layers.attention import KERNEL_MAX_Q

log = logging.getLogger(__name__)

# Most tokens per native forward: the block kernel beats oneDNN up to about this many rows on
# SmolLM2's widest projection (layers/linear.py), and larger batches are prefill chunks.
NATIVE_MAX_TOKENS = 64


class NativeStepBase(ABC):
    """A family's native step: `applies` decides per batch, the subclass builds and runs it."""

    name = "native step"
    pool_type: type = object        # the KV pool kind the step reads in place

    def __init__(self) -> None:
        self.enabled = True
        self._step = None           # the C++ step, built on first use
        self._unsupported: str | None = None
        self._pool = None           # the pool whose buffers the step holds
        self._int8 = False          # the activation mode it was built under

    def reset(self) -> None:
        self._step, self._unsupported, self._pool = None, None, None

    @abstractmethod
    def unsupported(self, model: torch.nn.Module) -> str | None:
        """Why this model cannot run natively, or None."""

    @abstractmethod
    def build(self, model: torch.nn.Module):
        """The C++ step holding the model's weights."""

    @abstractmethod
    def int8_activations(self, model: torch.nn.Module) -> bool:
        """Whether the layers serve int8 activations (their blocks then held packed)."""

    def applies(self, model: torch.nn.Module, batch: ForwardBatch) -> bool:
        """Whether this batch runs natively (builds the step the first time one could)."""
        if not self.enabled or batch.mode not in (ForwardMode.DECODE, ForwardMode.VERIFY, ForwardMode.EXTEND):
            return False
        if (batch.cp is not None or batch.num_tokens > NATIVE_MAX_TOKENS or torch.is_grad_enabled()
                or max(batch.extend_lens) > KERNEL_MAX_Q or batch.input_ids.device.type != "cpu"
                or not isinstance(batch.kv_pool, self.pool_type)):
            return False
        int8 = self.int8_activations(model)
        if self._step is not None and int8 != self._int8:   # the blocks changed form with the mode
            self.reset()
        if self._step is None and self._unsupported is None:
            self._unsupported = self.unsupported(model)
            if self._unsupported is None:
                self._step, self._int8 = self.build(model), int8
            else:
                log.info("%s off: %s (the layers run from Python)", self.name, self._unsupported)
        return self._step is not None
