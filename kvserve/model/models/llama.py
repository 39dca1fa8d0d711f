"""Llama (2, 3, 3.1, 3.2) and the many checkpoints that reuse its layout."""

from kvserve.model.checkpoint.config import ModelConfig
from kvserve.model.models.decoder import DecoderForCausalLM, DecoderOptions


class LlamaForCausalLM(DecoderForCausalLM):
    """`attention_bias` covers q/k/v/o, `mlp_bias` the three MLP projections."""

    @staticmethod
    def options(config: ModelConfig) -> DecoderOptions:
        return DecoderOptions(
            qkv_bias=config.attention_bias,
            o_bias=config.attention_bias,
            mlp_bias=config.mlp_bias,
        )
