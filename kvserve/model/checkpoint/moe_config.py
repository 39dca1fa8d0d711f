"""The mixture-of-experts fields of a config: how many experts, how many per token, where.

Each family spells them its own way (transformers' config classes): Qwen3-MoE
has `num_experts` (saved by transformers 5 as `num_local_experts`),
`moe_intermediate_size`, `norm_topk_prob`, and dense layers at
`mlp_only_layers` or off the `decoder_sparse_step`; Qwen2-MoE the same plus
its shared expert's `shared_expert_intermediate_size`; OLMoE has
`num_experts` and `norm_topk_prob` with the experts' width in
`intermediate_size`; Mixtral has `num_local_experts` and always renormalises
the top-k weights. They are read here, from the raw config the ModelConfig
keeps, so the dense families' config reader stays as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.model.checkpoint.config import ModelConfig
from kvserve.model.checkpoint.errors import ModelLoadError

MOE_ARCHITECTURES = (
    "MixtralForCausalLM",
    "OlmoeForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
)


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """What a sparse feed-forward block needs, and which layers have one."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool
    """Divide the top-k softmax probabilities by their sum (Mixtral always does)."""
    sparse_layers: tuple[bool, ...]
    """Per layer: experts (True) or the dense MLP of `intermediate_size` (False)."""
    weights_in_float: bool
    """Mixtral scales each expert's output by the float32 weight; the others cast it to the
    hidden states' dtype first (equal in float32, one rounding apart in bfloat16)."""
    shared_expert_intermediate_size: int = 0
    """Qwen2-MoE: the width of the shared expert every token runs, its output scaled by a
    sigmoid gate (0: none)."""


def moe_config(config: ModelConfig) -> MoeConfig:
    """The MoE fields of a config whose architecture is one of MOE_ARCHITECTURES."""
    raw, arch, layers = config.raw, config.architecture, config.num_layers
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        experts = _expert_count(raw)
        step = _positive(raw, "decoder_sparse_step", 1)
        dense = raw.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
            raise ModelLoadError(f"mlp_only_layers must be a list of ints, got {dense!r}")
        sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
        shared = 0
        if arch == "Qwen2MoeForCausalLM":
            shared = _positive(raw, "shared_expert_intermediate_size")
        return _checked(
            experts,
            _positive(raw, "num_experts_per_tok"),
            _positive(raw, "moe_intermediate_size"),
            bool(raw.get("norm_topk_prob", False)),
            sparse,
            weights_in_float=False,
            shared=shared,
        )
    if arch == "OlmoeForCausalLM":
        return _checked(
            _expert_count(raw),
            _positive(raw, "num_experts_per_tok"),
            config.intermediate_size,
            bool(raw.get("norm_topk_prob", False)),
            (True,) * layers,
            weights_in_float=False,
        )
    if arch == "MixtralForCausalLM":
        if raw.get("sliding_window") is not None:
            raise ModelLoadError(
                f"Mixtral's sliding_window ({raw['sliding_window']}) is not supported yet: "
                "a config with sliding_window null runs"
            )
        return _checked(
            _positive(raw, "num_local_experts"),
            _positive(raw, "num_experts_per_tok"),
            config.intermediate_size,
            True,
            (True,) * layers,
            weights_in_float=True,
        )
    raise ModelLoadError(f"{arch} is not a mixture-of-experts architecture")


def _checked(
    experts: int,
    top_k: int,
    width: int,
    norm: bool,
    sparse: tuple[bool, ...],
    weights_in_float: bool,
    shared: int = 0,
) -> MoeConfig:
    if top_k > experts:
        raise ModelLoadError(f"num_experts_per_tok ({top_k}) exceeds the {experts} experts")
    return MoeConfig(experts, top_k, width, norm, sparse, weights_in_float, shared)


def _expert_count(raw: dict[str, Any]) -> int:
    """`num_experts`, which transformers 5 saves as `num_local_experts` (an attribute_map)."""
    key = "num_experts" if "num_experts" in raw else "num_local_experts"
    return _positive(raw, key)


def _positive(raw: dict[str, Any], key: str, default: int | None = None) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelLoadError(f"config.json needs a positive integer {key!r}, got {value!r}")
    return value
