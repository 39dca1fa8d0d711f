"""The model's shape, read straight from a checkpoint's config.json (or a GGUF's metadata).

We parse the JSON ourselves instead of through transformers' config classes:
the fields we need are few, and transformers renamed some of them between
versions (`rope_theta` + `rope_scaling` became `rope_parameters` in v5), so
reading both spellings here keeps every supported transformers version working
and never touches a model hub.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvserve.model.checkpoint.errors import ModelLoadError
from kvserve.model.checkpoint.gguf_config import gguf_config_dicts
from kvserve.model.checkpoint.gguf_file import open_gguf
from kvserve.model.checkpoint.layer_windows import layer_windows
from kvserve.model.checkpoint.longrope import ROPE_TYPE_ALIASES, longrope_parameters
from kvserve.model.checkpoint.resolve import resolve_checkpoint

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
TIED_BY_DEFAULT = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
"""Architectures whose config class defaults tie_word_embeddings to True."""
ACTIVATIONS = {
    "Gemma2ForCausalLM": ("gelu_pytorch_tanh",),
    "Gemma3ForCausalLM": ("gelu_pytorch_tanh",),
}
"""Per architecture, the MLP activations it runs (default: 'silu' only)."""
MAMBA_HYBRID_ARCHITECTURES = ("BambaForCausalLM",)
PARTIAL_ROTARY_DEFAULTS = {"BambaForCausalLM": 0.5, "Phi3ForCausalLM": None}
"""Architectures that rotate only part of each head: the factor when the rope parameters
omit it (None: the config's top-level `partial_rotary_factor`, else 1)."""
"""Architectures whose layers are Mamba2 mixers or attention (`attn_layer_indices`)."""
DEFAULT_RMS_NORM_EPS = {"BambaForCausalLM": 1e-5}
"""Per architecture, rms_norm_eps when config.json omits it (default 1e-6)."""
LAYER_KINDS = ("attention", "mamba")


@dataclass(slots=True)
class RopeConfig:
    """Rotary embedding parameters; `scaling_type` is one of SUPPORTED_ROPE_TYPES."""

    theta: float = 10000.0
    scaling_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    """longrope: per-frequency divisors inside the original context, `long_factor` past it."""
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    """cos and sin are multiplied by it (longrope)."""


@dataclass(frozen=True, slots=True)
class MambaConfig:
    """The shape of a Mamba2 mixer (Bamba's `mamba_*` fields)."""

    num_heads: int
    head_dim: int
    num_groups: int
    """B and C are shared by num_heads / num_groups consecutive heads."""
    state_size: int
    conv_kernel: int
    intermediate_size: int
    """expand * hidden_size == num_heads * head_dim: the x (and gate) width."""
    chunk_size: int
    """Tokens per chunk of the chunked (SSD) scan."""
    conv_bias: bool = True
    proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    """dt is clamped into this range after softplus."""

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: x, B and C together."""
        return self.intermediate_size + 2 * self.num_groups * self.state_size


@dataclass(slots=True)
class ModelConfig:
    """What the decoder, the loader and the KV cache sizing need to know."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    eos_token_ids: set[int] = field(default_factory=set)
    bos_token_id: int | None = None
    checkpoint_dtype: str | None = None
    hidden_act: str = "silu"
    layer_windows: list[int | None] = field(default_factory=list)
    """Per layer: its sliding window in tokens (keys p-W+1..p), None for full attention.
    Empty means every layer attends to the full context."""
    layer_kinds: list[str] = field(default_factory=list)
    """Per layer: 'attention' or 'mamba' (one of LAYER_KINDS); filled by from_dict for every
    architecture (all 'attention' except in the Mamba2 hybrids)."""
    mamba: MambaConfig | None = None
    """The Mamba2 mixer shape of a hybrid (None when no layer is 'mamba')."""
    partial_rotary_factor: float = 1.0
    """Share of each attention head that is rotated (Bamba: 0.5); see `rotary_dim`."""
    raw: dict[str, Any] = field(default_factory=dict, repr=False)
    """The whole config.json (a GGUF file's metadata in its shape), for architecture-specific
    fields."""

    @property
    def rotary_dim(self) -> int:
        """Leading dims of each head that the rotary embedding rotates (the rest pass)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        """Parse config.json (and generation_config.json for the eos ids)."""
        arch = architecture_of(raw)
        hidden = _required(raw, "hidden_size")
        heads = _required(raw, "num_attention_heads")
        kv_heads = raw.get("num_key_value_heads") or heads
        head_dim = raw.get("head_dim") or hidden // heads
        if heads % kv_heads:
            raise ModelLoadError(
                f"num_attention_heads ({heads}) must be a multiple of "
                f"num_key_value_heads ({kv_heads})"
            )
        act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
        allowed = ACTIVATIONS.get(arch, ("silu",))
        if act not in allowed:
            raise ModelLoadError(f"hidden_act {act!r} is not supported (only {allowed})")
        num_layers = _required(raw, "num_hidden_layers")
        layer_kinds = ["attention"] * num_layers
        mamba = None
        partial = 1.0
        if arch in MAMBA_HYBRID_ARCHITECTURES:
            layer_kinds = _hybrid_layer_kinds(raw, num_layers)
            mamba = _mamba_config(raw, hidden)
        if arch in PARTIAL_ROTARY_DEFAULTS:
            partial = _partial_rotary_factor(raw, head_dim, PARTIAL_ROTARY_DEFAULTS[arch])
        eos = _token_ids((generation or {}).get("eos_token_id"))
        if not eos:
            eos = _token_ids(raw.get("eos_token_id"))
        return cls(
            architecture=arch,
            vocab_size=_required(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_required(raw, "intermediate_size"),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", DEFAULT_RMS_NORM_EPS.get(arch, 1e-6))),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rope=_rope_config(raw, arch in PARTIAL_ROTARY_DEFAULTS, arch, int(head_dim * partial)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", arch in TIED_BY_DEFAULT)),
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            eos_token_ids=eos,
            bos_token_id=raw.get("bos_token_id"),
            checkpoint_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            hidden_act=act,
            layer_windows=layer_windows(raw, arch, num_layers),
            layer_kinds=layer_kinds,
            mamba=mamba,
            partial_rotary_factor=partial,
            raw=raw,
        )


def read_json(path: Path) -> dict[str, Any]:
    """Read one JSON file of a checkpoint; a missing or broken file is a ModelLoadError."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ModelLoadError(f"{path.name} not found in {path.parent}") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return data


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """A checkpoint's config: config.json plus generation_config.json's eos ids, or a GGUF
    file's metadata (kvserve.model.checkpoint.resolve says which)."""
    return ModelConfig.from_dict(*read_config_files(model_dir))


def read_config_files(model_dir: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json, generation_config.json or {}) of a checkpoint, or their GGUF equivalents."""
    checkpoint = resolve_checkpoint(model_dir)
    if checkpoint.gguf is not None:
        return gguf_config_dicts(open_gguf(checkpoint.gguf))
    return read_hf_config_files(checkpoint.directory)


def read_hf_config_files(model_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json, generation_config.json or {}) of a Hugging Face checkpoint directory."""
    raw = read_json(model_dir / "config.json")
    gen_path = model_dir / "generation_config.json"
    generation = read_json(gen_path) if gen_path.exists() else {}
    return raw, generation


def architecture_of(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures")
    if not archs or not isinstance(archs, list):
        raise ModelLoadError("config.json has no 'architectures' list")
    return str(archs[0])


def _required(raw: dict[str, Any], key: str) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or value <= 0:
        raise ModelLoadError(f"config.json needs a positive integer {key!r}, got {value!r}")
    return value


def _token_ids(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def _rope_config(
    raw: dict[str, Any], allow_partial: bool = False, arch: str = "", rotary_dim: int = 0
) -> RopeConfig:
    """Accept both `rope_parameters` (transformers 5) and `rope_theta` + `rope_scaling`.

    A partial rotary factor is refused unless the architecture applies it (`allow_partial`):
    the factor itself is then read by `_partial_rotary_factor`.
    """
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = merged.get("rope_type") or merged.get("type") or "default"
    kind = ROPE_TYPE_ALIASES.get(arch, {}).get(kind, kind)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"rope scaling type {kind!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
        )
    if not allow_partial and float(merged.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelLoadError("partial_rotary_factor != 1 is not supported")
    rope = RopeConfig(theta=theta, scaling_type=kind)
    if kind == "default":
        return rope
    if kind == "longrope":
        for key, value in longrope_parameters(merged, raw, rotary_dim).items():
            setattr(rope, key, value)
        return rope
    try:
        rope.factor = float(merged["factor"])
        if kind == "llama3":
            rope.low_freq_factor = float(merged["low_freq_factor"])
            rope.high_freq_factor = float(merged["high_freq_factor"])
            rope.original_max_position_embeddings = int(
                merged.get("original_max_position_embeddings")
                or raw.get("max_position_embeddings", 8192)
            )
    except KeyError as exc:
        raise ModelLoadError(f"rope scaling {kind!r} lacks the parameter {exc.args[0]!r}") from None
    return rope


def _partial_rotary_factor(raw: dict[str, Any], head_dim: int, default: float | None) -> float:
    """The factor as transformers reads it: an explicit `rope_parameters` (or `rope_scaling`)
    entry first; else `default` (BambaConfig forces 0.5 whatever the top level says), else
    (None) the top-level `partial_rotary_factor`, else 1 (Phi3Config)."""
    merged = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
    fallback = default if default is not None else raw.get("partial_rotary_factor", 1.0)
    factor = float(merged.get("partial_rotary_factor", fallback))
    rotary = int(head_dim * factor)
    if not 0.0 < factor <= 1.0 or rotary < 2 or rotary % 2:
        raise ModelLoadError(
            f"partial_rotary_factor {factor} of head_dim {head_dim} must rotate an even, "
            f"positive number of dims (got {rotary})"
        )
    return factor


def _hybrid_layer_kinds(raw: dict[str, Any], num_layers: int) -> list[str]:
    """'attention' at `attn_layer_indices` (null or absent: none, as in transformers), else
    'mamba'."""
    indices = raw.get("attn_layer_indices") or []
    if not isinstance(indices, list) or not all(isinstance(i, int) for i in indices):
        raise ModelLoadError(f"attn_layer_indices must be a list of ints, got {indices!r}")
    outside = [i for i in indices if not 0 <= i < num_layers]
    if outside:
        raise ModelLoadError(
            f"attn_layer_indices {outside} are outside the {num_layers} layers (0-based)"
        )
    return ["attention" if i in indices else "mamba" for i in range(num_layers)]


def _mamba_config(raw: dict[str, Any], hidden: int) -> MambaConfig:
    """The Mamba2 mixer shape; the fields that size the state are required."""
    heads = _required(raw, "mamba_n_heads")
    groups = _required(raw, "mamba_n_groups")
    state = _required(raw, "mamba_d_state")
    kernel = _required(raw, "mamba_d_conv")
    expand = _required(raw, "mamba_expand")
    chunk = _required(raw, "mamba_chunk_size")
    intermediate = expand * hidden
    head_dim = raw.get("mamba_d_head", "auto")
    if head_dim in ("auto", None):
        head_dim = intermediate // heads
    if not isinstance(head_dim, int) or head_dim * heads != intermediate:
        raise ModelLoadError(
            f"mamba_n_heads ({heads}) * mamba_d_head ({head_dim}) must equal "
            f"mamba_expand * hidden_size ({intermediate})"
        )
    if heads % groups:
        raise ModelLoadError(f"mamba_n_heads ({heads}) must be a multiple of mamba_n_groups")
    return MambaConfig(
        num_heads=heads,
        head_dim=head_dim,
        num_groups=groups,
        state_size=state,
        conv_kernel=kernel,
        intermediate_size=intermediate,
        chunk_size=chunk,
        conv_bias=bool(raw.get("mamba_conv_bias", True)),
        proj_bias=bool(raw.get("mamba_proj_bias", False)),
        time_step_limit=_time_step_limit(raw.get("time_step_limit")),
    )


def _time_step_limit(value: Any) -> tuple[float, float]:
    """(low, high); transformers saves infinity as {"__float__": "Infinity"}."""
    if value is None:
        return (0.0, math.inf)
    try:
        low, high = (_json_float(v) for v in value)
    except (TypeError, ValueError):
        raise ModelLoadError(f"time_step_limit must be [low, high], got {value!r}") from None
    if not low <= high:
        raise ModelLoadError(f"time_step_limit must have low <= high, got {value!r}")
    return (low, high)


def _json_float(value: Any) -> float:
    if isinstance(value, dict) and "__float__" in value:
        value = value["__float__"]
    if isinstance(value, bool):
        raise TypeError(value)
    return float(value)
