"""The torch room: checkpoint loading, the decoder models, paged attention, sampling.

Nothing outside this package imports torch. `ModelRunner.execute` is the
whole interface the engine uses; its input, `SeqChunk`, lives in
kvserve.batch (re-exported here for runner users).
"""

from kvserve.batch import SeqChunk
from kvserve.model.config import ModelConfig, load_model_config
from kvserve.model.errors import ModelLoadError
from kvserve.model.loader import load_model
from kvserve.model.models import MODEL_REGISTRY
from kvserve.model.runner import ModelRunner

__all__ = [
    "MODEL_REGISTRY",
    "ModelConfig",
    "ModelLoadError",
    "ModelRunner",
    "SeqChunk",
    "load_model",
    "load_model_config",
]
