"""Mixtral: Llama's attention, every MLP a `block_sparse_moe` of experts named w1/w3/w2,
top-k weights always renormalised (the softmax of the top-k logits)."""

from kvserve.model.checkpoint.config import ModelConfig
from kvserve.model.layers.moe import MixtralExpert
from kvserve.model.models.decoder import DecoderOptions
from kvserve.model.models.moe_decoder import MoeForCausalLM


class MixtralForCausalLM(MoeForCausalLM):
    BLOCK_NAME = "block_sparse_moe"
    EXPERT = MixtralExpert

    @staticmethod
    def options(config: ModelConfig) -> DecoderOptions:
        return DecoderOptions()
