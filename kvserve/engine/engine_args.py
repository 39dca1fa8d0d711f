"""The engine's options, in one place: `LLM(model, **kwargs)`, `LLMEngine` and the command
line (`kvserve.cli.engine_options` derives its flags, types, defaults and help from here)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

ATTENTION_BACKENDS = ("plain", "flex", "triton")
"""kvserve.model.attention.step_metadata.METADATA_BUILDERS has one builder for each
(torch-free here)."""
SCHEDULING_POLICIES = ("fcfs", "priority")
"""vLLM's `--scheduling-policy` values (kvserve.engine.waiting_queue: what each does)."""


EXACT_ENV = "KVSERVE_EXACT"
"""Set to 1 to make every engine this process (and its children) starts exact (the test
suite does: its oracles compare bits with transformers)."""


def exact_from_env() -> bool:
    """Whether $KVSERVE_EXACT turns `exact` on (1, true, yes or on)."""
    return os.environ.get(EXACT_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _help(text: str) -> dict[str, str]:
    """A field's metadata: its command-line help (argparse formats it, so no bare %)."""
    return {"help": text}


@dataclass(slots=True, kw_only=True)
class EngineArgs:
    """Every keyword `LLM` accepts; an unknown one is a TypeError (a typo must not
    silently fall back to a default)."""

    block_size: int = field(
        default=16,
        metadata=_help("tokens per KV block (the hash block; hybrids with state groups "
                       "inflate blocks to a multiple of it)"),
    )  # fmt: skip
    num_kv_blocks: int | None = field(
        default=None,
        metadata=_help("KV blocks (default: sized from available memory, capped, and logged)"),
    )
    kv_cache_memory: int | str | None = field(
        default=None,
        metadata=_help("KV cache size instead of num_kv_blocks: bytes, or a size such as "
                       "2GiB or 512MB (the units of --offload)"),
    )  # fmt: skip
    gpu_memory_utilization: float = field(
        default=0.9,
        metadata=_help("CUDA: the share of the device's total memory kvserve may use, in (0, 1]; "
                       "the KV cache gets it less the weights, memory already in use and the "
                       "profiled activation peak (unless num_kv_blocks or kv_cache_memory is "
                       "given); ignored on the CPU, whose cache is sized from available RAM"),
    )  # fmt: skip
    max_num_seqs: int = field(default=256, metadata=_help("max running requests"))
    max_num_batched_tokens: int = field(
        default=8192, metadata=_help("token budget per step (prompts beyond it are chunked)")
    )
    scheduling_policy: str = field(
        default="fcfs",
        metadata=_help("fcfs: requests admitted in arrival order, round-robin between client "
                       "requests (a batch's inputs alternate with single requests); priority: "
                       "the lowest request `priority` first, then the same (vLLM's)"),
    )  # fmt: skip
    max_model_len: int | None = field(
        default=None,
        metadata=_help("max prompt + output tokens (default: the model's max_position_embeddings)"),
    )
    enable_prefix_caching: bool = field(
        default=True,
        metadata=_help("reuse the cached KV blocks of equal prefixes; False: compute every "
                       "prompt token"),
    )  # fmt: skip
    warmup: bool = field(
        default=True,
        metadata=_help("CUDA: run dummy prefills and decodes of bucketed sizes at start, so the "
                       "first requests do not pay for kernel selection (the log says how long "
                       "it took); ignored on the CPU, which chooses no kernels per shape"),
    )  # fmt: skip
    enforce_eager: bool = field(
        default=False,
        metadata=_help("CUDA with attention_backend triton: run decode steps eagerly instead of "
                       "replaying the CUDA graphs captured at start (one per batch-size bucket)"),
    )  # fmt: skip
    dtype: str = field(
        default="auto",
        metadata=_help(
            "auto: float32 on the CPU, bfloat16 on CUDA; bfloat16 pays on the CPU only "
            "with native bfloat16 (AVX-512 BF16 or AMX: the start-up line says; elsewhere "
            "float32 is about 2.5x faster and a warning says so); float16 on the CPU is "
            "many times slower (a warning says so): use bfloat16 or float32 there"
        ),
    )
    exact: bool = field(
        default=False,
        metadata=_help("CPU float32 and bfloat16: matmuls as transformers computes them "
                       "(F.linear, token for token its output) instead of the default's weights "
                       "packed for kvserve's kernels (faster; the last bits differ, so a near "
                       "tie can pick another token); KVSERVE_EXACT=1 turns it on too"),
    )  # fmt: skip
    quantization: str = field(
        default="none",
        metadata=_help("weights of the linear layers, CPU only: none (the dtype's), int8 (per "
                       "channel), int4 (groups of 32), gguf (a GGUF file's own 4-bit blocks as "
                       "they are, its other quantized types as int8)"),
    )  # fmt: skip
    seed: int = field(
        default=0, metadata=_help("seed of the sampler for requests without their own seed")
    )
    device: str | None = field(
        default=None, metadata=_help("cpu, cuda or cuda:N (default: cuda when available)")
    )
    hash_fn: str = field(default="sha256", metadata=_help("block hash function"))
    hash_seed: int = field(
        default=0,
        metadata=_help("root of the hash chain; equal seeds give equal hashes on every machine"),
    )
    num_threads: int | None = field(
        default=None,
        metadata=_help("CPU threads (default: $OMP_NUM_THREADS, else one per physical core)"),
    )
    attention_backend: str = field(
        default="plain",
        metadata=_help("plain: torch ops per sequence group, fastest on the CPU; flex: the "
                       "whole step in one compiled FlexAttention call per layer, for a GPU "
                       "(first steps compile, seconds per shape); triton: one Triton kernel per "
                       "layer reading the paged cache in place, for CUDA (needs triton)"),
    )  # fmt: skip
    kv_events_config: Any = field(
        default=None,
        metadata=_help("publish KV cache events: vLLM's keys as JSON (in Python also a dict "
                       "or a KVEventsConfig), e.g. '{\"enable_kv_cache_events\": true, "
                       "\"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\"}' "
                       "(watch them with `kvserve events`); default: no events"),
    )  # fmt: skip
    enable_lora: bool = field(
        default=False,
        metadata=_help("LoRA adapters (PEFT directories) per request: generate(lora_request=...) "
                       "(kvserve.lora); each adapter's KV blocks are its own, keyed by its "
                       "content"),
    )  # fmt: skip
    max_loras: int = field(
        default=1, metadata=_help("with enable_lora: distinct adapters in one step")
    )
    max_lora_rank: int = field(
        default=16, metadata=_help("with enable_lora: the largest adapter rank accepted")
    )
    max_cpu_loras: int | None = field(
        default=None,
        metadata=_help("with enable_lora: adapters kept read between uses, least recently "
                       "used out (default: max_loras)"),
    )  # fmt: skip
    speculative_config: Any = field(
        default=None,
        metadata=_help("speculative decoding: vLLM's keys as JSON (in Python also a dict), e.g. "
                       "'{\"method\": \"ngram\", \"num_speculative_tokens\": 3, "
                       "\"prompt_lookup_max\": 4}' (prompt lookup: drafts copied from the "
                       "sequence's earlier tokens) or '{\"method\": \"draft_model\", "
                       "\"model\": \"PATH\", \"num_speculative_tokens\": 3}' (a smaller "
                       "checkpoint sharing the tokenizer drafts); drafts are verified in one "
                       "step, greedy output is unchanged; default: off"),
    )  # fmt: skip
    offload: str | None = field(
        default=None,
        metadata=_help("external KV tiers below the pool, e.g. cpu:8GiB,disk:/path/to/dir:50GiB "
                       "(either alone); a disk tier persists across runs; default: off"),
    )  # fmt: skip
    kv_transfer_config: Any = field(
        default=None,
        metadata=_help("KV transfer between engines (prefill on one, decode on another), "
                       "vLLM's keys as JSON: '{\"kv_role\": \"kv_producer\", \"kv_port\": "
                       "14579}' (with offload cpu:SIZE: the blocks it keeps for consumers) or "
                       "'{\"kv_role\": \"kv_consumer\", \"kv_connector_extra_config\": "
                       "{\"peers\": [\"tcp://host:14579\"]}}' (kvserve.transfer)"),
    )  # fmt: skip
    grammar_compile_timeout: float = field(
        default=30.0,
        metadata=_help("seconds a constrained request (structured outputs, tools) waits for "
                       "its grammar's compile before it fails (a 400 naming this option); "
                       "compiles run on a pool of workers and never block other requests"),
    )  # fmt: skip
    grammar_cache_mb: int = field(
        default=256,
        metadata=_help("MiB of compiled grammars kept for reuse (least recently used dropped "
                       "first)"),
    )  # fmt: skip

    def __post_init__(self) -> None:
        """Check what can be checked before a model is loaded (a bad value is a ValueError
        naming it, on the command line as in Python); `kv_cache_memory` becomes bytes."""
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                f"got {self.attention_backend!r}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                f"got {self.scheduling_policy!r}"
            )
        utilization = self.gpu_memory_utilization
        if isinstance(utilization, bool) or not isinstance(utilization, int | float):
            raise ValueError(f"gpu_memory_utilization must be a number, got {utilization!r}")
        if not 0 < utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
        timeout = self.grammar_compile_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise ValueError(f"grammar_compile_timeout must be > 0 seconds, got {timeout!r}")
        if isinstance(self.grammar_cache_mb, bool) or not isinstance(self.grammar_cache_mb, int):
            raise ValueError(f"grammar_cache_mb must be an integer, got {self.grammar_cache_mb!r}")
        if self.grammar_cache_mb < 0:
            raise ValueError(f"grammar_cache_mb must be >= 0, got {self.grammar_cache_mb}")
        if self.kv_cache_memory is not None:
            from kvserve.offload.options import size_bytes  # the --offload sizes' parser

            self.kv_cache_memory = size_bytes(self.kv_cache_memory, "kv_cache_memory")
        if self.device is not None:
            from kvserve.model.device import resolve_device  # torch only when a device is named

            resolve_device(self.device)
        if self.kv_events_config is not None:
            from kvserve.events.config import KVEventsConfig

            KVEventsConfig.from_any(self.kv_events_config)  # the engine reads it again
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.kv_transfer_config is not None:
            from kvserve.transfer.config import KVTransferConfig

            KVTransferConfig.from_any(self.kv_transfer_config)  # the tiers read it again
        if self.speculative_config is not None:
            from kvserve.engine.speculative import SpeculativeConfig

            spec = SpeculativeConfig.from_any(self.speculative_config)  # read again later
            if spec.method == "draft_model" and self.offload is not None:
                raise ValueError(
                    "speculative_config: method 'draft_model' with offload tiers is not "
                    "supported: the draft model's K/V does not travel to the tiers (use "
                    "method 'ngram', or no offload)"
                )
