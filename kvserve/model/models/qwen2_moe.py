"""Qwen2-MoE: Qwen2's attention (q/k/v biases, `qkv_bias`), experts in every
`decoder_sparse_step`-th layer not in `mlp_only_layers`, and beside the experts a shared
expert every token runs, scaled by a sigmoid gate."""

from kvserve.model.checkpoint.config import ModelConfig
from kvserve.model.models.decoder import DecoderOptions
from kvserve.model.models.moe_decoder import MoeForCausalLM


class Qwen2MoeForCausalLM(MoeForCausalLM):
    @staticmethod
    def options(config: ModelConfig) -> DecoderOptions:
        return DecoderOptions(qkv_bias=bool(config.raw.get("qkv_bias", True)))
