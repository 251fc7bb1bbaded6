"""Tensors as ZMQ frames: a pickled header (the message and each tensor's dtype and shape) and one
raw frame per tensor, so rows travel without pickling their bytes."""
from __future__ import annotations

import pickle
import warnings
from typing import Any

import torch

from sparkserve.mem.transfer import Rows


def pack(header: dict[str, Any], rows: Rows | None = None) -> list[Any]:
    """Frames for `header` and `rows` (per pool, per buffer; None entries stay None)."""
    frames: list[Any] = []
    specs = None
    if rows is not None:
        specs = []
        for pool in rows:
            pool_specs = []
            for t in pool:
                if t is None:
                    pool_specs.append(None)
                    continue
                t = t.detach().contiguous()
                pool_specs.append((str(t.dtype).removeprefix("torch."), tuple(t.shape)))
                frames.append(t.reshape(-1).view(torch.uint8).numpy())
            specs.append(pool_specs)
    return [pickle.dumps({**header, "rows": specs})] + frames


def unpack(frames: list[Any]) -> tuple[dict[str, Any], Rows | None]:
    header = pickle.loads(memoryview(frames[0]))
    specs = header.pop("rows")
    if specs is None:
        return header, None
    data = iter(frames[1:])
    rows: Rows = []
    with warnings.catch_warnings():          # read-only frames: the rows are copied into pools
        warnings.simplefilter("ignore", UserWarning)
        for pool_specs in specs:
            pool = []
            for spec in pool_specs:
                if spec is None:
                    pool.append(None)
                    continue
                dtype, shape = getattr(torch, spec[0]), spec[1]
                buf = memoryview(next(data))
                empty = torch.zeros(0, dtype=torch.uint8)
                raw = torch.frombuffer(buf, dtype=torch.uint8) if buf.nbytes else empty
                pool.append(raw.view(dtype).reshape(shape))
            rows.append(pool)
    return header, rows
