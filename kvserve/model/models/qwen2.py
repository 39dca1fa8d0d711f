"""Qwen2 and Qwen2.5: Llama's layout with biases on q, k and v (not on o)."""

from kvserve.model.checkpoint.config import ModelConfig
from kvserve.model.models.decoder import DecoderForCausalLM, DecoderOptions


class Qwen2ForCausalLM(DecoderForCausalLM):
    @staticmethod
    def options(config: ModelConfig) -> DecoderOptions:
        return DecoderOptions(qkv_bias=True, o_bias=False)
