"""Shared fixtures: tiny random checkpoints written by transformers itself, and their oracle.

Every checkpoint is created here (no hub, no network): transformers builds
the model from a config with a fixed seed and saves it with safetensors, once
per test run: the first pytest-xdist worker to ask saves it in a folder the
run's workers share, the others load it from there (the oracle is the saved model).
Between them the three cover untied and tied embeddings, a sharded save,
biases (Llama's optional ones, Qwen2's q/k/v), Qwen3's q/k norm, an explicit
head_dim, a non-default rope_theta and Llama 3.1 rope scaling.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# The oracles compare bits with transformers: float32 engines (and the servers the tests
# start, which inherit it) run the exact mode; tests of the fast mode delete it.
os.environ.setdefault("KVSERVE_EXACT", "1")

import pytest
import torch
import transformers

from tests._shared import saved_once, shared_dir

# Tiny models: one thread is fastest, and immune to a machine busy with other work.
torch.set_num_threads(1)
if not torch.cuda.is_available():
    # The "triton" backend's kernels run in Triton's interpreter on the CPU; it must be on
    # before triton is first imported (its own library functions are defined then).
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Its transformers classes load their modeling code (triton with it): after the line above.
from tests.model.dense_archs import DENSE_ARCHS, liven  # noqa: E402

COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,
    max_position_embeddings=512,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
    initializer_range=0.2,  # livelier than 0.02: greedy output does not collapse to one token
)

ARCHS = {
    "llama": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            head_dim=32,  # not hidden / heads: must be read from the config
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        {},
    ),
    "qwen2": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(rope_theta=1_000_000.0, tie_word_embeddings=True),
        {"max_shard_size": "40KB"},
    ),
    "qwen3": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(num_hidden_layers=3, head_dim=16, tie_word_embeddings=False),
        {},
    ),
}

# Built on demand (not in ARCHS, which every oracle test runs): Gemma 3 text with
# 5 sliding-window layers and 1 global one. A window of 7 tokens over blocks of 4
# really releases blocks; the scale, rope bases and both soft-caps differ from
# their defaults so that each must be read from the config. Tied embeddings.
HYBRID_ARCHS = {
    "gemma3": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        dict(
            num_hidden_layers=6,
            head_dim=16,
            layer_types=["sliding_attention"] * 5 + ["full_attention"],
            sliding_window=7,
            query_pre_attn_scalar=24,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 50_000.0},
            },
            final_logit_softcapping=10.0,
            attn_logit_softcapping=20.0,
            attn_implementation="eager",  # the plain reference path
            initializer_range=0.02,  # with random norm weights (below): lively greedy output
        ),
        {},
    ),
    # Bamba: Mamba2 mixers with attention at layer 1 (partial rotary). Two B/C groups
    # and a scan chunk of 8 tokens, so prompts cross chunks and heads read their group.
    "bamba": (
        transformers.BambaConfig,
        transformers.BambaForCausalLM,
        dict(
            num_hidden_layers=4,
            attn_layer_indices=[1],
            mamba_n_heads=8,
            mamba_d_head=16,
            mamba_d_state=16,
            mamba_n_groups=2,
            mamba_d_conv=4,
            mamba_chunk_size=8,
            mamba_proj_bias=True,
        ),
        {},
    ),
}


# Three KV cache groups (one global layer first, two sliding ones): the smallest
# model on which one group's allocation could evict another group's hit.
HYBRID_ARCHS["gemma3-3groups"] = (
    HYBRID_ARCHS["gemma3"][0],
    HYBRID_ARCHS["gemma3"][1],
    {
        **HYBRID_ARCHS["gemma3"][2],
        "num_hidden_layers": 3,
        "layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
    },
    {},
)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: a worker per core this process may use, at most 8 (each has a torch of
    its own and starts servers and engines: more would cost memory for little time)."""
    return max(1, min(len(os.sched_getaffinity(0)), 8))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The long poles first (stable: the rest keeps its order), so that under xdist each
    starts while other workers take the short tests, instead of one running alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def build_checkpoint(arch: str, path: Path) -> transformers.PreTrainedModel:
    """The model, saved at `path` unless another worker saved it there: then loaded from it."""
    config_cls, model_cls, extra, save_kwargs = {**ARCHS, **HYBRID_ARCHS, **DENSE_ARCHS}[arch]
    config = config_cls(**{**COMMON, **extra})
    return saved_once(
        path,
        lambda: build_model(arch, config, model_cls),
        lambda saved: model_cls.from_pretrained(saved, config=config).eval(),
        **save_kwargs,
    )


