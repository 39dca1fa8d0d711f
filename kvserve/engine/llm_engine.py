"""The engine loop: add_request / step / abort_request over scheduler and runner.

Data flows one way: the scheduler asks the KV manager what is cached and
allocates slots; the runner fills K/V and samples; the scheduler's update
marks blocks computed, appends tokens and finishes requests.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvserve.batch import Runner
from kvserve.engine.content_tracker import tracker_for
from kvserve.engine.drafter import Drafter, draft_model_for, draft_model_path
from kvserve.engine.engine_args import EngineArgs
from kvserve.engine.engine_stats import EngineStats, engine_counters
from kvserve.engine.grammar import EngineGrammars
from kvserve.engine.logprobs import LogprobsRecorder
from kvserve.engine.prompt_input import prompt_token_ids
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, sampled_tokens
from kvserve.engine.scheduler_output import accepted_drafts
from kvserve.engine.stop import StopChecker
from kvserve.engine.tiers import EngineTiers
from kvserve.engine.user_request import UserRequest
from kvserve.kvcache.config import KVCacheConfig
from kvserve.kvcache.manager import KVCacheManager
from kvserve.lora.registry import AdapterRegistry
from kvserve.lora.request import LoRARequest
from kvserve.outputs import RequestOutput
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import RequestOutputKind, SamplingParams

FINAL_ONLY = RequestOutputKind.FINAL_ONLY
log = logging.getLogger("kvserve.engine")


class LLMEngine:
    """Step-level API (the server drives this; LLM.generate and `simulate` loop over it)."""

    def __init__(self, model: str, args: EngineArgs | None = None) -> None:
        args = args or EngineArgs()
        from kvserve.model.runner import ModelRunner  # torch stays out of kvcache imports

        assert not isinstance(args.kv_cache_memory, str)  # EngineArgs made it bytes
        runner = ModelRunner(
            model,
            block_size=args.block_size,
            num_blocks=args.num_kv_blocks,
            kv_cache_memory=args.kv_cache_memory,
            dtype=args.dtype,
            device=args.device,
            seed=args.seed,
            num_threads=args.num_threads,
            quantization=args.quantization,
            attention_backend=args.attention_backend,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            warmup=args.warmup,
            enforce_eager=args.enforce_eager,
            draft_model=draft_model_path(args.speculative_config),
            max_loras=args.max_loras if args.enable_lora else 0,
            max_cpu_loras=args.max_cpu_loras or args.max_loras,
            exact=args.exact,
        )
        self._setup(runner, args)

    @classmethod
    def from_runner(
        cls, runner: Runner, args: EngineArgs | None = None, *, verify_hits: bool = True
    ) -> LLMEngine:
        """An engine over a runner built elsewhere (`simulate`'s model-free runner)."""
        engine = cls.__new__(cls)
        engine._setup(runner, args or EngineArgs(), verify_hits=verify_hits)
        return engine

    def _setup(self, runner: Runner, args: EngineArgs, verify_hits: bool = True) -> None:
        self.runner = runner
        self.tokenizer = runner.tokenizer
        limit = runner.max_model_len
        max_model_len = args.max_model_len
        if max_model_len is None:
            max_model_len = limit
        elif limit is not None and max_model_len > limit:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's {limit}")
        self.manager = KVCacheManager(
            KVCacheConfig(
                num_blocks=runner.num_blocks,
                block_size=args.block_size,
                enable_prefix_caching=args.enable_prefix_caching,
                hash_fn=args.hash_fn,
                hash_seed=args.hash_seed,
                verify_hits=verify_hits,
                specs=runner.kv_cache_specs,
            )
        )
        self.tiers = EngineTiers(runner, args) if args.offload or args.kv_transfer_config else None
        """The external KV tiers (kvserve.offload); None when `offload` is not set."""
        self.connector = self.tiers.connector if self.tiers is not None else None
        self.stop_checker = StopChecker(self.tokenizer, runner.eos_token_ids)
        self.logprobs = LogprobsRecorder(self.tokenizer)
        self.drafter = Drafter.build(args.speculative_config, runner.kv_cache_specs)
        """Speculative decoding (kvserve.engine.drafter); None when it is off."""
        self.draft_model = draft_model_for(self.drafter, runner, max_model_len)
        """method "draft_model": the draft (kvserve.model.draft_model); None otherwise."""
        self.scheduler = Scheduler(
            self.manager,
            SchedulerConfig(
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=max_model_len,
                scheduling_policy=args.scheduling_policy,
                max_loras=args.max_loras if args.enable_lora else None,
            ),
            stop_checker=self.stop_checker,
            connector=self.connector,
            drafter=self.drafter,
        )
        self.stats = EngineStats()
        self.loras = (
            AdapterRegistry.for_runner(runner, args.max_lora_rank) if args.enable_lora else None
        )
        """LoRA adapters by request (kvserve.lora); None without enable_lora."""
        self.tracker = tracker_for(runner.kv_cache_specs, args.block_size)
        """Independent count of the ideal prefill and of duplicate blocks held."""
        self.last_step_num_chunks = 0
        """Chunks the last step ran (0: nothing could be scheduled)."""
        self.last_step_num_tokens = 0
        """Tokens (prefill and decode) the last step computed."""
        self._requests: dict[str, UserRequest] = {}
        self._admitted: set[str] = set()
        vocab = self._vocab_size = runner.vocab_size
        self.grammars = EngineGrammars(self.tokenizer, vocab, runner.eos_token_ids, args)
        self.closed = False
        """True after `shutdown()`."""
        self.kv_events = None
        """KV cache events (kvserve.events.EngineKVEvents); None when disabled."""
        if args.kv_events_config is not None:
            from kvserve.events.engine_events import make_engine_events

            extra = self.tiers.transfer_metadata() if self.tiers is not None else None
            self.kv_events = make_engine_events(self.manager, args.kv_events_config, extra)
            if self.kv_events is not None and self.connector is not None:
                self.kv_events.watch_tiers(self.connector.store)

    # -- requests ---------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams | None = None,
        *,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
        client_id: str | None = None,
        priority: int = 0,
    ) -> None:
        """Queue a request; a bad one raises ValueError and leaves the engine as it was.

        With PoolingParams it is a pooling request: its prompt is prefilled, nothing is
        sampled, and its output carries the embedding (kvserve.pooling_params).
        `client_id`: the client request it is part of (default: itself), the unit the
        scheduler admits round-robin; `priority`: lower is earlier (scheduling_policy
        "priority" only); `lora_request`: the adapter it runs with (enable_lora)."""
        self._check_open()
        pooling = None
        if isinstance(params, PoolingParams):
            pooling, params = params, SamplingParams(max_tokens=1, output_kind=FINAL_ONLY)
            if pooling.pooling == "mean":  # every token recomputed: no hit read, none shared
                cache_salt = f"{cache_salt or ''}\0mean pooling {request_id}"
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        max_seqs = self.scheduler.config.max_num_seqs
        if params.n > max_seqs:
            raise ValueError(f"n must be <= max_num_seqs ({max_seqs}), got {params.n}")
        prompt_text, token_ids = prompt_token_ids(self.tokenizer, prompt)
        bad = [t for t in token_ids if not (0 <= t < self._vocab_size)]
        if bad:
            raise ValueError(f"token ids {bad[:5]} outside the vocabulary [0, {self._vocab_size})")
        outside = [t for t in params.logit_bias or () if t >= self._vocab_size]
        if outside:
            raise ValueError(
                f"logit_bias token id {outside[0]} is outside the vocabulary "
                f"[0, {self._vocab_size})"
            )
        lora = None
        if lora_request is not None:
            if self.loras is None:
                raise ValueError("lora_request needs an engine with enable_lora=True")
            lora = self.loras.resolve(lora_request)
        grammar = self.grammars.states_for(params)  # a constraint it cannot read raises
        drafter = None if pooling is not None else self.drafter  # pooling never decodes
        sequences = [
            Request(
                request_id if params.n == 1 else f"{request_id}#{index}",
                list(token_ids),
                params=child,
                lora=lora,
                cache_salt=cache_salt,
                parent_id=request_id,
                index=index,
                client_id=client_id or request_id,
                priority=priority,
                grammar=None if grammar is None else grammar(),
                spec=None if drafter is None else drafter.state_for(child),
                pooling=pooling,
            )
            for index, child in enumerate(params.per_completion())
        ]
        added: list[Request] = []
        try:
            for seq in sequences:
                self.scheduler.add_request(seq)
                added.append(seq)
        except ValueError:
            for seq in added:
                self.scheduler.abort_request(seq)
            self.grammars.release(sequences)
            raise
        self._requests[request_id] = UserRequest(
            request_id, prompt_text, token_ids, sequences, params.output_kind, [0] * params.n
        )
        self.stats.prompt_tokens += len(token_ids) * params.n

    def abort_request(self, request_id: str) -> None:
        """Stop a request between steps; its blocks are freed (and stay findable)."""
        user = self._requests.pop(request_id, None)
        if user is not None:
            self._abort_sequences(user)

    def _abort_sequences(self, user: UserRequest) -> None:
        self.grammars.release(user.sequences)  # a compile nobody waits for is cancelled
        for seq in user.sequences:
            if seq.status.finished:
                continue
            self.scheduler.abort_request(seq)
            self.tracker.released(seq)
            self._admitted.discard(seq.request_id)
            self.runner.free_request(seq.request_id)

    def num_completions(self, request_id: str) -> int:
        """Unfinished completions of a request (0 once it finished or is unknown)."""
        user = self._requests.get(request_id)
        if user is None:
            return 0
        return sum(not seq.status.finished for seq in user.sequences)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- one step ---------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; outputs of every request that advanced.

        With KV events on, the step runs under the events lock and publishes
        its events (one batch) at the end.
        """
        self._check_open()
        events = self.kv_events
        if events is None:
            return self._step()
        with events.lock:
            outputs = self._step()
            events.end_step()
        return outputs

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks (refused while requests hold blocks); publishes the reset."""
        events = self.kv_events
        if events is None:
            return self.manager.reset_prefix_cache()
        with events.lock:
            done = self.manager.reset_prefix_cache()
            if done and events.tiers is not None:
                # AllBlocksCleared clears a subscriber's whole view: the tiers kept theirs.
                events.sink.events.extend(events.tiers.snapshot())
            events.end_step()
        return done

    def shutdown(self) -> None:
        """Stop the event publisher (sends what is queued first), finish tier writes, and
        give the weights and the KV pool back (`runner.release`); later work is refused."""
        if self.closed:
            return
        self.closed = True
        if self.connector is not None:
            self.connector.close()
        if self.kv_events is not None:
            with self.kv_events.lock:
                self.kv_events.end_step()  # the tiers' last writes
            self.kv_events.close()
            self.kv_events = None
        self.grammars.close()
        self.runner.release()  # its draft model's too

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("the engine was shut down: no more requests or steps")

    def _step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        if not out.chunks:  # only compiles, or blocks from a producer, left to wait for
            self.grammars.wait(self.scheduler.waiting)
            if self.connector is not None:
                self.connector.wait_fetches()
        self.last_step_num_chunks = len(out.chunks)
        self.last_step_num_tokens = sum(c.num_tokens for c in out.chunks)
        tracker = self.tracker
        for chunk in out.chunks:
            rid = chunk.request.request_id
            if rid not in self._admitted:
                self._admitted.add(rid)
                tracker.admitted(chunk.request)
        sampled, failed, accepted = self._execute(out) if out.chunks else ({}, {}, {})
        for req in out.preempted:
            tracker.released(req)
        finished = self.scheduler.update(out, sampled, failed, accepted)
        tracker.after_step(out, self._tables_of)
        for req in finished:
            tracker.released(req)
            self._admitted.discard(req.request_id)
            self.runner.free_request(req.request_id)
        failed_users = {r.parent_id for r in finished if r.status is RequestStatus.FINISHED_ERROR}
        for parent_id in failed_users:  # its other completions stop with it
            self._abort_sequences(self._requests[parent_id])
        self.stats.generated_tokens += len(sampled) + sum(accepted.values())
        elapsed = time.perf_counter() - t0
        if any(c.num_tokens > 1 or c.start < c.request.num_prompt_tokens for c in out.chunks):
            self.stats.prefill_step_seconds += elapsed
        else:
            self.stats.decode_step_seconds += elapsed
        touched = {c.request.parent_id: None for c in out.chunks}
        touched.update({req.parent_id: None for req in finished})
        outputs = []
        for parent_id in touched:
            user = self._requests.get(parent_id)
            if user is None:
                continue
            if user.kind is FINAL_ONLY and not all(seq.status.finished for seq in user.sequences):
                continue
            try:
                output = user.output(self.stop_checker)
            except Exception as exc:  # a bug in one request's output fails it alone
                log.exception("request %s: its output failed", parent_id)
                self._abort_sequences(user)
                output = user.failed_output(f"{type(exc).__name__}: {exc}"[:500])
            outputs.append(output)
            if output.finished:
                del self._requests[parent_id]
        return outputs

    def _tables_of(self, request_id: str) -> list[list[int]]:
        """Block ids a request holds after the step (none once it finished)."""
        try:
            return self.manager.block_ids(request_id)
        except KeyError:
            return []

    def _execute(
        self, out: SchedulerOutput
    ) -> tuple[dict[str, int], dict[str, str], dict[str, int]]:
        """The runner's step over the scheduler's plans, with tier loads and saves around it;
        the logprobs it reports go to their requests. Returns the sampled tokens, the
        requests whose rows failed (request id -> why) and the drafts each accepted."""
        chunks = out.seq_chunks(self.manager)
        if self.draft_model is not None:  # its tokens replace the PENDING_DRAFT slots
            for i, drafts in self.draft_model.propose(chunks).items():
                out.chunks[i].draft_token_ids = chunks[i].draft_token_ids = drafts
        tiers = self.tiers
        if tiers is not None:
            tiers.load()
        step = self.runner.execute(chunks)
        if tiers is not None:
            tiers.save(out, self.manager)
        if step.logprobs is not None:
            self.logprobs.record([c.request for c in out.chunks], step)
        for i, embedding in (step.embeddings or {}).items():
            out.chunks[i].request.embedding = embedding
        failed = {chunks[i].request_id: why for i, why in (step.errors or {}).items()}
        return sampled_tokens(chunks, step), failed, accepted_drafts(chunks, step)

    def stats_dict(self) -> dict[str, Any]:
        """The simulate counters under the same names, plus cache counters."""
        return engine_counters(self)
