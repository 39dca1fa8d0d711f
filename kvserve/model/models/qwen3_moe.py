"""Qwen3-MoE: Qwen3's attention (per-head q/k norm), experts in every `decoder_sparse_step`-th
layer not in `mlp_only_layers`, top-k weights renormalised when `norm_topk_prob` says so."""

from kvserve.model.checkpoint.config import ModelConfig
from kvserve.model.models.decoder import DecoderOptions
from kvserve.model.models.moe_decoder import MoeForCausalLM


class Qwen3MoeForCausalLM(MoeForCausalLM):
    @staticmethod
    def options(config: ModelConfig) -> DecoderOptions:
        return DecoderOptions(
            qkv_bias=config.attention_bias, o_bias=config.attention_bias, qk_norm=True
        )