def build_model(arch: str, config, model_cls) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    model = model_cls(config).eval()
    liven(arch, model)
    if arch in HYBRID_ARCHS:
        # Gemma norms start at zero (scale 1 + w): random ones test the (1 + w) scaling.
        # Bamba's per-head dt_bias, A_log and D start regular: random ones test their use.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.normal_(0.0, 0.5)
                elif name.endswith(("dt_bias", "A_log", ".D")):
                    param.add_(torch.randn_like(param) * 0.5)
    return model


class Checkpoint:
    """A saved tiny model plus its transformers twin, the oracle."""

    def __init__(self, arch: str, path: str, hf_model: transformers.PreTrainedModel) -> None:
        self.arch = arch
        self.path = path
        self.hf_model = hf_model
        self._reference: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def reference(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        """`generate(do_sample=False)` of transformers, cached per prompt."""
        key = (tuple(prompt), max_new_tokens)
        if key not in self._reference:
            with torch.no_grad():
                out = self.hf_model.generate(
                    torch.tensor([prompt]),
                    do_sample=False,
                    max_new_tokens=max_new_tokens,
                    pad_token_id=0,
                )
            self._reference[key] = out[0, len(prompt) :].tolist()
        return self._reference[key]


def shared_checkpoint(tmp_path_factory: pytest.TempPathFactory, arch: str) -> Checkpoint:
    """The run's one checkpoint of `arch` (read-only: a test that changes one copies it)."""
    path = shared_dir(tmp_path_factory) / f"checkpoint-{arch}"
    return Checkpoint(arch, str(path), build_checkpoint(arch, path))


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Checkpoint]:
    return {arch: shared_checkpoint(tmp_path_factory, arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def gemma3_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return shared_checkpoint(tmp_path_factory, "gemma3")


@pytest.fixture(scope="session")
def gemma3_3groups_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return shared_checkpoint(tmp_path_factory, "gemma3-3groups")


@pytest.fixture(scope="session")
def bamba_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    # Older transformers (5.17 among them) normalize the gated RMSNorm over all B/C groups;
    # Mamba2's kernels and kvserve normalize each group (this checkpoint has two): no oracle.
    norm = transformers.models.bamba.modeling_bamba.BambaRMSNormGated
    if "group_size" not in inspect.signature(norm.__init__).parameters:
        pytest.skip(f"transformers {transformers.__version__}'s Bamba norm ignores its groups")
    return shared_checkpoint(tmp_path_factory, "bamba")


@pytest.fixture(scope="session")
def dense_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Checkpoint]:
    """Mistral, Phi-3 and Gemma 2 (tests/model/dense_archs.py), built on first use."""
    return {arch: shared_checkpoint(tmp_path_factory, arch) for arch in DENSE_ARCHS}


@pytest.fixture(params=sorted(ARCHS))
def checkpoint(request: pytest.FixtureRequest, checkpoints: dict[str, Checkpoint]) -> Checkpoint:
    return checkpoints[request.param]


@pytest.fixture(scope="session")
def runners(checkpoints: dict[str, Checkpoint]):
    """One float32 CPU runner per architecture, shared (tests free what they allocate)."""
    from kvserve.model import ModelRunner

    return {
        arch: ModelRunner(
            ck.path, block_size=4, num_blocks=96, device="cpu", dtype="float32", num_threads=1
        )
        for arch, ck in checkpoints.items()
    }
