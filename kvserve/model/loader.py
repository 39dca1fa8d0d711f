"""Load a local Hugging Face checkpoint directory into a decoder.

Only safetensors weights are read (a pickle file runs code when loaded). The
model is built on the meta device, every checkpoint name and shape is checked
against it before any tensor is read, and the tensors are then assigned
directly in the target dtype and device: no random init, no second copy.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from kvserve.model.config import (
    ModelConfig,
    architecture_of,
    read_config_files,
    read_json,
)
from kvserve.model.errors import ModelLoadError
from kvserve.model.models import DecoderForCausalLM, model_class

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Names some checkpoints carry that hold nothing we load (recomputed buffers).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(
    model_dir: str | Path, dtype: torch.dtype, device: torch.device
) -> tuple[DecoderForCausalLM, ModelConfig]:
    """Build the checkpoint's model with its weights; raise ModelLoadError when we cannot."""
    raw, generation = read_config_files(model_dir)
    cls = model_class(architecture_of(raw))
    config = ModelConfig.from_dict(raw, generation)
    files = weight_files(model_dir)
    with torch.device("meta"):
        model = cls(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    located = _locate(files, expected, config.tie_word_embeddings)
    state: dict[str, torch.Tensor] = {}
    for path, names in _by_file(located).items():
        with safe_open(str(path), framework="pt") as f:
            for name in names:
                state[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False)
    model.eval()
    model.init_rotary(device)
    return model, config


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: sharded (index), single, or any *.safetensors."""
    path = Path(model_dir)
    index = path / INDEX_FILE
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index} has no 'weight_map'")
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ModelLoadError(f"shards listed in {INDEX_FILE} are missing: {missing}")
        return files
    if (path / SINGLE_FILE).exists():
        return [path / SINGLE_FILE]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        extra = " (pickle *.bin weights are not loaded)" if any(path.glob("*.bin")) else ""
        raise ModelLoadError(f"no *.safetensors weights in {path}{extra}")
    return files


def _locate(files: list[Path], expected: dict[str, tuple[int, ...]], tied: bool) -> dict[str, Path]:
    """Map every expected name to its file, checking names and shapes first."""
    located: dict[str, Path] = {}
    unexpected: list[str] = []
    wrong_shapes: list[str] = []
    for path in files:
        try:
            handle = safe_open(str(path), framework="pt")
        except Exception as exc:
            raise ModelLoadError(f"cannot read weights file {path}: {exc}") from None
        with handle as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name.endswith(IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                    continue
                if name not in expected:
                    unexpected.append(name)
                    continue
                shape = tuple(f.get_slice(name).get_shape())
                if shape != expected[name]:
                    wrong_shapes.append(f"{name}: checkpoint {shape}, model {expected[name]}")
                located[name] = path
    missing = sorted(set(expected) - set(located))
    problems = []
    if missing:
        problems.append(f"missing tensors: {_short(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_short(sorted(unexpected))}")
    if wrong_shapes:
        problems.append(f"wrong shapes: {_short(wrong_shapes)}")
    if problems:
        raise ModelLoadError(f"weights do not match the model config: {'; '.join(problems)}")
    return located


def _by_file(located: dict[str, Path]) -> dict[Path, list[str]]:
    grouped: dict[Path, list[str]] = {}
    for name, path in located.items():
        grouped.setdefault(path, []).append(name)
    return grouped


def _short(items: list[str], limit: int = 8) -> str:
    more = f" ... and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more
