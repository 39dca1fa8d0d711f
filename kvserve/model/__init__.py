"""The torch room, one folder per concern: checkpoint/ (reading HF and GGUF checkpoints),
models/ and layers/ (the architectures), attention/ (the backends), quant/ (packed
weights), memory/ (the KV pool), sampling/; at the top what composes them (the runner,
the loader). docs/design.md has the map and the rooms' import rules.

Nothing outside this package imports torch. `ModelRunner.execute` is the
whole interface the engine uses; its input, `SeqChunk`, lives in
kvserve.batch (re-exported here for runner users).

The names below are imported on first use, so a reader of checkpoints that
needs no model (the router's tokenizer: kvserve.model.checkpoint.tokenizer) does not
load the model code with this package.

The files at the top of this package compose the rooms (no room imports them):

    runner.py       ModelRunner: the pool (with a draft model's share of each block),
                    one step's forward, sampling, logprobs
    chunk_check.py  a scheduled chunk's plan checked before a step (ValueError naming
                    its request)
    draft_model.py  speculative decoding's draft model: its K/V by the target's block
                    ids (one manager for both), every step's tokens, then k greedy drafts
    loader.py       a checkpoint -> the model: reads through checkpoint/, builds the
                    architecture (models/), packs through quant/, fuses projections
    device.py       the device check (cpu, cuda, cuda:N; anything else refused by name)
                    and the dtype: auto's rule, the CPU's start-up line, bfloat16's
                    warning on a CPU without native bfloat16
    threads.py      the default CPU thread count (physical cores, affinity, cgroup quota)
                    and which OpenMP runtime the process runs (for the load log)
    cpu_malloc.py   glibc keeps freed memory for the next step (mmap and trim thresholds
                    raised once): a step's large tensors reuse pages, no page faults
    fused_decode.py on the CPU, a decode step's layers as one C call where every layer
                    is the plain decoder with packed projections (the same bits)
    demo.py, demo_text.py   `demo:random`: a tiny random Qwen3 built locally, its tokenizer
                    trained on a built-in text
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvserve.batch import SeqChunk
    from kvserve.model.checkpoint.config import ModelConfig, load_model_config
    from kvserve.model.checkpoint.errors import ModelLoadError
    from kvserve.model.loader import load_model
    from kvserve.model.models import MODEL_REGISTRY
    from kvserve.model.runner import ModelRunner

_WHERE = {
    "SeqChunk": "kvserve.batch",
    "ModelConfig": "kvserve.model.checkpoint.config",
    "load_model_config": "kvserve.model.checkpoint.config",
    "ModelLoadError": "kvserve.model.checkpoint.errors",
    "load_model": "kvserve.model.loader",
    "MODEL_REGISTRY": "kvserve.model.models",
    "ModelRunner": "kvserve.model.runner",
}

__all__ = [
    "MODEL_REGISTRY",
    "ModelConfig",
    "ModelLoadError",
    "ModelRunner",
    "SeqChunk",
    "load_model",
    "load_model_config",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
