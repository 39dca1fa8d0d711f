"""Random schedules through the real engine and runner; every completion equals transformers'.

A rule-based state machine plays a busy server: it admits groups of identical
requests (1 to 5 copies, some with `n` > 1, some one client request, as a
server's batch is, admitted round-robin with the others) of lengths around block multiples
(up to four blocks and one token), often of prompts seen before (cached, or
fully cached at a block multiple), steps the engine, and aborts a request now
and then. The pool is small enough to preempt. Every finished completion must
be exactly transformers' greedy tokens for its prompt; at the end the pool is
empty and no block was ever held twice.

The same machine runs again with speculative decoding (prompt lookup) on
prompts that repeat short cycles, so drafts are accepted and rejected while
requests share blocks, hit, get preempted and abort; the KV cache's
invariants are checked after every step. And once more with the model as its
own draft model: every draft must be accepted.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from kvserve import LLM, SamplingParams
from kvserve.kvcache import check_invariants

BS = 4
NEW = 3
SALTS = 3
"""Few distinct prompts of each length: repeats hit the cache."""
STEP_BUDGET = 2000
"""Steps to finish what an example left: far more than any schedule needs."""


def prompt(length: int, salt: int) -> list[int]:
    gen = torch.Generator().manual_seed(80_000 + 100 * salt + length)
    return torch.randint(3, 300, (length,), generator=gen).tolist()


def cycle_prompt(length: int, salt: int) -> list[int]:
    """A cycle of 1 to 3 random tokens repeated: the tiny models tend to go on with it."""
    gen = torch.Generator().manual_seed(81_000 + salt)
    return (torch.randint(3, 300, (1 + salt % 3,), generator=gen).tolist() * length)[:length]


def make(ck, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 16)
    return LLM(ck.path, block_size=BS, dtype="float32", device="cpu", num_threads=1,
               max_num_seqs=12, **kwargs)  # fmt: skip


def test_random_schedules_of_identical_prompts(checkpoints):
    llm = make(checkpoints["llama"])
    run_machine(checkpoints["llama"], llm, NEW, prompt, max_examples=100)


def test_random_schedules_with_speculative_decoding(checkpoints):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 12}
    llm = make(checkpoints["qwen3"], speculative_config=spec)
    run_machine(checkpoints["qwen3"], llm, 2 * NEW, cycle_prompt, max_examples=20)
    drafted = llm.engine.drafter.stats
    assert 0 < drafted.num_accepted_tokens < drafted.num_draft_tokens


def test_random_schedules_with_the_model_as_its_own_draft(checkpoints):
    """A draft model equal to the target must have every draft accepted, whatever the
    schedule: its K/V is right wherever the target's is (hits, shares, preemptions)."""
    ck = checkpoints["llama"]
    spec = {"method": "draft_model", "model": ck.path, "num_speculative_tokens": 3,
            "disable_by_batch_size": 12}  # fmt: skip
    llm = make(ck, speculative_config=spec)
    run_machine(ck, llm, 2 * NEW, cycle_prompt, max_examples=8)
    drafted = llm.engine.drafter.stats
    assert 0 < drafted.num_accepted_tokens == drafted.num_draft_tokens


@pytest.mark.slow
def test_random_schedules_on_sliding_windows_with_the_tiers(gemma3_3groups_checkpoint, tmp_path):
    """One full and two sliding-window groups, a pool that preempts, and both tiers: the
    schedules that left a request waiting for ever on an idle pool (a tier hit sized
    over the whole prefix in every window) and held window blocks twice."""
    ck = gemma3_3groups_checkpoint
    # Prompts of up to 10 blocks: a window needs 5 of them (7 keys and a chunk of 8),
    # so the pool holds what admission promises but not a block per tier token.
    llm = make(ck, num_kv_blocks=24, max_num_batched_tokens=8,
               offload=f"cpu:1MiB,disk:{tmp_path}:8MiB")  # fmt: skip
    run_machine(ck, llm, NEW, prompt, max_examples=25, blocks=10)
    assert llm.stats()["external_hit_tokens"] > 0


