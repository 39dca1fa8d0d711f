"""Mistral: Llama's layers without biases, and one optional sliding window for every layer.

The window (`sliding_window`, MistralConfig's default 4096 when the key is absent,
null in most later checkpoints) is read by kvserve.model.checkpoint.layer_windows:
every layer then runs in a sliding-window KV cache group, keeping only the blocks
its window reads, and its attention reads only those keys.
"""

from kvserve.model.checkpoint.config import ModelConfig
from kvserve.model.models.decoder import DecoderForCausalLM, DecoderOptions


class MistralForCausalLM(DecoderForCausalLM):
    @staticmethod
    def options(config: ModelConfig) -> DecoderOptions:
        return DecoderOptions()
