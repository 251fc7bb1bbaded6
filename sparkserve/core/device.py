"""Where tensors live: host bookkeeping (the allocator, the request table, the radix cache) is
always CPU; the model, its pools and everything a forward makes live on the model's device. The
forward-side code enters `on_device` so that tensors it makes without naming a device land beside
the model, the way torch's `torch.device` context directs factory calls."""
from __future__ import annotations

import contextlib

import torch


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Factory calls inside go to `device`; nothing on CPU (where no context is needed, and
    torch's device context would add a function-mode hop to every op)."""
    return contextlib.nullcontext() if device.type == "cpu" else torch.device(device)


def resolve(name: str, why_not_cuda: str | None) -> torch.device:
    """--device as a torch device: auto is cuda when torch sees one and nothing rules it out
    (`why_not_cuda`), else cpu; cuda without a GPU is a start-up error naming the flag."""
    if name == "cpu" or (name == "auto" and (why_not_cuda or not torch.cuda.is_available())):
        return torch.device("cpu")
    if name not in ("auto", "cuda"):
        raise ValueError(f"--device {name}: use one of auto, cpu, cuda")
    if why_not_cuda:
        raise ValueError(f"--device cuda {why_not_cuda}")
    if not torch.cuda.is_available():
        raise ValueError(f"--device cuda: torch {torch.__version__} sees no CUDA device (built for "
                         f"CUDA {torch.version.cuda or 'none'}); use --device cpu, or a CUDA build of torch")
    return torch.device("cuda", torch.cuda.current_device())
