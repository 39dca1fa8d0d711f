"""The checkpoint's own tokenizer, loaded from its directory or GGUF file, never from a hub.

A GGUF file carries its tokenizer and chat template in its metadata, and
transformers builds a tokenizer from them (with gguf-py), once per file:
tokenizer_cache keeps what it built. Tokenizer files next to the GGUF file
win: they are what a user put there on purpose.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvserve.model.checkpoint import tokenizer_cache
from kvserve.model.checkpoint.config import ModelConfig, read_json
from kvserve.model.checkpoint.gguf_config import TOKENIZER_MODEL_FIELD, TOKENIZER_MODEL_KEY
from kvserve.model.checkpoint.gguf_file import field, open_gguf
from kvserve.model.checkpoint.resolve import resolve_checkpoint

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def has_tokenizer(model_dir: str | Path) -> bool:
    """Whether a Hugging Face checkpoint directory has tokenizer files."""
    return any((Path(model_dir) / name).exists() for name in TOKENIZER_FILES)


def load_tokenizer(model_dir: str | Path, config: ModelConfig | None = None) -> Any | None:
    """A transformers tokenizer (it carries the chat template), or None if the checkpoint has none.

    Beside a GGUF file, a tokenizer.json (with its tokenizer_config.json)
    replaces the file's tokenizer; a tokenizer_config.json alone replaces
    its chat template (transformers cannot build a tokenizer from that file
    alone). `config`, the checkpoint's already loaded ModelConfig, spares a
    GGUF file a second parse just to learn whether it has a tokenizer.
    transformers is imported here, lazily: it is slow to import and the
    runner needs no tokenizer to run token ids.
    """
    checkpoint = resolve_checkpoint(model_dir)
    directory = checkpoint.directory
    if checkpoint.gguf is None or (directory / "tokenizer.json").exists():
        if not has_tokenizer(directory):
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    gguf = checkpoint.gguf
    tokenizer = tokenizer_cache.load_saved(gguf)  # saved only for a file that has one
    if tokenizer is None:
        if config is not None:
            kind = config.raw.get(TOKENIZER_MODEL_FIELD)
        else:
            kind = field(open_gguf(gguf), TOKENIZER_MODEL_KEY)
        if kind is None:
            return None
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(
            str(directory), gguf_file=gguf.name, local_files_only=True
        )
        tokenizer_cache.save(gguf, tokenizer)
    settings = directory / "tokenizer_config.json"
    if settings.exists():
        template = read_json(settings).get("chat_template")
        if template is not None:
            tokenizer.chat_template = template
    return tokenizer
