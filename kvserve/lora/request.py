"""Naming an adapter (vLLM's `LoRARequest`) and resolving it to a content identity.

No torch here: the engine, the scheduler and the KV cache see an adapter as plain
data. Its identity is a digest of its files (config and weights), so the cache can
never confuse two adapters that share a name or id (vLLM #30931), nor serve a
reloaded adapter the blocks of its old weights (vLLM #42125).
"""

from __future__ import annotations

import hashlib
import json
import re
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
    *("w1", "w3", "w2"),  # Mixtral's experts (adapters saved with transformers 4)
)
"""PEFT's names for the attention and MLP projections of every family: the dense MLPs,
Qwen2-MoE's shared expert, and the experts one by one (transformers 4's layout)."""

SUPPORTED_PARAMETERS = ("gate_up_proj", "down_proj")
"""`target_parameters`: the experts' fused 3-D weights of transformers 5 (Qwen2/3-MoE,
OLMoE, Mixtral), which PEFT adapts with one LoRA per expert stacked along the rank."""

REFUSED_TARGETS = {
    "gate": "the router (gate): an adapted router would pick other experts per adapter",
    "shared_expert_gate": "the shared expert's gate (shared_expert_gate)",
    "lm_head": "lm_head", "embed_tokens": "embed_tokens (embeddings)",
}  # fmt: skip
"""Modules PEFT can target that kvserve refuses by name."""

MAX_PATTERNS = 256
"""rank_pattern / alpha_pattern: entries at most (PEFT writes one per fused expert weight)."""
MAX_PATTERN_CHARS = 256

