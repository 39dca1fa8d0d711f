"""Opening a GGUF file with the format's reference reader, and reading its metadata.

`gguf.GGUFReader` memory-maps the file: its tensors are views of the mapping,
so nothing is read until a tensor is dequantized. The reader itself fails on
bad input with whatever numpy raises on the way (an index error, a reshape
error), so the checks that give a clear message come first here: the magic,
the version, that every tensor lies inside the file, and that the file is
not one shard of a split model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gguf import GGUFReader

from kvserve.model.checkpoint.errors import ModelLoadError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
"""GGUF versions gguf-py reads (1 is from 2023 and long gone)."""


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
        reader = GGUFReader(path)
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
