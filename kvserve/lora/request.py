"""Naming an adapter (vLLM's `LoRARequest`) and resolving it to a content identity.

No torch here: the engine, the scheduler and the KV cache see an adapter as plain
data. Its identity is a digest of its files (config and weights), so the cache can
never confuse two adapters that share a name or id (vLLM #30931), nor serve a
reloaded adapter the blocks of its old weights (vLLM #42125).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLED_WEIGHTS = ("adapter_model.bin", "adapter_model.pt")
MAX_CONFIG_BYTES = 1 << 20
"""PEFT writes a few hundred bytes; a larger config is no adapter's."""

SUPPORTED_TARGETS = (
    *("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    *("qkv_proj", "gate_up_proj"),  # Phi-3's, stored fused
)
"""PEFT's names for the attention and MLP projections of the dense families."""

UNSUPPORTED_OPTIONS = {
    "use_dora": "DoRA (use_dora)",
    "modules_to_save": "modules_to_save (fully trained copies of base modules)",
    "layers_to_transform": "layers_to_transform (an adapter on some layers only)",
    "rank_pattern": "rank_pattern (per-module ranks)",
    "alpha_pattern": "alpha_pattern (per-module alphas)",
}


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's: an adapter's name, a positive integer id, and its PEFT directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise ValueError(f"lora_int_id must be an integer, got {self.lora_int_id!r}")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")


@dataclass(frozen=True)
class Adapter:
    """A resolved adapter: where its files are, what they say, and their digest."""

    name: str
    path: Path
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    digest: str
    """sha256 of the config (canonical JSON) and the weights file, hex."""
    config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def identity(self) -> str:
        """The adapter's key in block hashes, the tiers and the events: its content."""
        return f"lora-sha256:{self.digest}"

    @property
    def scaling(self) -> float:
        """PEFT's: alpha / rank, or alpha / sqrt(rank) with rsLoRA."""
        return self.alpha / (self.rank**0.5 if self.use_rslora else self.rank)


def resolve_adapter(request: LoRARequest, max_lora_rank: int) -> Adapter:
    """Read and check `request`'s PEFT directory; a ValueError names what is wrong."""
    path = Path(request.lora_path).expanduser()
    where = f"adapter {request.lora_name!r} ({path})"
    if not path.is_dir():
        raise ValueError(f"{where}: not a directory")
    if not (path / WEIGHTS_FILE).is_file():
        pickled = [name for name in PICKLED_WEIGHTS if (path / name).exists()]
        if pickled:
            raise ValueError(
                f"{where}: only {WEIGHTS_FILE} is read; {pickled[0]} is a pickle, which can "
                "run code when loaded (convert it with safetensors)"
            )
        raise ValueError(f"{where}: no {WEIGHTS_FILE}")
    config_path = path / CONFIG_FILE
    if not config_path.exists():
        raise ValueError(f"{where}: no {CONFIG_FILE}")
    if not config_path.is_file():  # a FIFO would block the reader (the server's engine thread)
        raise ValueError(f"{where}: {CONFIG_FILE} is not a regular file")
    if config_path.stat().st_size > MAX_CONFIG_BYTES:
        raise ValueError(f"{where}: {CONFIG_FILE} is over {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{where}: no {CONFIG_FILE}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{where}: {CONFIG_FILE} is not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{where}: {CONFIG_FILE} is not a JSON object")
    return _adapter(request.lora_name, path, config, max_lora_rank, where)


def _adapter(name: str, path: Path, config: dict[str, Any], max_rank: int, where: str) -> Adapter:
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"{where}: peft_type {peft_type!r} is not supported (only LORA)")
    for key, what in UNSUPPORTED_OPTIONS.items():
        if config.get(key):
            raise ValueError(f"{where}: {what} is not supported")
    bias = config.get("bias", "none")
    if bias != "none":
        raise ValueError(f"{where}: bias {bias!r} is not supported (only 'none')")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{where}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise ValueError(f"{where}: rank {rank} exceeds max_lora_rank ({max_rank})")
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise ValueError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        raise ValueError(
            f"{where}: target_modules as a pattern ({targets!r}) is not supported: list the "
            f"modules ({', '.join(SUPPORTED_TARGETS)})"
        )
    if not isinstance(targets, list) or not targets:
        raise ValueError(f"{where}: target_modules must be a non-empty list")
    unknown = sorted(str(t) for t in targets if t not in SUPPORTED_TARGETS)
    if unknown:
        raise ValueError(
            f"{where}: target module(s) {', '.join(unknown)} not supported (supported: "
            f"{', '.join(SUPPORTED_TARGETS)})"
        )
    # What the computation reads (not the base model's path or PEFT's version), then
    # the weights: equal adapters under two names share blocks, a changed one never does.
    computed = {"r": rank, "lora_alpha": alpha, "use_rslora": bool(config.get("use_rslora")),
                "target_modules": sorted(set(targets))}  # fmt: skip
    digest = hashlib.sha256(json.dumps(computed, sort_keys=True).encode())
    with open(path / WEIGHTS_FILE, "rb") as f:
        for piece in iter(lambda: f.read(1 << 20), b""):
            digest.update(piece)
    return Adapter(
        name=name,
        path=path,
        rank=rank,
        alpha=float(alpha),
        use_rslora=bool(config.get("use_rslora", False)),
        target_modules=tuple(sorted(set(targets))),
        digest=digest.hexdigest(),
        config=config,
    )