UNSUPPORTED_OPTIONS = {
    "use_dora": "DoRA (use_dora)",
    "modules_to_save": "modules_to_save (fully trained copies of base modules)",
    "layers_to_transform": "layers_to_transform (an adapter on some layers only)",
    "lora_bias": "lora_bias (a bias on lora_B)",
    "trainable_token_indices": "trainable_token_indices (trained embedding rows)",
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
    target_parameters: tuple[str, ...] = ()
    rank_pattern: tuple[tuple[str, int], ...] = ()
    """PEFT's per-module ranks ({regex: rank}, in the config's order); PEFT writes one
    for the experts' fused gate_up_proj (twice the rank: gate's and up's side by side)."""
    alpha_pattern: tuple[tuple[str, float], ...] = ()

    @property
    def identity(self) -> str:
        """The adapter's key in block hashes, the tiers and the events: its content."""
        return f"lora-sha256:{self.digest}"

    @property
    def scaling(self) -> float:
        """PEFT's: alpha / rank, or alpha / sqrt(rank) with rsLoRA."""
        return self.alpha / (self.rank**0.5 if self.use_rslora else self.rank)

    def rank_and_scaling(self, key: str) -> tuple[int, float]:
        """The rank and scaling of the module or parameter `key` (its path in the
        transformers model, e.g. model.layers.0.mlp.experts.gate_up_proj), as PEFT
        resolves rank_pattern and alpha_pattern: the first pattern matching its end."""
        rank = _pattern_value(self.rank_pattern, key, self.rank)
        alpha = _pattern_value(self.alpha_pattern, key, self.alpha)
        return int(rank), alpha / (rank**0.5 if self.use_rslora else rank)

    @property
    def max_rank(self) -> int:
        return max([self.rank, *(r for _, r in self.rank_pattern)])


def _pattern_value(patterns: tuple[tuple[str, Any], ...], key: str, default: Any) -> Any:
    for pattern, value in patterns:  # peft.utils.other.get_pattern_key's rule
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


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
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise ValueError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    rank_pattern = _patterns(config, "rank_pattern", where, integer=True)
    alpha_pattern = _patterns(config, "alpha_pattern", where, integer=False)
    top = max([rank, *(r for _, r in rank_pattern)])
    if top > max_rank:
        raise ValueError(f"{where}: rank {top} exceeds max_lora_rank ({max_rank})")
    targets = _names(config, "target_modules", where)
    if isinstance(targets, str):
        raise ValueError(
            f"{where}: target_modules as a pattern ({targets!r}) is not supported: list the "
            f"modules ({', '.join(SUPPORTED_TARGETS)})"
        )
    parameters = _names(config, "target_parameters", where)
    if isinstance(parameters, str):
        raise ValueError(f"{where}: target_parameters must be a list, got {parameters!r}")
    if not targets and not parameters:
        raise ValueError(f"{where}: target_modules must be a non-empty list")
    for target in targets:
        leaf = target.rsplit(".", 1)[-1]
        if leaf in REFUSED_TARGETS:
            raise ValueError(
                f"{where}: target module {target}: {REFUSED_TARGETS[leaf]} is not supported"
            )
    unknown = sorted(t for t in targets if t.rsplit(".", 1)[-1] not in SUPPORTED_TARGETS)
    if unknown:
        raise ValueError(
            f"{where}: target module(s) {', '.join(unknown)} not supported (supported: "
            f"{', '.join(SUPPORTED_TARGETS)})"
        )
    for target in parameters:
        leaf = target.removesuffix(".weight").rsplit(".", 1)[-1]
        if leaf in REFUSED_TARGETS:
            raise ValueError(
                f"{where}: target parameter {target}: {REFUSED_TARGETS[leaf]} is not supported"
            )
        if leaf not in SUPPORTED_PARAMETERS or target.endswith(".weight"):
            raise ValueError(
                f"{where}: target parameter {target} not supported (supported: the experts' "
                f"fused {' and '.join(SUPPORTED_PARAMETERS)})"
            )
    # What the computation reads (not the base model's path or PEFT's version), then
    # the weights: equal adapters under two names share blocks, a changed one never does.
    computed: dict[str, Any] = {
        "r": rank, "lora_alpha": alpha, "use_rslora": bool(config.get("use_rslora")),
        "target_modules": sorted(set(targets)),
    }  # fmt: skip
    if parameters or rank_pattern or alpha_pattern:  # absent: the digests adapters had before
        computed.update(target_parameters=sorted(set(parameters)), rank_pattern=rank_pattern,
                        alpha_pattern=alpha_pattern)  # fmt: skip
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
        target_parameters=tuple(sorted(set(parameters))),
        rank_pattern=tuple((p, int(v)) for p, v in rank_pattern),
        alpha_pattern=tuple((p, float(v)) for p, v in alpha_pattern),
    )


def _names(config: dict[str, Any], key: str, where: str) -> list[str] | str:
    """A config's list of module or parameter names (absent or null: none)."""
    value = config.get(key)
    if value is None or isinstance(value, str):
        return value or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where}: {key} must be a list of names")
    return value


def _patterns(config: dict[str, Any], key: str, where: str, integer: bool) -> list[tuple[str, Any]]:
    """rank_pattern or alpha_pattern, checked: each a regular expression (bounded in count
    and length) with a positive number."""
    value = config.get(key) or {}
    if not isinstance(value, dict):
        raise ValueError(f"{where}: {key} must be an object")
    if len(value) > MAX_PATTERNS:
        raise ValueError(f"{where}: {key} has {len(value)} entries (at most {MAX_PATTERNS})")
    out = []
    for pattern, number in value.items():
        if len(pattern) > MAX_PATTERN_CHARS:
            raise ValueError(f"{where}: {key} pattern over {MAX_PATTERN_CHARS} characters")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"{where}: {key} pattern {pattern!r} is not a regex ({exc})") from None
        kinds = (int,) if integer else (int, float)
        if isinstance(number, bool) or not isinstance(number, kinds) or number <= 0:
            raise ValueError(
                f"{where}: {key}[{pattern!r}] must be a positive number, got {number!r}"
            )
        out.append((pattern, number))
    return out
