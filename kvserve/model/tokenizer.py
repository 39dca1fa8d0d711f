"""The checkpoint's own tokenizer, loaded from its directory and never from a hub."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def has_tokenizer(model_dir: str | Path) -> bool:
    return any((Path(model_dir) / name).exists() for name in TOKENIZER_FILES)


def load_tokenizer(model_dir: str | Path) -> Any | None:
    """A transformers tokenizer (it carries the chat template), or None if the directory has none.

    transformers is imported here, lazily: it is slow to import and the
    runner needs no tokenizer to run token ids.
    """
    if not has_tokenizer(model_dir):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
