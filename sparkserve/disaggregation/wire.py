"""The PD control channel's bytes: one JSON header (protocol.py's Envelope: the message and each
tensor's key, dtype and shape) and one raw frame per tensor, so rows travel without a copy into
the header and nothing from the network is ever unpickled or evaluated.

`unpack` trusts nothing: the header is parsed against the schemas, each tensor's dtype comes
from an allow-list and its frame must hold exactly dtype x shape bytes; any failure is a
WireError, which the receiving side logs (naming the peer) and drops."""
from __future__ import annotations

import warnings
from typing import Any

import torch
from pydantic import ValidationError

from sparkserve.disaggregation.protocol import Envelope, TensorSpec

MAX_HEADER_BYTES = 16 << 20

Tensors = dict[tuple, torch.Tensor]


class WireError(ValueError):
    """A message that is not one this protocol sends."""


def pack(msg: Any, tensors: Tensors | None = None) -> list[Any]:
    """Frames for `msg` (a protocol message) and `tensors`."""
    specs, frames = [], []
    for key, t in (tensors or {}).items():
        t = t.detach().cpu().contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        specs.append(TensorSpec(key=tuple(key), dtype=dtype, shape=tuple(t.shape)))
        frames.append(t.reshape(-1).view(torch.uint8).numpy())
    return [Envelope(msg=msg, tensors=specs).model_dump_json().encode()] + frames


def unpack(frames: list[Any]) -> tuple[Any, Tensors]:
    """The message and its tensors (views of the frames: copy them before the frames go)."""
    if not frames:
        raise WireError("an empty message")
    header = memoryview(frames[0])
    if header.nbytes > MAX_HEADER_BYTES:
        raise WireError(f"a header of {header.nbytes} bytes (at most {MAX_HEADER_BYTES})")
    try:
        env = Envelope.model_validate_json(header.tobytes())
    except ValidationError as e:
        raise WireError(f"not a PD message: {_first_error(e)}") from None
    if len(frames) != 1 + len(env.tensors):
        raise WireError(f"{len(frames) - 1} tensor frames for {len(env.tensors)} tensors")
    tensors: Tensors = {}
    with warnings.catch_warnings():          # read-only frames: receivers copy the rows into pools
        warnings.simplefilter("ignore", UserWarning)
        for spec, frame in zip(env.tensors, frames[1:]):
            if spec.key in tensors:
                raise WireError(f"tensor {spec.key} twice")
            tensors[spec.key] = _tensor(spec, memoryview(frame))
    return env.msg, tensors


def _tensor(spec: TensorSpec, buf: memoryview) -> torch.Tensor:
    dtype = getattr(torch, spec.dtype)
    numel = 1
    for d in spec.shape:
        numel *= d
    want = numel * dtype.itemsize
    if buf.nbytes != want:
        raise WireError(f"tensor {spec.key}: {buf.nbytes} bytes for {spec.dtype}{list(spec.shape)} ({want})")
    if not want:
        return torch.zeros(spec.shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(spec.shape)


def _first_error(e: ValidationError) -> str:
    err = e.errors(include_url=False)[0]
    where = ".".join(str(x) for x in err["loc"])
    return f"{where}: {err['msg']}" if where else err["msg"]
