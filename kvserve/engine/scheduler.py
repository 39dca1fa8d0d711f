"""Continuous batching over the KV cache manager, shared by `simulate` and the engine.

Each step: running requests first (decodes and further prefill chunks, in
admission order, except that single requests go before the sequences of a
batch: seats.serve_order), preempting from the end when blocks run out; then
waiting requests while the token budget, `max_num_seqs` and the pool allow, in
the waiting queue's order (waiting_queue.py: preempted first, then by priority,
round-robin between client requests). Before both, a client request holding no
seat that lacks a seat or blocks takes them from the biggest holder (seats.py).
A prompt longer than the remaining budget is chunked, so a step can mix prefill
chunks and decodes (as vLLM v1 does).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from kvserve.engine.drafter import Drafter
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.scheduler_config import SchedulerConfig, SchedulerStats
from kvserve.engine.scheduler_output import ScheduledChunk, SchedulerOutput, sampled_tokens
from kvserve.engine.seats import fair_share_claim, serve_order
from kvserve.engine.stop import StopChecker
from kvserve.engine.waiting_queue import WaitingQueue, adapter_fits, ready
from kvserve.kvcache.manager import KVCacheManager

log = logging.getLogger("kvserve.engine")
__all__ = ["ScheduledChunk", "Scheduler", "SchedulerConfig", "SchedulerOutput", "sampled_tokens"]


def _fail(req: Request, why: str) -> tuple[RequestStatus, None]:
    req.error = why
    return RequestStatus.FINISHED_ERROR, None


class Scheduler:
    """Continuous batching; owns request state, asks the manager for blocks."""

    def __init__(
        self,
        manager: KVCacheManager,
        config: SchedulerConfig | None = None,
        stop_checker: StopChecker | None = None,
        connector: Any = None,
        drafter: Drafter | None = None,
    ) -> None:
        """`stop_checker`: decides when a sampled token ends a request (default: only
        max_tokens); `connector`: external KV tiers (kvserve.offload) or None;
        `drafter`: draft tokens for speculative decoding (kvserve.engine.drafter) or None."""
        self.manager = manager
        self.drafter = drafter
        self.connector = connector
        self.config = config or SchedulerConfig()
        self.stop_checker = stop_checker or StopChecker(None, set())
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self._prefill_end: dict[str, int] = {}
        self._admitted = False
        """Whether the last step admitted a request (`serve_order` is due)."""

    # -- requests ---------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; raises ValueError (and keeps nothing) if it can never run.

        The message says why, not which request: the caller knows which it added,
        and names it the way its user does (LLM.generate: the prompt's index)."""
        reason = self._never_fits(request)
        if request.priority and self.config.scheduling_policy != "priority":
            reason = (
                f"priority {request.priority} needs --scheduling-policy priority "
                "(this engine schedules fcfs)"
            )
        if reason:
            raise ValueError(reason)
        self.stop_checker.prepare(request)
        t0 = time.perf_counter()
        self.manager.add_request(
            request.request_id, request.token_ids, request.lora_name, request.cache_salt
        )
        self.stats.manager_seconds += time.perf_counter() - t0
        self.stats.prompt_tokens += request.num_prompt_tokens
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def _never_fits(self, request: Request) -> str | None:
        if not request.token_ids:
            return "the prompt is empty"
        if request.max_tokens < 1:
            return f"max_tokens must be >= 1, got {request.max_tokens}"
        # The last generated token is never fed back, so it needs no slot.
        need = request.num_prompt_tokens + request.max_tokens - 1
        limit = self.config.max_model_len
        if limit is not None and need + 1 > limit:
            return (
                f"prompt ({request.num_prompt_tokens} tokens) + max_tokens "
                f"({request.max_tokens}) exceeds max_model_len ({limit})"
            )
        blocks = self.manager.blocks_for_tokens(need, self.config.max_num_batched_tokens)
        if blocks > self.manager.num_usable_blocks:
            return (
                f"prompt ({request.num_prompt_tokens} tokens) + max_tokens ({request.max_tokens}) "
                f"needs {blocks} KV blocks but the pool has only "
                f"{self.manager.num_usable_blocks}"
            )
        return None

    def max_request_tokens(self) -> int | None:
        """The most tokens (prompt + max_tokens) one request can be admitted with:
        max_model_len, or fewer when the KV pool holds fewer (None: no max_model_len)."""
        limit = self.config.max_model_len
        if limit is None:
            return None
        usable = self.manager.num_usable_blocks
        chunk = self.config.max_num_batched_tokens

        def fits(total: int) -> bool:  # the last token needs no slot (_never_fits)
            return self.manager.blocks_for_tokens(total - 1, chunk) <= usable

        lo, hi = 0, limit  # fits(lo) holds (nothing), the answer is in [lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo

    def abort_request(self, request: Request) -> None:
        """Drop a request between steps; its blocks are freed (still findable)."""
        if request.status.finished:
            return
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self.running.remove(request)
        request.status = RequestStatus.FINISHED_ABORTED
        self._free(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ---------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Choose this step's chunks; every chunk has its slots allocated."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        manager = self.manager
        clock = time.perf_counter
        t0 = clock()
        if self.waiting and len(self.running) > 1:
            self._claim_fair_share(out)  # a seatless client request may get a seat and blocks
        running = self.running
        if self._admitted:
            serve_order(running)  # single requests before a batch's sequences
            self._admitted = False
        allocate = manager.allocate_slots
        spec = self.drafter
        if spec is not None and len(running) > spec.config.max_batch_size:
            spec = None  # a batch's decode rows fill the products: drafts do not pay
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            computed = req.num_computed_tokens
            hit = None
            if computed < len(req.token_ids) - 1:
                hit = manager.get_computed_blocks(req.request_id, computed)
                if not hit.num_tokens:
                    hit = None
                else:
                    computed += hit.num_tokens
            remaining = len(req.token_ids) - computed
            num_new = remaining if remaining <= budget else self._chunk(req, computed, budget)
            drafts = spec.drafts(req, budget, self.config.max_model_len) if spec else ()
            allocated = bool(drafts) and allocate(req.request_id, 1, computed, None, len(drafts))
            if not allocated:
                drafts = ()  # no room for drafts: a plain decode (preempting, as ever)
                while not (allocated := allocate(req.request_id, num_new, computed, hit)):
                    victim = running.pop()
                    self._preempt(victim, out)
                    if victim is req:
                        break
            if allocated:
                if hit is not None:
                    self.stats.prefix_hit_tokens += hit.num_tokens
                    if not req.num_preemptions:
                        req.num_cached_tokens += hit.num_tokens
                    req.num_computed_tokens = computed
                out.chunks.append(ScheduledChunk(req, computed, num_new, drafts))
                budget -= num_new + len(drafts)
                i += 1
        waiting = self.waiting
        max_seqs = self.config.max_num_seqs
        deferred: list[Request] = []
        while waiting and budget > 0 and len(running) < max_seqs:
            req = waiting[0]
            rid = req.request_id
            if not ready(req) or not adapter_fits(req, running, self.config.max_loras):
                deferred.append(waiting.popleft())  # its grammar compiles, or its adapter
                continue  # waits for a slot: the others go on
            if req.grammar is not None and (why := req.grammar.failure) is not None:
                out.reject(waiting.popleft(), why)  # no token can come: no block, no prefill
                continue
            hit = manager.get_computed_blocks(rid, 0)
            if hit.wait:
                # It would resume from state this step writes (design.md invariant 8):
                # one step later it hits; the requests behind it go on meanwhile.
                deferred.append(waiting.popleft())
                continue
            local = hit.num_tokens
            external = 0  # tokens loaded after every group's local hit (allocate_slots)
            if self.connector is not None and not hit.skip_write_tokens:
                external = self.connector.lookup(
                    rid, len(req.token_ids), manager.block_hashes(rid), local
                )
                if external < 0:  # its blocks are on their way from a producer
                    deferred.append(waiting.popleft())
                    continue
            computed = local + external
            num_new = self._chunk(req, computed, budget)
            if not manager.allocate_slots(rid, num_new, local, hit, num_external_tokens=external):
                if running or out.chunks:
                    break  # blocks come back as running requests finish or are preempted
                self._stalled(waiting.popleft(), out)  # liveness: see _stalled
                continue
            if external:
                self.connector.on_allocated(rid, manager.step_plan(rid), local, external)
                self.stats.external_hit_tokens += external
            waiting.popleft()
            manager.record_query(len(req.token_ids))
            if self.connector is not None:
                self.stats.external_query_tokens += len(req.token_ids) - local
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = computed
            req.num_computed_tokens = computed
            req.status = RequestStatus.RUNNING
            self._prefill_end[rid] = len(req.token_ids)
            self.stats.prefix_hit_tokens += local
            running.append(req)
            self._admitted = True
            out.chunks.append(ScheduledChunk(req, computed, num_new))
            budget -= num_new
        waiting.extendleft(reversed(deferred))
        if self.config.max_loras:  # each adapter's rows side by side (kvserve.lora.slots)
            out.chunks.sort(key=lambda c: c.request.lora_name or "")
        self.stats.manager_seconds += clock() - t0
        return out

    def _claim_fair_share(self, out: SchedulerOutput) -> None:
        """Fair shares (seats.py): a waiting request of a client request that holds no seat,
        short of a seat or of blocks, gets them from the client requests holding the most."""
        config = self.config
        claim = fair_share_claim(
            self.running,
            self.waiting,
            config.max_num_seqs,
            self.manager,
            config.max_num_batched_tokens,
        )
        if claim is None:
            return
        for victim in claim.victims:
            self.running.remove(victim)
            self._preempt(victim, out, requeue=True)
        self.waiting.promote(claim.seatless)

    def _stalled(self, req: Request, out: SchedulerOutput) -> None:
        """Liveness: `req` passed admission (it fits the pool) yet cannot be placed while
        nothing runs, so no block will ever come back for it. Waiting would spin for ever
        on an idle engine: it fails alone, with the reason, and the engine goes on."""
        free, usable = self.manager.num_free_blocks, self.manager.num_usable_blocks
        why = (
            f"the KV cache could not place this request on an idle pool ({free} of "
            f"{usable} blocks free): an engine fault, reported instead of waiting for ever"
        )
        log.error("request %s: %s", req.request_id, why)
        out.reject(req, why)

    def _chunk(self, req: Request, computed: int, budget: int) -> int:
        """Tokens to schedule: all that remain, or a budget-sized chunk.

        A partial chunk ends on a block boundary when it can, so the next
        chunk may start with blocks another request cached meanwhile.
        """
        remaining = len(req.token_ids) - computed
        if remaining <= budget:
            return remaining
        end = computed + budget
        aligned = end - end % self.manager.block_size
        return aligned - computed if aligned > computed else budget

    def _preempt(self, req: Request, out: SchedulerOutput, requeue: bool = False) -> None:
        """Free all blocks of `req` and queue it first (`requeue`: first in its own client
        request's turn); it recomputes (mostly hits) later."""
        self._free(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.stats.preemptions += 1
        (self.waiting.requeue if requeue else self.waiting.appendleft)(req)
        out.preempted.append(req)

    def _free(self, req: Request) -> None:
        """Give back its blocks; a finished request is forgotten by the cache too."""
        rid = req.request_id
        self._prefill_end.pop(rid, None)
        if not req.status.finished:
            self.manager.free(rid)  # preempted: its hashes serve the re-admission
            return
        self.manager.remove_request(rid)
        if self.connector is not None:
            self.connector.request_finished(rid)

    def update(
        self,
        out: SchedulerOutput,
        sampled: dict[str, int],
        failed: dict[str, str] | None = None,
        accepted: dict[str, int] | None = None,
    ) -> list[Request]:
        """Apply a finished step: advance computed tokens, append samples, finish.

        `sampled` maps request id -> new token for every chunk that samples,
        except those in `failed` (request id -> why its row failed), which
        finish with FINISHED_ERROR, as does a request whose stop check raises:
        one request's fault is never another's. `accepted`: request id -> how
        many of its drafts the runner accepted, appended before its token.
        Stop checks happen here and only here (with the new token's text,
        which stop strings are matched on). Returns the requests that finished.
        """
        clock = time.perf_counter
        self.stats.steps += 1
        finished: list[Request] = list(out.rejected)  # failed before admission
        stats = self.stats
        stats.rejected += len(out.rejected)
        status: RequestStatus | None
        for chunk in out.chunks:
            req = chunk.request
            prefill_end = self._prefill_end[req.request_id]
            prefill = min(chunk.num_tokens, max(0, prefill_end - chunk.start))
            stats.prefill_tokens_computed += prefill
            stats.decode_tokens_computed += chunk.num_tokens - prefill
            req.num_computed_tokens = chunk.start + chunk.num_tokens
            if not chunk.samples:
                continue
            token = sampled.get(req.request_id)
            if req.pooling is not None:  # prefill only: its embedding is its output
                why = (failed or {}).get(req.request_id, "the runner pooled no embedding")
                status, reason = (
                    (RequestStatus.FINISHED_STOPPED, None)
                    if req.embedding is not None
                    else _fail(req, why)
                )
            elif token is None:
                why = (failed or {}).get(req.request_id, "the runner sampled no token")
                status, reason = _fail(req, why)
            else:
                num_accepted = (accepted or {}).get(req.request_id, 0)
                status, reason = self._append(req, chunk.draft_token_ids, num_accepted, token)
            if status is not None:
                req.status = status
                req.stop_reason = reason
                finished.append(req)
        t0 = clock()
        self.manager.end_step()  # after accept_tokens: the blocks it registered are computed
        for req in finished:
            self._free(req)
        stats.manager_seconds += clock() - t0
        if finished:
            done = set(map(id, finished))
            self.running = [r for r in self.running if id(r) not in done]
        return finished

    def _append(
        self, req: Request, drafts: Sequence[int], num_accepted: int, token: int
    ) -> tuple[RequestStatus | None, int | str | None]:
        """Append the accepted drafts, then `token`, each stop-checked (the first that
        stops is the last); the drafts appended count as computed (the step wrote their
        K/V), and the blocks they fill are registered (`accept_tokens`, before end_step)."""
        status: RequestStatus | None = None
        reason: int | str | None = None
        for n, new in enumerate((*drafts[:num_accepted], token)):
            req.token_ids.append(new)
            try:
                status, reason = self.stop_checker.check(req, new)
            except Exception as exc:  # a bug in its stop check or text: it alone fails
                log.exception("request %s: its stop check failed", req.request_id)
                status, reason = _fail(req, f"{type(exc).__name__}: {exc}"[:500])
            if status is not None or n == num_accepted:
                kept = min(n + 1, num_accepted)
                break
        if drafts and self.drafter is not None:
            if kept:
                req.num_computed_tokens += kept
                self.stats.decode_tokens_computed += kept
                self.manager.accept_tokens(req.request_id, req.num_computed_tokens)
            self.drafter.verified(req, len(drafts), num_accepted)
        return status, reason
