"""One parse per GGUF file, shared by the weight loader and the tokenizer.

`gguf.GGUFReader` takes seconds on a 100 MB file (it indexes every metadata array element), so the
reader is cached on the absolute path and its metadata is turned into plain Python values once here.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import gguf


@functools.lru_cache(maxsize=8)
def _open_cached(abs_path: str) -> gguf.GGUFReader:
    return gguf.GGUFReader(abs_path, "r")


def open_gguf(path: str | os.PathLike[str]) -> gguf.GGUFReader:
    """Parse `path` once per process (memory-mapped, read-only) and return the shared reader."""
    abs_path = os.path.abspath(os.fspath(path))
    if not os.path.isfile(abs_path):
        raise FileNotFoundError(f"GGUF file not found: {abs_path}")
    return _open_cached(abs_path)


def _to_str(part: Any) -> str:
    return bytes(part).decode("utf-8", errors="replace")


def _field_value(field: Any) -> Any:
    types = field.types
    if not types:
        return None
    main = types[0]
    if main == gguf.GGUFValueType.ARRAY:
        if len(types) > 2:  # nested arrays: rare, let gguf flatten them
            return field.contents()
        if types[-1] == gguf.GGUFValueType.STRING:
            return [_to_str(field.parts[i]) for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if main == gguf.GGUFValueType.STRING:
        return _to_str(field.parts[-1])
    return field.parts[-1].tolist()[0]


def gguf_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """Every metadata field as Python values: scalars, str, list[str] or list of numbers."""
    return {name: _field_value(field) for name, field in reader.fields.items()}
