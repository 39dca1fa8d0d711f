"""Qwen3 (dense): no q/k/v biases by default, RMSNorm per head on q and k."""

from kvserve.model.checkpoint.config import ModelConfig
from kvserve.model.models.decoder import DecoderForCausalLM, DecoderOptions


class Qwen3ForCausalLM(DecoderForCausalLM):
    @staticmethod
    def options(config: ModelConfig) -> DecoderOptions:
        return DecoderOptions(
            qkv_bias=config.attention_bias,
            o_bias=config.attention_bias,
            qk_norm=True,
        )
