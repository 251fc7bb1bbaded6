"""The messages of the PD control channel, as typed schemas: what a peer may say, field by field.

Every message that arrives is parsed into one of these (wire.py) before any code looks at it: an
unknown kind, a missing or extra field, a value of the wrong type or out of range is refused
there, so a hostile or broken peer cannot reach a pool or make the server allocate without bound.
Tensors (rows, slot ids, the RNG state, hidden rows, an engine's metadata) travel beside the
message as raw frames (wire.py) and are checked against the reservation they are for by the code
that takes them (mem/transfer.py check_rows, the backends)."""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

MAX_ITEMS = 1 << 20          # list lengths (positions, buffers, rooms): far above any real server's
MAX_TEXT = 4096              # messages, names, hosts
MAX_DIMS = 8

Room = Annotated[int, Field(ge=0, lt=1 << 63)]      # the routers' 63-bit room ids
Count = Annotated[int, Field(ge=0, lt=1 << 40)]     # positions, rows, slots
Text = Annotated[str, Field(max_length=MAX_TEXT)]
Dims = Annotated[tuple[Annotated[int, Field(ge=0, lt=1 << 40)], ...], Field(max_length=MAX_DIMS)]
Dtype = Literal["float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8",
                "bool", "float8_e4m3fn", "float8_e5m2"]      # float8: quantized KV pools' elements


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, ser_json_inf_nan="constants")


class BufferShape(_Message):
    """One buffer of a side's whole layout (mem/transfer.py Shapes): its key and item shape."""
    pool: Annotated[int, Field(ge=0, lt=1024)]
    component: Annotated[str, Field(max_length=64)]
    layer: Annotated[int, Field(ge=-1, lt=1 << 20)]
    kind: Annotated[str, Field(max_length=64)]
    shape: Dims


class Buffer(_Message):
    """One component buffer as a registered-memory engine writes into it (registered.py)."""
    kind: Annotated[str, Field(max_length=64)]
    dtype: Dtype
    row_shape: Dims
    ptr: Annotated[int, Field(ge=0, lt=1 << 64)]
    row_bytes: Annotated[int, Field(ge=-1, lt=1 << 40)]      # -1: rows not contiguous
    stride: Annotated[int, Field(ge=0, lt=1 << 48)]
    rows: Count


class Destination(_Message):
    """Where a registered-memory backend writes a reservation's rows on the decode side: its
    request row (the slot ids travel as the tensors `slots` and, for a split pool, `swa_slots`)."""
    row: Count
    split: bool


# ---- decode -> prefill ------------------------------------------------------------------------
class Reserve(_Message):
    kind: Literal["reserve"] = "reserve"
    room: Room
    start: Count
    shapes: Annotated[list[BufferShape], Field(max_length=MAX_ITEMS)]
    backend: Annotated[str, Field(max_length=32)]
    dst: Destination | None = None


class Cancel(_Message):
    kind: Literal["cancel"] = "cancel"
    room: Room
    message: Text


class Bye(_Message):
    kind: Literal["bye"] = "bye"


class Hello(_Message):
    """A registered-memory decode side's memory (its engine's metadata travels as tensor `meta`)."""
    kind: Literal["hello"] = "hello"
    host: Annotated[str, Field(max_length=255)]
    layout: Annotated[list[Annotated[list[Buffer], Field(max_length=MAX_ITEMS)]], Field(max_length=1024)]
    whole: bool


# ---- prefill -> decode ------------------------------------------------------------------------
class RowsSent(_Message):
    """Positions lo.. of a room: as tensors keyed (pool, component, layer) with the tcp backend,
    written already (up to hi) with a registered-memory one."""
    kind: Literal["rows"] = "rows"
    room: Room
    lo: Count
    hi: Count | None = None


class Result(_Message):
    """The first token's result, after the last rows; the RNG state (tensor `rng`) and the hidden
    rows (tensors ("hidden", i, "positions" | "final" | "taps")) travel beside it."""
    kind: Literal["result"] = "result"
    room: Room
    output_ids: Annotated[list[Annotated[int, Field(ge=0, lt=1 << 31)]],
                          Field(min_length=1, max_length=MAX_ITEMS)]
    output_logprobs: Annotated[list[float | None], Field(max_length=MAX_ITEMS)]
    output_top_logprobs: Annotated[list[Annotated[list[tuple[int, float]], Field(max_length=1024)]],
                                   Field(max_length=MAX_ITEMS)]
    hidden_parts: Annotated[int, Field(ge=0, lt=1 << 20)] | None = None


class Failed(_Message):
    kind: Literal["failed"] = "failed"
    room: Room
    message: Text


class Refused(_Message):
    kind: Literal["refused"] = "refused"
    room: Room
    message: Text


class Alive(_Message):
    kind: Literal["alive"] = "alive"
    rooms: Annotated[list[Room], Field(max_length=MAX_ITEMS)]


class Rehello(_Message):
    kind: Literal["rehello"] = "rehello"
    room: Room


Message = Annotated[Union[Reserve, Cancel, Bye, Hello, RowsSent, Result, Failed, Refused, Alive, Rehello],
                    Field(discriminator="kind")]

TensorKey = Annotated[tuple[Union[Annotated[int, Field(ge=-1, lt=1 << 20)],
                                  Annotated[str, Field(max_length=64)]], ...], Field(max_length=4)]


class TensorSpec(_Message):
    key: TensorKey
    dtype: Dtype
    shape: Dims


class Envelope(_Message):
    """The JSON header of one ZMQ message: the message and the tensors in the frames after it."""
    msg: Message
    tensors: Annotated[list[TensorSpec], Field(max_length=MAX_ITEMS)] = []
