"""Hand the heap's freed pages back to the OS once weights are loaded.

Loading frees as it goes (each layer's GGUF blocks once held packed for the int8 kernels, fp32
weights once dropped), and glibc keeps freed heap memory for reuse instead of returning it: a
served model would stay as resident as at its loading peak. malloc_trim(0) returns those pages.
Only glibc has it; elsewhere this does nothing."""
from __future__ import annotations

import ctypes


def release_freed_memory() -> bool:
    """Return freed heap pages to the OS; whether the C library could be asked."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):     # not glibc
        return False
    trim(0)
    return True
