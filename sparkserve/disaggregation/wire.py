"""Tensors as ZMQ frames: a pickled header (the message and each tensor's dtype and shape) and one
raw frame per tensor, so rows travel without pickling their bytes."""
from __future__ import annotations

import pickle
import warnings
from typing import Any

import torch

from sparkserve.mem.transfer import Rows


def pack(header: dict[str, Any], rows: Rows | None = None) -> list[Any]:
    """Frames for `header` and `rows` (keyed buffers of rows)."""
    frames: list[Any] = []
    specs = None
    if rows is not None:
        specs = []
        for key, t in rows.items():
            t = t.detach().contiguous()
            specs.append((key, str(t.dtype).removeprefix("torch."), tuple(t.shape)))
            frames.append(t.reshape(-1).view(torch.uint8).numpy())
    return [pickle.dumps({**header, "rows": specs})] + frames


def unpack(frames: list[Any]) -> tuple[dict[str, Any], Rows | None]:
    header = pickle.loads(memoryview(frames[0]))
    specs = header.pop("rows")
    if specs is None:
        return header, None
    rows: Rows = {}
    with warnings.catch_warnings():          # read-only frames: the rows are copied into pools
        warnings.simplefilter("ignore", UserWarning)
        for (key, dtype, shape), frame in zip(specs, frames[1:], strict=True):
            buf = memoryview(frame)
            empty = torch.zeros(0, dtype=torch.uint8)
            raw = torch.frombuffer(buf, dtype=torch.uint8) if buf.nbytes else empty
            rows[key] = raw.view(getattr(torch, dtype)).reshape(shape)
    return header, rows
