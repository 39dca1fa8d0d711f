"""Opening a GGUF file with the format's reference reader, and reading its metadata.

`gguf.GGUFReader` memory-maps the file: its tensors are views of the mapping,
so nothing is read until a tensor is dequantized. The reader itself fails on
bad input with whatever numpy raises on the way (an index error, a reshape
error), so the checks that give a clear message come first here: the magic,
the version, that every tensor lies inside the file, and that the file is
not one shard of a split model.

The reader slices its memory map once per value, and slicing an `np.memmap`
runs Python code (`__getitem__`, `__array_finalize__`) each time: a
tokenizer's 49,152 strings and 48,900 merges took 2.2 s to index.
`MappedReader` slices a plain ndarray view of the same mapping instead (0.7 s;
the values and the tensors are the same bytes, still read lazily).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from gguf import GGUFReader

from kvserve.model.checkpoint.errors import ModelLoadError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
"""GGUF versions gguf-py reads (1 is from 2023 and long gone)."""


class MappedReader(GGUFReader):
    """gguf-py's reader, its values sliced from a plain view of the memory map (why: above)."""

    def _get(
        self, offset: int, dtype: npt.DTypeLike, count: int = 1, override_order: Any = None
    ) -> npt.NDArray[Any]:
        plain = self.__dict__.get("_plain")
        if plain is None:  # `data` is the first thing the reader's __init__ sets
            plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
        kind, count = np.dtype(dtype), int(count)
        values = plain[offset : offset + kind.itemsize * count].view(kind)[:count]
        order = self.byte_order if override_order is None else override_order
        return values.view(values.dtype.newbyteorder(order))


def open_gguf(path: str | Path) -> GGUFReader:
    """A reader over `path`; a ModelLoadError says what is wrong with a file that is not one."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None
    if head[:4] != MAGIC:
        raise ModelLoadError(
            f"{path} is not a GGUF file (it starts with {head[:4]!r}, not {MAGIC!r}); "
            "pass a .gguf file or a Hugging Face checkpoint directory"
        )
    version = int.from_bytes(head[4:8], "little") if len(head) == 8 else None
    if version is not None and version not in VERSIONS:
        raise ModelLoadError(f"{path} is GGUF version {version}; supported: {VERSIONS}")
    try:
        reader = MappedReader(path)
    except Exception as exc:  # the reader has no error type of its own
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelLoadError(
            f"{path} is truncated or corrupt ({size} bytes): its GGUF header or tensor table "
            f"cannot be read ({detail})"
        ) from None
    for tensor in reader.tensors:
        end = tensor.data_offset + tensor.n_bytes
        if end > size:
            raise ModelLoadError(
                f"{path} is truncated: tensor {tensor.name} ends at byte {end}, "
                f"the file has {size} bytes"
            )
    splits = field(reader, "split.count", 1)
    if splits > 1:
        raise ModelLoadError(
            f"{path} is one of {splits} shards of a sharded GGUF model: only single-file "
            "GGUF is supported (merge the shards with llama-gguf-split --merge)"
        )
    return reader


def field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """A metadata value as a Python value (str, int, float, bool or a list), or `default`."""
    entry = reader.fields.get(key)
    if entry is None:
        return default
    return entry.contents()


def array_length(reader: GGUFReader, key: str) -> int | None:
    """How many items an array field holds, without converting them (the token list is long)."""
    entry = reader.fields.get(key)
    return None if entry is None else len(entry.data)
