"""Registry: the `architectures[0]` of a config.json -> the class that runs it."""

from kvserve.model.checkpoint.errors import ModelLoadError
from kvserve.model.models.bamba import BambaForCausalLM
from kvserve.model.models.decoder import DecoderForCausalLM
from kvserve.model.models.gemma2 import Gemma2ForCausalLM
from kvserve.model.models.gemma3 import Gemma3ForCausalLM
from kvserve.model.models.llama import LlamaForCausalLM
from kvserve.model.models.mistral import MistralForCausalLM
from kvserve.model.models.mixtral import MixtralForCausalLM
from kvserve.model.models.olmoe import OlmoeForCausalLM
from kvserve.model.models.phi3 import Phi3ForCausalLM
from kvserve.model.models.qwen2 import Qwen2ForCausalLM
from kvserve.model.models.qwen2_moe import Qwen2MoeForCausalLM
from kvserve.model.models.qwen3 import Qwen3ForCausalLM
from kvserve.model.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[DecoderForCausalLM]] = {
    "BambaForCausalLM": BambaForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    # mixture of experts (kvserve.model.models.moe_decoder)
    "MixtralForCausalLM": MixtralForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def model_class(architecture: str) -> type[DecoderForCausalLM]:
    """The class for an architecture name, or a ModelLoadError naming the supported ones."""
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise ModelLoadError(
            f"architecture {architecture!r} is not supported; supported: {supported}"
        ) from None


__all__ = [
    "MODEL_REGISTRY",
    "BambaForCausalLM",
    "DecoderForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "OlmoeForCausalLM",
    "Phi3ForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "model_class",
]
