"""Random schedules against the manager; design.md's invariants after every step.

A rule-based state machine plays a scheduler: admit requests (a small alphabet
and shared prefixes, so hits and identical prompts are common, some with LoRA
or salt), run a step (some requests allocate, some in chunks; decodes append a
token derived from the sequence, so identical sequences continue identically;
some decodes carry draft tokens in lookahead slots, verified against that
token: accepted ones count as computed, rejected slots are reused),
finish, preempt (free and recompute later), reset the prefix cache. The pool
is small, so allocations fail and blocks are evicted.

`Sim` (see _kvsim.py) checks, independently of the manager: every hit block was
written for exactly the request's prefix, a hit is never smaller than what
running requests hold, slots equal the scheduled tokens, a failed allocation
changes nothing; and `check_invariants` (incl. zero duplicates) between steps.
"""

from __future__ import annotations

import hashlib

from _cache_seqs import add_seq
from _kvsim import VOCAB, Sim
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvserve.kvcache import CacheSequence, KVCacheConfig, KVCacheManager, check_invariants

PREFIXES = [[], [0, 1, 2, 0, 1, 2, 0, 1], [1, 1, 1, 1, 1, 1], [2, 0, 2, 0, 2]]
PROMPTS = [[0, 1, 2, 0], [0, 1, 2, 0, 1, 2, 0, 1], [1] * 12, [2, 0, 2, 0, 2, 1, 1]]
MAX_LEN = 24

prompts = st.one_of(
    st.sampled_from(PROMPTS),
    st.builds(
        lambda prefix, suffix: prefix + suffix,
        st.sampled_from(PREFIXES),
        st.lists(st.integers(0, 2), max_size=9),
    ),
).filter(bool)


class CacheMachine(RuleBasedStateMachine):
    HASH = "sha256"
    STRONG = True

    def __init__(self) -> None:
        super().__init__()
        self.m: KVCacheManager
        self.sim: Sim
        self.waiting: dict[str, CacheSequence] = {}
        self.n = 0
        self.steps = 0

    @initialize(
        bs=st.sampled_from([1, 2, 4]), num_blocks=st.integers(3, 20), seed=st.integers(0, 7)
    )
    def setup(self, bs, num_blocks, seed):
        config = KVCacheConfig(num_blocks, bs, hash_fn=self.HASH, hash_seed=seed)
        self.m = KVCacheManager(config)
        self.sim = Sim(self.m, strong_hash=self.STRONG)

    @precondition(lambda self: len(self.waiting) + len(self.sim.seqs) < 8)
    @rule(
        prompt=prompts,
        copies=st.integers(1, 3),
        lora=st.sampled_from([None, None, None, "ad"]),
        salt=st.sampled_from([None, None, None, "t"]),
    )
    def admit(self, prompt, copies, lora, salt):
        """Admit `copies` identical requests (n > 1 sampling, or popular prompts)."""
        for _ in range(copies):
            seq = CacheSequence(f"r{self.n}", list(prompt), lora_name=lora, cache_salt=salt)
            self.n += 1
            seq = add_seq(self.m, seq)
            self.waiting[seq.request_id] = seq

    @rule(data=st.data())
    def step(self, data):
        self._step(data)

    @rule(data=st.data())
    def step_everyone(self, data):
        """Every request, in admission order, whole (a plain continuous-batching step)."""
        for rid in sorted([*self.sim.seqs, *self.waiting], key=lambda r: int(r[1:])):
            seq = self.sim.seqs.get(rid) or self.waiting[rid]
            if self.sim.schedule(seq):
                self.waiting.pop(rid, None)
        self._end_step()

    def _step(self, data):
        candidates = sorted([*self.sim.seqs, *self.waiting])
        chosen = data.draw(st.lists(st.sampled_from(candidates), unique=True)) if candidates else []
        for rid in chosen:
            seq = self.sim.seqs.get(rid) or self.waiting[rid]
            chunk = data.draw(st.one_of(st.none(), st.integers(1, 3 * self.m.block_size)))
            drafts = data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=3))  # decodes
            if self.sim.schedule(seq, chunk, drafts):
                self.waiting.pop(rid, None)
        self._end_step()

    def _end_step(self):
        self.sim.end_step()
        self.steps += 1
        for seq in list(self.sim.seqs.values()):  # finish long requests
            if len(seq.token_ids) > MAX_LEN:
                self.sim.free(seq)

    @precondition(lambda self: self.sim.seqs)
    @rule(data=st.data(), preempt=st.booleans())
    def finish_or_preempt(self, data, preempt):
        rid = data.draw(st.sampled_from(sorted(self.sim.seqs)))
        seq = self.sim.seqs[rid]
        self.sim.free(seq)
        if preempt:  # recompute later, mostly from its own cached blocks
            self.waiting[rid] = seq

    @rule()
    def reset_prefix_cache(self):
        idle = not self.sim.seqs
        assert (self.m.pool.num_used == 0) == idle
        entries = [dict(ix) for ix in self.m.pool.index]
        assert self.m.reset_prefix_cache() is idle
        if idle:
            assert all(not ix for ix in self.m.pool.index)
            assert all(b.block_hash is None for b in self.m.pool.blocks)
        else:
            assert [dict(ix) for ix in self.m.pool.index] == entries

    @invariant()
    def invariants_between_steps(self):
        if hasattr(self, "sim"):
            self.sim.check()

    def teardown(self):
        if not hasattr(self, "sim"):
            return
        for seq in list(self.sim.seqs.values()):
            self.sim.free(seq)
        pool = self.m.pool
        assert pool.num_used == 0
        assert sorted(pool.free_block_ids()) == list(range(1, len(pool.blocks)))
        assert all(b.ref_cnt == 0 for b in pool.blocks)
        check_invariants(self.m, {})


class WeakHashMachine(CacheMachine):
    """8 possible hashes: collisions everywhere; still never a wrong hit."""

    HASH = staticmethod(lambda data: bytes([hashlib.sha256(data).digest()[0] % 8]))
    STRONG = False


SETTINGS = settings(
    max_examples=75,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    # Random search, a new seed each run: the fixed examples never found issue 33's bug
    # (identical sequences whose accepted drafts fill equal blocks held a duplicate; now
    # pinned in test_lookahead.py), other seeds did. Green on seeds 0-9 and derandomized;
    # a failure names its seed: rerun it with `pytest --hypothesis-seed=N`, fix the cause
    # and pin the case as a plain test.
    derandomize=False,
)

TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = SETTINGS
TestWeakHashMachine = WeakHashMachine.TestCase
TestWeakHashMachine.settings = SETTINGS
