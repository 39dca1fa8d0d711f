"""Random schedules through the real engine and runner; every completion equals transformers'.

A rule-based state machine plays a busy server: it admits groups of identical
requests (1 to 5 copies, some with `n` > 1) of lengths around block multiples
(up to four blocks and one token), often of prompts seen before (cached, or
fully cached at a block multiple), steps the engine, and aborts a request now
and then. The pool is small enough to preempt. Every finished completion must
be exactly transformers' greedy tokens for its prompt; at the end the pool is
empty and no block was ever held twice.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from kvserve import LLM, SamplingParams

BS = 4
NEW = 3
SALTS = 3
"""Few distinct prompts of each length: repeats hit the cache."""


def prompt(length: int, salt: int) -> list[int]:
    gen = torch.Generator().manual_seed(80_000 + 100 * salt + length)
    return torch.randint(3, 300, (length,), generator=gen).tolist()


@pytest.fixture(scope="module")
def engine_llm(checkpoints):
    ck = checkpoints["llama"]
    llm = LLM(ck.path, block_size=BS, num_kv_blocks=16, dtype="float32", device="cpu",
              num_threads=1, max_num_seqs=12)  # fmt: skip
    return ck, llm


def test_random_schedules_of_identical_prompts(engine_llm):
    ck, llm = engine_llm
    engine = llm.engine
    ids = itertools.count()

    class EngineMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.prompts: dict[str, list[int]] = {}

        @precondition(lambda self: len(self.prompts) < 10)
        @rule(
            length=st.integers(1, 4 * BS + 1),
            salt=st.integers(0, SALTS - 1),
            copies=st.integers(1, 5),
            completions=st.sampled_from([1, 1, 2, 3]),
        )
        def admit(self, length, salt, copies, completions):
            p = prompt(length, salt)
            params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, n=completions)
            for _ in range(copies):
                rid = f"r{next(ids)}"  # unique across examples, shrinking included
                engine.add_request(rid, p, params)
                self.prompts[rid] = p

        @precondition(lambda self: bool(self.prompts))
        @rule(steps=st.integers(1, 3))
        def step(self, steps):
            for _ in range(steps):
                self._check(engine.step())

        @precondition(lambda self: bool(self.prompts))
        @rule(data=st.data())
        def abort(self, data):
            rid = data.draw(st.sampled_from(sorted(self.prompts)))
            engine.abort_request(rid)
            del self.prompts[rid]

        def _check(self, outputs) -> None:
            for out in outputs:
                if out.finished:
                    p = self.prompts.pop(out.request_id)
                    expected = ck.reference(p, NEW)
                    assert [c.token_ids for c in out.outputs] == [expected] * len(out.outputs)

        def teardown(self) -> None:
            try:
                while engine.has_unfinished_requests():
                    self._check(engine.step())
                assert not self.prompts
                assert engine.manager.pool.num_used == 0
            finally:  # a failed example leaves nothing behind for the next one
                for rid in list(self.prompts):
                    engine.abort_request(rid)

    EngineMachine.TestCase.settings = settings(
        max_examples=100,
        stateful_step_count=12,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    EngineMachine.TestCase().runTest()
    stats = llm.stats()
    assert stats["duplicate_blocks_peak"] == 0
    # The schedules met what they are for: hits, fully cached prompts, preemption.
    assert stats["prefix_hit_tokens"] > 0
    assert stats["preemptions"] > 0
