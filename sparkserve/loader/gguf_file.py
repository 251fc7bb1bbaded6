"""One parse per GGUF file, shared by the config, the weight loader and the tokenizer.

`gguf.GGUFReader` takes seconds on a 100 MB file and holds far more memory than the file's
metadata (it indexes every metadata array element), so the reader is cached on the absolute path
only until the weights have been read from it (`close_gguf`, called by the weight loader): the
metadata, turned into plain Python values once, stays cached.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any

import gguf

_readers: dict[str, gguf.GGUFReader] = {}
_lock = threading.Lock()


def _abs(path: str | os.PathLike[str]) -> str:
    abs_path = os.path.abspath(os.fspath(path))
    if not os.path.isfile(abs_path):
        raise FileNotFoundError(f"GGUF file not found: {abs_path}")
    return abs_path


def open_gguf(path: str | os.PathLike[str]) -> gguf.GGUFReader:
    """The reader of `path` (memory-mapped, read-only), parsed once until `close_gguf`."""
    abs_path = _abs(path)
    with _lock:
        if abs_path not in _readers:
            _readers[abs_path] = gguf.GGUFReader(abs_path, "r")
        return _readers[abs_path]


def close_gguf(path: str | os.PathLike[str]) -> None:
    """Forget the reader of `path` (its parse and its file mapping go once nothing else holds it)."""
    with _lock:
        _readers.pop(os.path.abspath(os.fspath(path)), None)


@functools.lru_cache(maxsize=8)
def _metadata(abs_path: str) -> dict[str, Any]:
    return {name: _field_value(field) for name, field in open_gguf(abs_path).fields.items()}


def gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Every metadata field of `path` as Python values: scalars, str, list[str] or list of numbers
    (one shared dict: read it, do not change it)."""
    return _metadata(_abs(path))


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
