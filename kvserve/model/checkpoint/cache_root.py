"""Where kvserve keeps what it derives once and reuses: the demo checkpoint, tokenizers
converted from GGUF files. One root, so a user or a test moves all of it with one variable
($XDG_CACHE_HOME; the compiled kernels have their own, $KVSERVE_KERNEL_CACHE)."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_root() -> Path:
    """`$XDG_CACHE_HOME/kvserve`, or `~/.cache/kvserve`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvserve"
