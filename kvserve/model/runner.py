"""The model runner: one forward step over a batch of scheduled chunks.

The engine hands over, per request, a `SeqChunk`: its tokens and the KV
cache's `StepPlan` (positions to compute, block tables per group, copies,
state plans). The runner turns that into slot mappings and attention
metadata (one per group), runs the model once over the whole flattened
batch, and samples the last position of each chunk that asks for it
(penalties and logit bias first, logprobs for the requests that want them). It
reads only plans and specs: nothing about hashing, eviction or how groups
are managed (docs/design.md: data flows one way).
"""

from __future__ import annotations

import logging
import math
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from kvserve.batch import SeqChunk, StepOutput, TokenLogprobs
from kvserve.kvcache.plan import CopyOp
from kvserve.kvcache.specs import (
    FullAttentionSpec,
    KVCacheSpec,
    MambaStateSpec,
    SlidingWindowSpec,
)
from kvserve.model.config import ModelConfig
from kvserve.model.device import resolve_device
from kvserve.model.kv_memory import (
    allocate_kv_caches,
    default_kv_cache_memory,
    num_blocks_for,
)
from kvserve.model.layer_groups import GroupLayout, group_layers
from kvserve.model.loader import load_model
from kvserve.model.logprobs import token_logprobs
from kvserve.model.penalties import apply_penalties
from kvserve.model.sampler import sample
from kvserve.model.step_metadata import check_backend, step_metadata
from kvserve.model.threads import default_num_threads
from kvserve.model.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_FLOAT16_WARNING = (
    "dtype float16 on the CPU decodes far slower than float32 or bfloat16 (the CPU has "
    "few float16 kernels): use bfloat16 for half the memory of float32"
)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """ "auto" is float32 on CPU (exact, and fast enough there) and bfloat16 on CUDA."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {name!r}") from None


def layer_kv_specs(config: ModelConfig, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec]:
    """One spec per layer: full attention, a sliding window where the config has one,
    or a Mamba state.

    A state page lives in a K/V page pair: conv state in the K half, SSM state
    in the V half, so it needs twice the larger of the two.
    """
    element = torch.empty((), dtype=dtype).element_size()
    shape = dict(
        block_size=block_size,
        num_kv_heads=config.num_kv_heads,
        head_size=config.head_dim,
        dtype_bytes=element,
    )
    windows = config.layer_windows or [None] * config.num_layers
    kinds = config.layer_kinds or ["attention"] * config.num_layers
    state_bytes = 0
    if "mamba" in kinds:
        from kvserve.model.mamba2 import state_shapes

        conv, ssm = state_shapes(config)
        state_bytes = 2 * max(math.prod(conv), math.prod(ssm)) * element
    return [
        MambaStateSpec(block_size=block_size, state_bytes=state_bytes)
        if kind == "mamba"
        else FullAttentionSpec(**shape)
        if w is None
        else SlidingWindowSpec(sliding_window=w, **shape)
        for kind, w in zip(kinds, windows, strict=True)
    ]


def state_views(
    k: torch.Tensor, v: torch.Tensor, config: ModelConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """A Mamba layer's (conv, ssm) state pages inside a K/V pair: one page per block id."""
    from kvserve.model.mamba2 import state_shapes

    conv, ssm = state_shapes(config)
    blocks = k.shape[0]
    conv_view = k.view(blocks, -1)[:, : math.prod(conv)].view(blocks, *conv)
    ssm_view = v.view(blocks, -1)[:, : math.prod(ssm)].view(blocks, *ssm)
    return conv_view, ssm_view


