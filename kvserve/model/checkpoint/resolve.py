"""What a model path names: a Hugging Face checkpoint directory or one GGUF file.

Every reader of a checkpoint (the loader, the config reader, the tokenizer,
the tiers' fingerprint) resolves the user's path here, so they all agree on
what it is: a path is decided once, by these rules, and never guessed again.

- a file: a GGUF file (its magic is checked when it is opened);
- a directory with config.json and *.safetensors: a Hugging Face checkpoint;
- otherwise, a directory with exactly one *.gguf: that file (tokenizer files
  next to it are still read from the directory); several: refused, named;
- a directory with config.json and neither weights nor .gguf: a Hugging
  Face checkpoint, whose loader names the missing weights; without
  config.json either: refused, naming both.

llama.cpp's split files (`name-00001-of-00003.gguf`) are refused by name:
only single-file GGUF is supported.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from kvserve.model.checkpoint.errors import ModelLoadError

SHARD_NAME = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
"""gguf-split's shard names; `-00001-of-00001` is a whole model in one file."""


@dataclass(frozen=True, slots=True)
class CheckpointPath:
    """A resolved model path."""

    directory: Path
    """The Hugging Face checkpoint directory, or the folder holding the GGUF file."""
    gguf: Path | None = None
    """The GGUF file; None for a Hugging Face directory."""


def resolve_checkpoint(path: str | Path) -> CheckpointPath:
    """Tell a Hugging Face directory from a GGUF file; raise ModelLoadError for anything else."""
    path = Path(path)
    if path.is_file():
        _refuse_shard(path.name)
        return CheckpointPath(path.parent, path)
    if not path.is_dir():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    has_config = (path / "config.json").exists()
    if has_config and any(path.glob("*.safetensors")):
        return CheckpointPath(path)
    ggufs = sorted(p for p in path.glob("*.gguf") if p.is_file())
    if not ggufs:
        if not has_config:
            raise ModelLoadError(
                f"config.json not found in {path}, and no .gguf file either: "
                "not a Hugging Face checkpoint directory nor a GGUF one"
            )
        return CheckpointPath(path)
    if len(ggufs) == 1:
        _refuse_shard(ggufs[0].name)
        return CheckpointPath(path, ggufs[0])
    shards = [p.name for p in ggufs if _is_shard(p.name)]
    if len(shards) == len(ggufs):
        raise ModelLoadError(
            f"{path} holds a sharded GGUF model ({len(shards)} files: {shards[0]}, ...): "
            "only single-file GGUF is supported (merge it with llama-gguf-split --merge)"
        )
    names = ", ".join(p.name for p in ggufs)
    raise ModelLoadError(
        f"{path} holds {len(ggufs)} .gguf files ({names}): pass the one to load as the model path"
    )


def _is_shard(name: str) -> bool:
    match = SHARD_NAME.search(name)
    return match is not None and int(match.group(2)) > 1


def _refuse_shard(name: str) -> None:
    if _is_shard(name):
        raise ModelLoadError(
            f"{name} is one shard of a sharded GGUF model: only single-file GGUF is supported "
            "(merge the shards with llama-gguf-split --merge)"
        )
