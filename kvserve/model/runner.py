"""The model runner: one forward step over a batch of scheduled chunks.

The engine hands over, per request, a `SeqChunk`: its tokens and the KV
cache's `StepPlan` (positions to compute, block tables per group, copies,
state plans). The runner turns that into slot mappings and attention
metadata (one per group), runs the model once over the whole flattened
batch, and samples the last position of each chunk that asks for it
(penalties and logit bias first, logprobs for the requests that want them). It
reads only plans and specs: nothing about hashing, eviction or how groups
are managed (docs/design.md: data flows one way).

What a step needs is built once per step, never per layer: the token ids and positions,
one attention metadata per KV cache group (attention/step_metadata.py; the plain
backend's `AttentionMetadata`: write slots, the padded decode groups and their masks, none
where nothing is padded, `whole_batch` when the step is one decode group in batch order,
as every step of a lone request is, which then skips the row gathers; the flex backend's
`FlexMetadata`: write slots, per query token its sequence and position, per context key
its slot, and the BlockMask, all tensors; the triton backend's `PagedMetadata`: write
slots, per sequence its query range, first position and block-table row, in one copy to
the device; a decode step that a CUDA graph takes copies the same values into the graph's
static buffers instead, attention/decode_graphs.py), and the rotary tables (cos and a
signed sin, shared by every layer and head). A layer then costs few torch calls, which is
most of a small model's decode step on the CPU: one matmul for q/k/v and one for gate/up
(the loader stacks their weights, quant/fusion.py; the packed int4 rows stack as packed
when each part fills the packing's 64-row blocks), q and k rotated in one call, the
residual stream updated in place, and no host round trip until the sampled token ids.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from kvserve.batch import SeqChunk, StepOutput, TokenLogprobs
from kvserve.engine.engine_args import exact_from_env
from kvserve.kvcache.plan import CopyOp
from kvserve.kvcache.specs import KVCacheSpec, MambaStateSpec
from kvserve.lora.slots import LoRASlots
from kvserve.model.attention.step_metadata import check_backend, step_metadata
from kvserve.model.checkpoint.tokenizer import load_tokenizer
from kvserve.model.chunk_check import check_chunk
from kvserve.model.cpu_kernels.cpu_features import detect as detect_cpu
from kvserve.model.cpu_kernels.switch import CpuKernels, enable_cpu_kernels
from kvserve.model.cpu_malloc import keep_freed_memory
from kvserve.model.device import (
    cpu_dtype_reason,
    cpu_dtype_warning,
    default_device,
    resolve_device,
    resolve_dtype,
)
from kvserve.model.draft_model import DraftModel
from kvserve.model.fused_decode import plan_fused_decode
from kvserve.model.loader import load_model
from kvserve.model.memory.kv_layout import layer_caches, layer_kv_specs
from kvserve.model.memory.kv_memory import allocate_kv_caches, cpu_kv_cache_memory, num_blocks_for
from kvserve.model.memory.layer_groups import GroupLayout, group_layers
from kvserve.model.models import DecoderForCausalLM
from kvserve.model.pooling.pooler import Pooler, attach_pooled
from kvserve.model.quant.panel_linear import PanelLinear
from kvserve.model.sampling.grammar_mask import apply_grammar
from kvserve.model.sampling.logprobs import token_logprobs
from kvserve.model.sampling.penalties import apply_penalties
from kvserve.model.sampling.rows import each_row
from kvserve.model.sampling.sampler import sample
from kvserve.model.sampling.speculative import verify_chunk
from kvserve.model.threads import default_num_threads, openmp_runtime

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model, its paged K/V tensors and the per-request random generators."""

    cpu_kernels = CpuKernels()  # which C kernels its steps run (set on the CPU with the pool)

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
        gpu_memory_utilization: float = 0.9,
        max_num_batched_tokens: int = 8192,
        max_num_seqs: int = 256,
        warmup: bool = True,
        enforce_eager: bool = False,
        draft_model: str | Path | None = None,
        max_loras: int = 0,
        max_cpu_loras: int = 0,
        exact: bool = False,
    ) -> None:
        """`num_threads` (CPU only, process-wide): default $OMP_NUM_THREADS, else one per
        physical core this process may use (kvserve.model.threads says why).
        `attention_backend`: "plain" torch, or "flex" (one compiled FlexAttention call per
        layer and step, for a GPU: kvserve.model.attention.flex_attention). On CUDA without
        `num_blocks` or `kv_cache_memory` the pool is `gpu_memory_utilization` of the
        device's memory after the weights and the activation peak of the largest step
        (kvserve.model.memory.pool_size); `warmup` runs dummy steps at start on an accelerator
        (kvserve.model.memory.warmup). On CUDA with the "triton" backend decode steps replay CUDA
        graphs captured at start unless `enforce_eager` (kvserve.model.attention.decode_graphs).
        `draft_model`: speculative decoding's draft checkpoint, loaded before the pool is
        sized, whose K/V takes its share of every block (kvserve.model.draft_model).
        `max_loras` > 0: LoRA adapters per row, that many in a step (kvserve.lora). `exact`:
        float32 matmuls give transformers' bits, unpacked (kvserve.model.quant.onednn_linear)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.model_dir = Path(model_dir)
        """The checkpoint as given: a Hugging Face directory, a .gguf file, or a directory
        holding one (kvserve.model.checkpoint.resolve resolves it wherever it is read)."""
        self.device = default_device() if device is None else resolve_device(device)
        self.attention_backend = check_backend(attention_backend, self.device)
        self.dtype = resolve_dtype(dtype, self.device)
        cpu = detect_cpu() if self.device.type == "cpu" else None  # KVSERVE_CPU_FEATURES
        if cpu is not None:
            if warning := cpu_dtype_warning(self.dtype, cpu):  # float16, bfloat16
                logger.warning(warning)
            torch.set_num_threads(num_threads or default_num_threads())
            keep_freed_memory()
        self.quantization = quantization
        """How the weights are stored (kvserve.model.quant.quantize); part of the tiers'
        fingerprint."""
        self.exact = exact or exact_from_env()
        """float32 matmuls as transformers computes them; part of the tiers' fingerprint."""
        model, self.config = load_model(model_dir, self.dtype, self.device, quantization, exact)
        self.model: DecoderForCausalLM | None = model
        """None once released."""
        self.lora = LoRASlots.for_runner(self, max_loras, max_cpu_loras)  # None without
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
        self.eos_token_ids: set[int] = set(self.config.eos_token_ids)
        self.max_model_len: int = self.config.max_position_embeddings
        self.vocab_size: int = self.config.vocab_size
        self.draft = None if draft_model is None else DraftModel(draft_model, self)
        """Speculative decoding's draft model, its K/V by this pool's block ids; None without."""
        if self.draft is not None:
            self.bytes_per_block += self.draft.page_bytes
        self._generators: dict[str, torch.Generator] = {}
        self._default_generator = torch.Generator(device=self.device)
        self._default_generator.manual_seed(seed)
        self.pooler = Pooler()  # pooling requests' embeddings (kvserve.model.pooling)
        self.decode_graphs: Any | None = None
        """kvserve.model.attention.decode_graphs.DecodeGraphs where decode steps replay CUDA graphs
        (set once the pool is there; the memory profile and the warm-up run eagerly)."""
        self.kv_tensors: list[tuple[torch.Tensor, torch.Tensor]] = []
        """One (K, V) pair per position inside a group: every group's block ids index
        the same tensors, and layer l uses the pair at its slot."""
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        """Per layer (K, V), or (conv, ssm) state pages of a Mamba layer (kv_layout)."""
        self.num_blocks = 0
        if num_blocks is None:
            memory = kv_cache_memory
            if memory is None and self.device.type == "cuda":
                from kvserve.model.memory.pool_size import cuda_kv_cache_memory

                memory = cuda_kv_cache_memory(
                    self, gpu_memory_utilization, max_num_batched_tokens, max_num_seqs
                )
            elif memory is None:
                memory = cpu_kv_cache_memory()
            num_blocks = num_blocks_for(memory, self.bytes_per_block)
        elif num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is null), got {num_blocks}")
        self.num_blocks = num_blocks
        mib, kind = num_blocks * self.bytes_per_block / 2**20, str(self.dtype)[len("torch.") :]
        logger.info(
            f"KV cache: {num_blocks} blocks of {self.block_size} tokens, hash block {block_size} "
            f"tokens ({mib:.1f} MiB) on {self.device}, {kind}, {len(self.kv_cache_specs)} group(s)"
        )
        if cpu is not None:  # said once the model loaded: a load error stays one line
            panels = any(isinstance(m, PanelLinear) for m in model.modules())
            logger.info(cpu_dtype_reason(dtype, self.dtype, cpu, quantization, self.exact, panels))
            kept = ", freed memory kept (glibc)" if keep_freed_memory() else ""
            self.cpu_kernels = enable_cpu_kernels(self.dtype, self.exact)
            fused = plan_fused_decode(model, self.dtype, self.cpu_kernels, self.lora)
            threads, runtime, kernels = torch.get_num_threads(), openmp_runtime(), self.cpu_kernels
            logger.info("CPU: %d thread(s), %s%s%s%s", threads, runtime, kept, kernels.words, fused)
        self.kv_tensors, self.kv_caches = self.allocate_pool(num_blocks)
        if self.draft is not None:
            self.draft.allocate(num_blocks)
        if warmup and self.device.type != "cpu":  # kvserve.model.memory.warmup says why
            from kvserve.model.memory.warmup import warm_up

            warm_up(self, max_num_seqs, max_num_batched_tokens)
        if (
            self.device.type == "cuda"
            and self.attention_backend == "triton"
            and not enforce_eager
            and not self.state_groups
            and self.model.CUDA_GRAPHS
            and self.lora is None
        ):
            from kvserve.model.attention.decode_graphs import DecodeGraphs

            self.decode_graphs = DecodeGraphs(self, max_num_seqs)

    def allocate_pool(
        self, num_blocks: int
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor]]]:
        """A pool of `num_blocks` blocks for this model: its (K, V) tensors and each layer's
        view of them (the runner's own, or a scratch one: kvserve.model.memory.scratch)."""
        groups = self.layer_groups.group_size
        tensors = allocate_kv_caches(
            self.config, num_blocks, self.block_size, self.dtype, self.device, num_tensors=groups
        )
        return tensors, layer_caches(self.config, self.layer_groups, tensors)

    def release(self) -> None:
        """Drop the weights and the K/V tensors (the engine's shutdown), so their memory
        returns now rather than when the last reference to the runner goes.

        The tensor lists are emptied in place: a holder of the same list (the
        tiers' block I/O) lets go of them too. Later steps are refused.
        """
        self.kv_tensors.clear()
        self.kv_caches.clear()
        self.decode_graphs = None  # its graphs hold their own memory pool
        self.model = None
        if self.draft is not None:
            self.draft.release()
        self._generators.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @cached_property
    def tokenizer(self) -> Any | None:
        """The checkpoint's tokenizer (transformers, offline), loaded on first use."""
        return load_tokenizer(self.model_dir, self.config)

    def execute(self, chunks: list[SeqChunk]) -> StepOutput:
        """Run one step: the sampled token of each chunk (None where sample=False), and
        logprobs for the sampled chunks whose params ask for them.

        The plans' copies (copy-on-write of partially hit blocks) are done first.
        """
        if self.model is None:  # release() dropped the weights and the pool
            raise RuntimeError("the model runner was released (shut down): no step runs")
        copies = [op for chunk in chunks for op in chunk.plan.copies]
        if copies:
            self._copy(copies)
        if not chunks:
            return StepOutput([])
        input_ids: list[int] = []
        positions: list[int] = []
        for chunk in chunks:
            check_chunk(self, chunk)
            input_ids.extend(chunk.new_token_ids)
            positions.extend(range(chunk.plan.start, chunk.plan.end))
        device = self.device
        rows, sampled, drafted = [], [], []
        last = -1
        for i, chunk in enumerate(chunks):
            last += chunk.plan.num_tokens
            if chunk.draft_token_ids:  # rows of its last token and of each draft
                drafted.append((i, last - len(chunk.draft_token_ids), last + 1))
            elif chunk.sample:
                rows.append(last)
                sampled.append(chunk)
        with torch.inference_mode(), self.cpu_kernels.scope():
            graphs = self.decode_graphs
            hidden = None if graphs is None else graphs.forward(chunks)
            if hidden is None:
                if self.lora is not None:
                    self.lora.prepare(chunks)
                group_metas = step_metadata(
                    chunks, self.kv_cache_specs, self.block_size, device, self.attention_backend
                )
                hidden = self.model(
                    torch.tensor(input_ids, dtype=torch.long, device=device),
                    torch.tensor(positions, dtype=torch.long, device=device),
                    self.kv_caches,
                    [group_metas[g] for g in self.layer_groups.layer_group],
                )
            pooled = self.pooler.pool(hidden, chunks)  # None unless a chunk pools
            logits_of = self.model.compute_logits
            tokens, logprobs, failed = self._sample_rows(hidden[rows], sampled, logits_of)
            verified = [
                verify_chunk(logits_of(hidden[a:b]), chunks[i], self._generator(chunks[i]))
                for i, a, b in drafted
            ]
        step = StepOutput([None] * len(chunks))
        plain = [i for i, chunk in enumerate(chunks) if chunk.sample and not chunk.draft_token_ids]
        for i, token in zip(plain, tokens, strict=True):
            step.tokens[i] = token
        errors = {plain[row]: message for row, message in failed.items()}
        if drafted:
            step.num_accepted = [0] * len(chunks)
            for (i, _, _), (accepted, token, error) in zip(drafted, verified, strict=True):
                step.num_accepted[i], step.tokens[i] = accepted, token
                if error is not None:
                    errors[i] = error
        step.errors = errors or None
        if logprobs is not None:
            found = dict(zip(plain, logprobs, strict=True))
            step.logprobs = [found.get(i) for i in range(len(chunks))]
        return attach_pooled(step, pooled)

    def _sample_rows(
        self, hidden: torch.Tensor, sampled: list[SeqChunk], logits_of: Any
    ) -> tuple[Sequence[int | None], list[TokenLogprobs | None] | None, dict[int, str]]:
        """`_sample` over the sampled rows' hidden states; if it raises, row by row (fresh
        logits each), so one row's fault fails its request alone ({row: why})."""
        if not sampled:
            return [], None, {}
        try:
            tokens, logprobs = self._sample(logits_of(hidden), sampled)
            return tokens, logprobs, {}
        except Exception:
            logger.warning("sampling a step failed; its rows are sampled one by one")
            return each_row(
                len(sampled), lambda i: self._sample(logits_of(hidden[i : i + 1]), [sampled[i]])
            )

    def _sample(
        self, logits: torch.Tensor, chunks: list[SeqChunk]
    ) -> tuple[list[int], list[TokenLogprobs | None] | None]:
        """One token per chunk from its float32 logits row; logprobs for the rows that ask
        (of the raw logits, taken before grammar masks, penalties and bias change them)."""
        params = [chunk.params for chunk in chunks]
        asked = [
            (i, n) for i, p in enumerate(params) if p is not None and (n := p.logprobs) is not None
        ]
        rows = [i for i, _ in asked]
        raw = torch.log_softmax(logits[rows], dim=-1) if rows else None
        apply_grammar(logits, chunks)  # before penalties: they see allowed tokens only
        apply_penalties(logits, chunks)
        generators = [self._generator(chunk) for chunk in chunks]
        tokens = sample(logits, params, generators, [self._banned(chunk) for chunk in chunks])
        if raw is None:
            return tokens, None
        found = token_logprobs(raw, [tokens[i] for i in rows], [n for _, n in asked])
        logprobs: list[TokenLogprobs | None] = [None] * len(chunks)
        for i, row in zip(rows, found, strict=True):
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
        """Forget a finished or aborted request's generator (and pooled rows)."""
        self._generators.pop(request_id, None)
        self.pooler.free_request(request_id)

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
