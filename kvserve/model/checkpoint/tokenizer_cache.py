"""A GGUF file's tokenizer, converted once and then loaded from disk.

transformers builds a tokenizer from a GGUF file's metadata by reading every
token and merge with gguf-py and converting them: 3.9 s for the default model's
file on an AMD EPYC (Zen 4), a quarter of `kvserve generate`'s start, paid again
by every process that serves the file. What it builds is an ordinary tokenizer
(tokenizer.json, its config and chat template), so it is saved once under
`<cache root>/tokenizers/<key>` and loaded from there (0.15 s) while the file is
the same one: the key is the file's resolved path, size and modification time
and transformers' version (a touched or replaced file gets a new one). A saved
tokenizer that fails to load is converted again; a cache that cannot be written
(read-only) costs the conversion each time, nothing else.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from kvserve.model.checkpoint.cache_root import default_cache_root

logger = logging.getLogger(__name__)

FORMAT = 1
"""Part of the key: a change to what is saved here bumps it."""
KEPT = 16
KEPT_BYTES = 256 << 20
"""Saved tokenizers kept: the newest, at most KEPT of them and KEPT_BYTES in all, and always
the newest one (the default model's takes 3.4 MB, a 256k vocabulary's some 35 MB). Every
edited or moved file leaves its old one behind."""


def cache_key(gguf: Path) -> str:
    """The saved tokenizer's name for this file as it is now."""
    import transformers

    stat = gguf.stat()
    parts = (str(gguf.resolve()), stat.st_size, stat.st_mtime_ns, transformers.__version__, FORMAT)
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:32]


def tokenizer_dir(gguf: Path) -> Path:
    return default_cache_root() / "tokenizers" / cache_key(gguf)


def load_saved(gguf: Path) -> Any | None:
    """The tokenizer saved for `gguf` as it is now; None when there is none that loads."""
    from transformers import AutoTokenizer

    target = tokenizer_dir(gguf)
    if not target.is_dir():
        return None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(target), local_files_only=True)
    except Exception as exc:  # a damaged directory: the caller converts again
        logger.warning("converting %s's tokenizer again: %s cannot be loaded (%s)",
                       gguf.name, target, exc)  # fmt: skip
        shutil.rmtree(target, ignore_errors=True)
        return None
    with contextlib.suppress(OSError):
        os.utime(target)  # used now: prune keeps the newest
    return tokenizer


def save(gguf: Path, tokenizer: Any) -> None:
    """Keep `tokenizer`, converted from `gguf`, for the next process."""
    target = tokenizer_dir(gguf)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    except OSError as exc:
        logger.info("%s's tokenizer is not cached (%s)", gguf.name, exc)
        return
    try:
        tokenizer.save_pretrained(str(staging))
        os.rename(staging, target)  # atomic: a reader sees all of it or nothing
    except OSError as exc:  # a full disk, or another process saved it first
        shutil.rmtree(staging, ignore_errors=True)
        if not target.is_dir():
            logger.info("%s's tokenizer is not cached (%s)", gguf.name, exc)
        return
    prune(target.parent)


def prune(root: Path) -> None:
    """Keep the newest saved tokenizers within KEPT and KEPT_BYTES (and a save in progress
    elsewhere, being the newest); remove the others and staging left by a killed save."""
    try:
        saved = [(p.stat().st_mtime_ns, p) for p in root.iterdir() if p.is_dir()]
        sizes = {p: sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) for _, p in saved}
    except OSError:  # another process pruned first
        return
    total = 0
    for rank, (_, path) in enumerate(sorted(saved, reverse=True)):
        total += sizes[path]
        if rank > 0 and (rank >= KEPT or total > KEPT_BYTES):
            shutil.rmtree(path, ignore_errors=True)