def test_random_schedules_of_windows_alone_with_speculation(dense_checkpoints):
    """Every layer slides (Mistral: window 5 over blocks of 4), prompt-lookup drafts."""
    ck = dense_checkpoints["mistral"]
    spec = {"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 12}
    llm = make(ck, num_kv_blocks=8, speculative_config=spec)
    run_machine(ck, llm, 2 * NEW, cycle_prompt, max_examples=15)


def test_random_schedules_on_mamba_state_with_the_disk_tier(bamba_checkpoint, tmp_path):
    """Mamba2 state groups beside attention (Bamba), the disk tier."""
    ck = bamba_checkpoint
    llm = make(ck, num_kv_blocks=12, offload=f"disk:{tmp_path}:8MiB")
    run_machine(ck, llm, NEW, prompt, max_examples=15, preempts=False)


def run_machine(
    ck, llm: LLM, new: int, prompt, max_examples: int, preempts: bool = True, blocks: int = 4
) -> None:
    """Prompts up to `blocks` blocks and a token. `preempts` False: the model's blocks
    outlast these short requests (Bamba's hold 64 tokens), so none runs out mid-decode."""
    engine = llm.engine
    ids = itertools.count()

    class EngineMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.prompts: dict[str, list[int]] = {}
            self.admitted = 0
            """Requests added: the preconditions read it, not how many are live, since when
            one finishes depends on the shared engine's cache (earlier examples' blocks hit,
            seats are taken back), and a rule enabled differently when Hypothesis replays
            the same choices trips its own consistency check."""

        @precondition(lambda self: self.admitted < 10)
        @rule(
            length=st.integers(1, blocks * BS + 1),
            salt=st.integers(0, SALTS - 1),
            copies=st.integers(1, 5),
            completions=st.sampled_from([1, 1, 2, 3]),
            batch=st.booleans(),
        )
        def admit(self, length, salt, copies, completions, batch):
            p = prompt(length, salt)
            params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, n=completions)
            client = f"batch{next(ids)}" if batch else None  # the copies: one client request
            for _ in range(copies):
                rid = f"r{next(ids)}"  # unique across examples, shrinking included
                engine.add_request(rid, p, params, client_id=client)
                self.prompts[rid] = p
            self.admitted += copies

        @precondition(lambda self: self.admitted > 0)
        @rule(steps=st.integers(1, 3))
        def step(self, steps):
            for _ in range(steps):
                self._check(engine.step())
                running = engine.scheduler.running
                computed = {r.request_id: r.num_computed_tokens for r in running}
                check_invariants(engine.manager, computed)

        @precondition(lambda self: self.admitted > 0)
        @rule(data=st.data())
        def abort(self, data):
            # An index from a fixed range, not sampled_from the live requests: how many
            # are live can differ when Hypothesis replays the same choices (the shared
            # engine's prefix cache holds earlier examples' blocks, so a prefill may take
            # fewer steps), and a choice whose range changed between replays trips
            # Hypothesis' own consistency check.
            choice = data.draw(st.integers(0, 15))  # drawn even when none is live (above)
            live = sorted(self.prompts)
            if not live:
                return
            rid = live[choice % len(live)]
            engine.abort_request(rid)
            del self.prompts[rid]

        def _check(self, outputs) -> None:
            for out in outputs:
                if out.finished:
                    p = self.prompts.pop(out.request_id)
                    expected = ck.reference(p, new)
                    assert [c.token_ids for c in out.outputs] == [expected] * len(out.outputs)

        def teardown(self) -> None:
            try:
                for _ in range(STEP_BUDGET):  # liveness: whatever fits finishes
                    if not engine.has_unfinished_requests():
                        break
                    self._check(engine.step())
                assert not self.prompts, f"unfinished after {STEP_BUDGET} steps"
                assert engine.manager.pool.num_used == 0
            finally:  # a failed example leaves nothing behind for the next one
                for rid in list(self.prompts):
                    engine.abort_request(rid)

    EngineMachine.TestCase.settings = settings(
        max_examples=max_examples,
        stateful_step_count=12,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=False,  # random search (tests/kvcache/test_stateful.py: why)
    )
    EngineMachine.TestCase().runTest()
    stats = llm.stats()
    assert stats["duplicate_blocks_peak"] == 0
    # The schedules met what they are for: hits, fully cached prompts, preemption.
    assert stats["prefix_hit_tokens"] + stats.get("external_hit_tokens", 0) > 0
    assert stats["preemptions"] > 0 or not preempts
