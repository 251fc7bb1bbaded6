"""Heap memory the OS holds for us: pools that take RAM only as they fill, and freed pages handed
back once weights are loaded.

A pool is sized for the most tokens it may hold (a share of RAM), but torch.zeros writes every page
up front, so a model serving short chats would keep all of it resident. `lazy_zeros` gets the
zeros from calloc (through NumPy), which takes large blocks fresh from the OS: they read as zero
and become resident page by page as requests write them.

Loading frees as it goes (each layer's GGUF blocks once held packed for the int8 kernels, fp32
weights once dropped), and glibc keeps freed heap memory for reuse instead of returning it: a
served model would stay as resident as at its loading peak. malloc_trim(0) returns those pages.
Only glibc has it; elsewhere this does nothing."""
from __future__ import annotations

import ctypes
import math

import numpy as np
import torch


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero pool buffer on the default device (core/device.py: on_device): on CPU one whose
    pages become resident when first written."""
    if torch.get_default_device().type != "cpu":
        return torch.zeros(shape, dtype=dtype)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


def release_freed_memory() -> bool:
    """Return freed heap pages to the OS; whether the C library could be asked."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):     # not glibc
        return False
    trim(0)
    return True
