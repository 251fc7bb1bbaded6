"""One parse per GGUF file, shared by the config, the weight loader and the tokenizer.

The header (metadata and tensor index) is read here with `struct` over a read-only memory map,
not with `gguf.GGUFReader`: the reader indexes every element of every metadata array as numpy
views (SmolLM2's 49k-token vocab and 49k merges), which takes over a second per process and holds
far more memory than the values; this reads them straight into Python values. gguf-py stays the
reference (the tests compare both) and supplies the type tables and the dequantization. The parse
is cached on the absolute path until the weights have been read from it (`close_gguf`, called by
the weight loader); the metadata stays cached.
"""

from __future__ import annotations

import functools
import os
import struct
import threading
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

_MAGIC = b"GGUF"
_T = gguf.GGUFValueType
_SCALARS = {_T.UINT8: "<B", _T.INT8: "<b", _T.UINT16: "<H", _T.INT16: "<h", _T.UINT32: "<I",
            _T.INT32: "<i", _T.FLOAT32: "<f", _T.BOOL: "<?", _T.UINT64: "<Q", _T.INT64: "<q",
            _T.FLOAT64: "<d"}
_NUMPY = {_T.UINT8: np.uint8, _T.INT8: np.int8, _T.UINT16: np.uint16, _T.INT16: np.int16,
          _T.UINT32: np.uint32, _T.INT32: np.int32, _T.FLOAT32: np.float32, _T.BOOL: np.bool_,
          _T.UINT64: np.uint64, _T.INT64: np.int64, _T.FLOAT64: np.float64}
# Tensor types whose data is read as typed elements (as GGUFReader does); the others as bytes.
_ELEMENT_TYPES = {gguf.GGMLQuantizationType.F16: np.float16, gguf.GGMLQuantizationType.F32: np.float32,
                  gguf.GGMLQuantizationType.F64: np.float64, gguf.GGMLQuantizationType.I8: np.int8,
                  gguf.GGMLQuantizationType.I16: np.int16, gguf.GGMLQuantizationType.I32: np.int32,
                  gguf.GGMLQuantizationType.I64: np.int64}


@dataclass
class GGUFTensor:
    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]    # elements, numpy order (rows first)
    data: np.ndarray          # a view of the file: typed elements, or a quantized type's bytes per row


class GGUFFile:
    """A GGUF file's metadata (plain Python values) and tensor index (views of its memory map)."""

    def __init__(self, path: str):
        self.path = path
        self._map = np.memmap(path, dtype=np.uint8, mode="r")
        self._buf = memoryview(self._map)
        if bytes(self._buf[:4]) != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        self._pos = 4
        version, n_tensors, n_fields = self._unpack("<IQQ")
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported")
        # the header's counts first, under the names gguf-py gives them
        self.metadata: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors,
                                         "GGUF.kv_count": n_fields}
        for _ in range(n_fields):
            key = self._string()
            self.metadata[key] = self._value(_T(self._unpack("<I")[0]))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            ttype, offset = self._unpack("<IQ")
            infos.append((name, dims, gguf.GGMLQuantizationType(ttype), offset))
        align = int(self.metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
        start = -(-self._pos // align) * align
        self.tensors = [self._tensor(start, *info) for info in infos]

    def _unpack(self, fmt: str) -> tuple:
        out = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return out

    def _string(self) -> str:
        (n,) = struct.unpack_from("<Q", self._buf, self._pos)
        start = self._pos + 8
        self._pos = start + n
        return str(self._buf[start:start + n], "utf-8", errors="replace")

    def _value(self, vtype: gguf.GGUFValueType) -> Any:
        if vtype == _T.STRING:
            return self._string()
        if vtype != _T.ARRAY:
            return self._unpack(_SCALARS[vtype])[0]
        etype, count = self._unpack("<IQ")
        etype = _T(etype)
        if etype in _NUMPY:                 # numbers in one read
            arr = np.frombuffer(self._buf, _NUMPY[etype], count, self._pos)
            self._pos += arr.nbytes
            return arr.tolist()
        return [self._value(etype) for _ in range(count)]

    def _tensor(self, start: int, name: str, dims: tuple[int, ...], ttype: gguf.GGMLQuantizationType,
                offset: int) -> GGUFTensor:
        shape = tuple(reversed(dims))
        n = int(np.prod(dims))
        if ttype in _ELEMENT_TYPES:
            dtype, count, view = _ELEMENT_TYPES[ttype], n, shape
        else:
            dtype, view = np.uint8, gguf.quant_shape_to_byte_shape(shape, ttype)
            block, size = gguf.GGML_QUANT_SIZES[ttype]
            count = n * size // block
        data = np.frombuffer(self._map, dtype, count, start + offset).reshape(view)
        return GGUFTensor(name, ttype, shape, data)


_files: dict[str, GGUFFile] = {}
_lock = threading.Lock()


def _abs(path: str | os.PathLike[str]) -> str:
    abs_path = os.path.abspath(os.fspath(path))
    if not os.path.isfile(abs_path):
        raise FileNotFoundError(f"GGUF file not found: {abs_path}")
    return abs_path


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """The parse of `path` (memory-mapped, read-only), made once until `close_gguf`."""
    abs_path = _abs(path)
    with _lock:
        if abs_path not in _files:
            _files[abs_path] = GGUFFile(abs_path)
        return _files[abs_path]


def close_gguf(path: str | os.PathLike[str]) -> None:
    """Forget the parse of `path` (its tensor views and the file's mapping go once nothing else
    holds them)."""
    with _lock:
        _files.pop(os.path.abspath(os.fspath(path)), None)


@functools.lru_cache(maxsize=8)
def _metadata(abs_path: str) -> dict[str, Any]:
    return open_gguf(abs_path).metadata


def gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Every metadata field of `path` as Python values: scalars, str, list[str] or list of numbers
    (one shared dict: read it, do not change it)."""
    return _metadata(_abs(path))