class ModelRunner:
    """Owns the model, its paged K/V tensors and the per-request random generators."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        block_size: int,
        num_blocks: int | None = None,
        kv_cache_memory: int | None = None,
        dtype: str = "auto",
        device: str | None = None,
        seed: int = 0,
        num_threads: int | None = None,
        quantization: str = "none",
        attention_backend: str = "plain",
    ) -> None:
        """`num_threads` (CPU only, process-wide): default $OMP_NUM_THREADS, else one per
        physical core this process may use (kvserve.model.threads says why).
        `attention_backend`: "plain" torch, or "flex" (one compiled FlexAttention call per
        layer and step, for a GPU: kvserve.model.flex_attention)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.attention_backend = check_backend(attention_backend)
        self.model_dir = Path(model_dir)
        """The checkpoint as given: a Hugging Face directory, a .gguf file, or a directory
        holding one (kvserve.model.checkpoint resolves it wherever it is read)."""
        self.device = default_device() if device is None else resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        if self.dtype == torch.float16 and self.device.type == "cpu":
            logger.warning(CPU_FLOAT16_WARNING)
        if self.device.type == "cpu":
            torch.set_num_threads(num_threads or default_num_threads())
        self.quantization = quantization
        """How the weights are stored (kvserve.model.quantize); part of the tiers' fingerprint."""
        self.model, self.config = load_model(self.model_dir, self.dtype, self.device, quantization)
        self.hash_block_size = block_size
        self.layer_groups: GroupLayout = group_layers(
            layer_kv_specs(self.config, block_size, self.dtype)
        )
        self.kv_cache_specs: list[KVCacheSpec] = self.layer_groups.specs
        """One spec per KV cache group, in the order of the block tables."""
        self.block_size = self.kv_cache_specs[0].block_size
        """Tokens per physical block: the hash block size, inflated in Mamba hybrids
        (kvcache.specs.inflate_for_state) so a block also holds a state page."""
        self.state_groups = [
            g for g, spec in enumerate(self.kv_cache_specs) if isinstance(spec, MambaStateSpec)
        ]
        self.bytes_per_block = self.layer_groups.page_bytes
        if num_blocks is None:
            memory = kv_cache_memory
            if memory is None:
                memory = default_kv_cache_memory(self.device)
            num_blocks = num_blocks_for(memory, self.bytes_per_block)
        elif num_blocks < 2:
            raise ValueError(
                f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        logger.info(
            "KV cache: %d blocks of %d tokens, hash block %d tokens (%.1f MiB) on %s, %s, "
            "%d group(s)",
            num_blocks,
            self.block_size,
            block_size,
            num_blocks * self.bytes_per_block / 2**20,
            self.device,
            str(self.dtype).removeprefix("torch."),
            len(self.kv_cache_specs),
        )
        if self.device.type == "cpu":  # said once the model loaded: a load error stays one line
            logger.info("CPU: %d thread(s)", torch.get_num_threads())
        # Every group's block ids index the same tensors: one (K, V) pair per
        # position inside a group; layer l uses the pair at its slot.
        self.kv_tensors = allocate_kv_caches(
            self.config,
            num_blocks,
            self.block_size,
            self.dtype,
            self.device,
            num_tensors=self.layer_groups.group_size,
        )
        kinds = self.config.layer_kinds or ["attention"] * self.config.num_layers
        self.kv_caches = [
            state_views(*self.kv_tensors[slot], self.config)
            if kind == "mamba"
            else self.kv_tensors[slot]
            for slot, kind in zip(self.layer_groups.layer_slot, kinds, strict=True)
        ]
        """Per layer (K, V), or (conv, ssm) state pages of a Mamba layer; layers in the
        same slot of different groups share tensors."""
        self.eos_token_ids: set[int] = set(self.config.eos_token_ids)
        self.max_model_len: int = self.config.max_position_embeddings
        self.vocab_size: int = self.config.vocab_size
        self._generators: dict[str, torch.Generator] = {}
        self._default_generator = torch.Generator(device=self.device)
        self._default_generator.manual_seed(seed)

    @cached_property
    def tokenizer(self) -> Any | None:
        """The checkpoint's tokenizer (transformers, offline), loaded on first use."""
        return load_tokenizer(self.model_dir, self.config)

    def execute(self, chunks: list[SeqChunk]) -> StepOutput:
        """Run one step: the sampled token of each chunk (None where sample=False), and
        logprobs for the sampled chunks whose params ask for them.

        The plans' copies (copy-on-write of partially hit blocks) are done first.
        """
        copies = [op for chunk in chunks for op in chunk.plan.copies]
        if copies:
            self._copy(copies)
        if not chunks:
            return StepOutput([])
        input_ids: list[int] = []
        positions: list[int] = []
        for chunk in chunks:
            self._check(chunk)
            input_ids.extend(chunk.new_token_ids)
            positions.extend(range(chunk.plan.start, chunk.plan.end))
        device = self.device
        group_metas = step_metadata(
            chunks, self.kv_cache_specs, self.block_size, device, self.attention_backend
        )
        meta = [group_metas[g] for g in self.layer_groups.layer_group]
        rows, sampled = [], []
        last = -1
        for chunk in chunks:
            last += chunk.plan.num_tokens
            if chunk.sample:
                rows.append(last)
                sampled.append(chunk)
        with torch.inference_mode():
            hidden = self.model(
                torch.tensor(input_ids, dtype=torch.long, device=device),
                torch.tensor(positions, dtype=torch.long, device=device),
                self.kv_caches,
                meta,
            )
            if not rows:
                return StepOutput([None] * len(chunks))
            tokens, logprobs = self._sample(self.model.compute_logits(hidden[rows]), sampled)
        found = iter(tokens)
        step = StepOutput([next(found) if chunk.sample else None for chunk in chunks])
        if logprobs is not None:
            found_lp = iter(logprobs)
            step.logprobs = [next(found_lp) if chunk.sample else None for chunk in chunks]
        return step

    def _sample(
        self, logits: torch.Tensor, chunks: list[SeqChunk]
    ) -> tuple[list[int], list[TokenLogprobs | None] | None]:
        """One token per chunk from its float32 logits row; logprobs for the rows that ask
        (of the raw logits, taken before penalties and bias change them)."""
        params = [chunk.params for chunk in chunks]
        asked = [i for i, p in enumerate(params) if p is not None and p.logprobs is not None]
        raw = torch.log_softmax(logits[asked], dim=-1) if asked else None
        apply_penalties(logits, chunks)
        generators = [self._generator(chunk) for chunk in chunks]
        tokens = sample(logits, params, generators, [self._banned(chunk) for chunk in chunks])
        if raw is None:
            return tokens, None
        found = token_logprobs(raw, [tokens[i] for i in asked], [params[i].logprobs for i in asked])
        logprobs: list[TokenLogprobs | None] = [None] * len(chunks)
        for i, row in zip(asked, found, strict=True):
            logprobs[i] = row
        return tokens, logprobs

    def _copy(self, copies: list[CopyOp]) -> None:
        """Copy-on-write: K/V slots of a cached block into a request's own block."""
        with torch.inference_mode():
            for op in copies:
                src = slice(op.src_offset, op.src_offset + op.num_tokens)
                dst = slice(op.dst_offset, op.dst_offset + op.num_tokens)
                # A group's blocks are the same ids in every slot's tensors (its layers).
                for k, v in self.kv_tensors:
                    k[op.dst_block, dst] = k[op.src_block, src]
                    v[op.dst_block, dst] = v[op.src_block, src]

    def free_request(self, request_id: str) -> None:
        """Forget a finished or aborted request's generator."""
        self._generators.pop(request_id, None)

    def _generator(self, chunk: SeqChunk) -> torch.Generator | None:
        """The request's own generator when seeded, else the runner's shared one."""
        params = chunk.params
        if params is None or params.temperature == 0:
            return None
        if chunk.generator is not None:
            return chunk.generator
        if params.seed is None:
            return self._default_generator
        gen = self._generators.get(chunk.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed)
            self._generators[chunk.request_id] = gen
        return gen

    def _banned(self, chunk: SeqChunk) -> set[int]:
        """Stop tokens a request may not sample yet (it is below its min_tokens)."""
        params = chunk.params
        if params is None or chunk.num_generated >= params.min_tokens:
            return set()
        banned = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            banned |= self.eos_token_ids
        return {t for t in banned if t < self.vocab_size}

    def _check(self, chunk: SeqChunk) -> None:
        """Reject a malformed chunk with a message that names the request."""
        plan = chunk.plan
        rid = chunk.request_id
        if plan.start < 0:
            raise ValueError(f"request {rid}: negative start_pos {plan.start}")
        ids = chunk.new_token_ids
        if not ids or plan.num_tokens < 1:
            raise ValueError(f"request {rid}: a chunk needs at least one token")
        if len(ids) != plan.num_tokens:
            raise ValueError(f"request {rid}: the plan covers tokens the request does not have")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ValueError(f"request {rid}: token ids must be in [0, {self.vocab_size})")
        end = plan.end
        if len(plan.block_ids) != len(self.kv_cache_specs):
            raise ValueError(
                f"request {rid}: {len(plan.block_ids)} block tables for "
                f"{len(self.kv_cache_specs)} KV cache groups"
            )
        if self.state_groups:
            plans = plan.state_plans
            if plans is None or len(plans) != len(self.kv_cache_specs):
                raise ValueError(f"request {rid}: state groups need state plans")
            for g in self.state_groups:
                state = plans[g]
                if state is None or not state.state_out:
                    raise ValueError(f"request {rid}: group {g} has no state page")
                pages = [state.state_in, state.state_out, *(p for _, p in state.snapshots)]
                if any(p < 0 or p >= self.num_blocks for p in pages):
                    raise ValueError(
                        f"request {rid}: state pages must be in [0, {self.num_blocks})"
                    )
        for g, table in enumerate(plan.block_ids):
            if g in self.state_groups:
                continue
            if len(table) * self.block_size < end:
                raise ValueError(
                    f"request {rid}: block table of {len(table)} blocks "
                    f"cannot hold {end} tokens (block size {self.block_size})"
                )
            if any(b < 0 or b >= self.num_blocks for b in table):
                raise ValueError(f"request {rid}: block ids must be in [0, {self.num_blocks})")
