"""Random schedules against a state model: one full-attention and two Mamba state groups.

A rule-based state machine plays a scheduler over a small pool (so allocations
fail, cached blocks and snapshots are evicted, requests are preempted): add
requests (prompts from a few shared prefixes, around one physical block long,
often shorter, some identical), run steps for a random subset (lookup at
admission: a request told to `wait` is skipped; chunked prefill; sometimes
tokens from an external tier; decodes append a token derived from the
sequence, so identical sequences continue identically), preempt (free, later
re-admitted through a full lookup), finish, abort waiting requests.

Checked independently of the manager, by recording what every attention slot
and every state page holds (the prefix it was computed for):

- a lookup changes nothing; a hit ends on a hash-block boundary before the
  last token; every state group's hit resumes from a computed snapshot page
  registered under the hit's last hash block that holds exactly the state of
  the hit's prefix; shared blocks hold the prefix; copies read only slots
  written before this step, holding the prefix;
- every chunk's state plan reads a page holding the state at the chunk start
  (zeros for a first chunk; the running page after external tokens, which
  the tier loads); snapshots sit on hash-block boundaries and are registered;
- a failed allocation changes nothing;
- no block id is used by two groups (tables, hit sources, plan pages);
- after every step `check_invariants` (ref counts, free queue, index, slots,
  zero duplicate full blocks) and every computed slot holds its prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

from _cache_seqs import add_seq
from _kvsim import assert_drained
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvserve.kvcache import (
    CacheSequence,
    KVBlock,
    KVCacheConfig,
    KVCacheManager,
    PrefixHit,
    check_invariants,
)
from kvserve.kvcache.specs import inflate_for_state, spec_from_name

VOCAB = 3
MAX_LEN = 40
CHUNKS = st.sampled_from(
    [
        (ext, chunk)
        for ext in (None, None, None, "1", "hb", "bs")
        for chunk in (None, None, "hb", "bs", "1", "bs+1")
    ]
)


def next_token(tokens: list[int]) -> int:
    """A greedy-like continuation: identical sequences continue identically."""
    return (sum(tokens[-3:]) + len(tokens)) % VOCAB


def pool_state(m: KVCacheManager, seqs: list[CacheSequence]) -> tuple:
    """Everything lookup or a failed allocation must leave alone."""
    pool = m.pool
    return (
        [m.block_ids(s.request_id) for s in seqs],
        [(s.num_cached_blocks, len(s.merges), [b.block_id for b in s.transient]) for s in seqs],
        pool.free_block_ids(),
        [(b.ref_cnt, b.block_hash, b.computed, len(b.entries or ())) for b in pool.blocks],
        [
            [(h, getattr(e, "block", e).block_id, e.computed, e.cache_id) for h, e in ix.items()]
            for ix in pool.index
        ],
        pool.num_evictions,
        len(pool.pending),
        sum(len(s.copies) for s in seqs),
    )


@dataclass
class Chunk:
    start: int
    """Computed tokens including the hit; external tokens follow."""
    first: int
    """First token the runner computes."""
    end: int
    hit: PrefixHit | None


class StateMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m: KVCacheManager
        self.waiting: dict[str, CacheSequence] = {}
        self.seqs: dict[str, CacheSequence] = {}
        """Sequences that hold blocks."""
        self.computed: dict[str, int] = {}
        self.scheduled: dict[str, Chunk] = {}
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}
        """(block id, slot) -> the prefix whose last token's K/V it holds."""
        self.state: dict[int, tuple[int, ...]] = {}
        """Page id -> the prefix whose state it holds."""
        self.written_kv: set[tuple[int, int]] = set()
        self.written_pages: set[int] = set()
        self.n = 0

    @initialize(
        hb=st.sampled_from([2, 4]),
        ks=st.tuples(st.sampled_from([2, 3]), st.sampled_from([1, 2, 3])),
        num_blocks=st.integers(8, 28),
        share=st.sampled_from([0.25, 0.5, 1.0]),
        seed=st.integers(0, 2),
        data=st.data(),
        first=st.lists(
            st.tuples(st.integers(0, 3), st.lists(st.integers(0, VOCAB - 1), max_size=8)),
            min_size=1,
            max_size=4,
        ),
    )
    def setup(self, hb, ks, num_blocks, share, seed, data, first):
        specs = inflate_for_state(
            [spec_from_name(g, hb) for g in ("full", f"mamba:{ks[0]}", f"mamba:{ks[1]}")]
        )
        self.hb = hb
        self.bs = specs[0].block_size
        self.states = [1, 2]
        self.m = KVCacheManager(
            KVCacheConfig(
                num_blocks,
                hb,
                hash_seed=seed,
                specs=specs,
                state_snapshot_share=share,
            )
        )
        p = self.bs
        base = [
            data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n)) for n in (p,)
        ]
        self.prefixes = [[], base[0][: p // 2], base[0], base[0] + base[0][: p // 2]]
        for prefix, suffix in first:
            self.add_request(prefix, suffix, 1)

    # -- the independent record ---------------------------------------------------

    def slot(self, seq: CacheSequence, pos: int) -> tuple[int, int]:
        return seq.kv_blocks[0][pos // self.bs].block_id, pos % self.bs

    def check_hit(self, seq: CacheSequence, hit: PrefixHit) -> None:
        n, hb, bs = len(seq.token_ids), self.hb, self.bs
        c = hit.num_tokens
        assert c % hb == 0 and 0 <= c < n, (c, n)
        if hit.wait:
            event("lookup: wait")
        if not c:
            return
        tokens = tuple(seq.token_ids)
        for g in self.states:
            page = hit.sources[g][0]  # type: ignore[index]
            assert isinstance(page, KVBlock)
            assert page.computed, "resumes from a pending snapshot"
            assert page.group == g and page.block_hash == seq.block_hashes[c // hb - 1]
            assert self.m.pool.index[g].get(page.block_hash) is page, "snapshot not registered"
            assert self.state.get(page.block_id) == tokens[:c], "snapshot of another prefix"
        entries = hit.sources[0]  # type: ignore[index]
        assert len(entries) == c // hb
        assert len(hit.blocks[0]) == -(-c // bs)
        for m_, block in enumerate(hit.blocks[0]):
            lo, hi = m_ * bs, min(c, (m_ + 1) * bs)
            if block is not None:
                assert hi - lo == bs, "a partial block shared"
                for pos in range(lo, hi):
                    assert self.kv.get((block.block_id, pos % bs)) == tokens[: pos + 1]
            else:
                for pos in range(lo, hi):
                    entry = entries[pos // hb]
                    assert entry.computed, "copies a pending hash block"
                    src = (entry.block.block_id, entry.slot * hb + pos % hb)
                    assert src not in self.written_kv, "copies a slot written in this step"
                    assert self.kv.get(src) == tokens[: pos + 1], "copies another prefix"

    def check_groups(self) -> None:
        """No block id used by two groups: tables, this step's hits and state plans."""
        owner: dict[int, int] = {}

        def own(bid: int, g: int) -> None:
            assert owner.setdefault(bid, g) == g, f"block {bid} used by groups {owner[bid]}, {g}"

        for seq in self.seqs.values():
            for g, table in enumerate(seq.kv_blocks):
                ids = [b.block_id for b in table]
                assert len(ids) == len(set(ids)) and 0 not in ids
                for bid in ids:
                    own(bid, g)
        for rid, chunk in self.scheduled.items():
            seq = self.seqs[rid]
            if chunk.hit is not None and chunk.hit.sources:
                for g, sources in enumerate(chunk.hit.sources):
                    for src in sources:
                        own(getattr(src, "block", src).block_id, g)
            for g in self.states:
                plan = seq.state_plans[g]
                for page in (plan.state_in, plan.state_out, *(p for _, p in plan.snapshots)):
                    if page:
                        own(page, g)

    # -- one request's chunk ------------------------------------------------------

    def schedule(self, seq: CacheSequence, data) -> bool:
        m, hb, bs, rid = self.m, self.hb, self.bs, seq.request_id
        computed = self.computed.get(rid, 0)
        n = len(seq.token_ids)
        everyone = [seq, *(s for s in self.seqs.values() if s is not seq)]
        before = pool_state(m, everyone)
        hit = m.get_computed_blocks(seq.request_id, computed)
        assert pool_state(m, everyone) == before, "lookup changed state"
        if computed:
            assert not hit.num_tokens and not hit.wait
        self.check_hit(seq, hit)
        if hit.wait:
            return False
        start = computed + hit.num_tokens
        # One draw per chunk (draws are what bounds a run's length): external tokens
        # (only at admission) and a chunk size, block-aligned ones frequent.
        ext, chunk = data.draw(CHUNKS)
        external = 0
        if not computed and n - start > 1:
            external = min(n - start - 1, {"1": 1, "hb": hb, "bs": bs}.get(ext, 0))
        first = start + external
        size = {"hb": hb, "bs": bs, "bs+1": bs + 1, "1": 1}.get(chunk)
        num_new = n - first if size is None else min(size, n - first)
        end = first + num_new
        old = [list(t) for t in seq.kv_blocks]
        ok = m.allocate_slots(seq.request_id, num_new, start, hit, num_external_tokens=external)
        event(f"alloc ok={ok} hit={hit.num_tokens > 0} ext={external > 0} mid={computed > 0}")
        if not ok:
            assert pool_state(m, everyone) == before, "failed allocation changed state"
            return False
        copies = m.step_plan(seq.request_id).copies
        tokens = tuple(seq.token_ids)
        table = seq.kv_blocks[0]
        assert len(table) == -(-end // bs), "attention slots != scheduled tokens"
        assert table[: len(old[0])] == old[0]
        shared = {b.block_id for b in (hit.blocks[0] if hit.num_tokens else []) if b is not None}
        for block in table[len(old[0]) :]:
            if block.block_id not in shared:  # freshly taken: holds nothing yet
                assert block.ref_cnt == 1, "a new block is shared"
                for o in range(bs):
                    self.kv.pop((block.block_id, o), None)
        for op in copies:
            assert op.group == 0
            for t in range(op.num_tokens):
                src = (op.src_block, op.src_offset + t)
                assert src not in self.written_kv, "copy from a slot written in this step"
                self.kv[(op.dst_block, op.dst_offset + t)] = self.kv[src]
        for pos in range(start):  # the hit, shared or copied
            assert self.kv.get(self.slot(seq, pos)) == tokens[: pos + 1], f"hit slot {pos}"
        for pos in range(start, end):  # loaded from the tier, then computed
            self.kv[self.slot(seq, pos)] = tokens[: pos + 1]
            self.written_kv.add(self.slot(seq, pos))
        for g in self.states:
            plan = seq.state_plans[g]
            running = seq.kv_blocks[g][0].block_id
            assert plan.state_out == running
            if len(old[g]) == 0:
                self.state.pop(running, None)
            if external:
                assert plan.state_in == running, "external tokens: the tier loads the state"
                self.state[running] = tokens[:first]
            elif first == 0:
                assert plan.state_in == 0
            else:
                assert plan.state_in not in self.written_pages, "reads a page written this step"
                assert self.state.get(plan.state_in) == tokens[:first], "wrong state to resume"
            for off, page in plan.snapshots:
                p = first + off
                assert 0 < off <= num_new and p % hb == 0
                assert p % bs == 0 or p == (n - 1) // hb * hb, f"snapshot at {p}"
                snap = m.pool.index[g].get(seq.block_hashes[p // hb - 1])
                assert snap is not None and snap.block_id == page
                self.state[page] = tokens[:p]
                self.written_pages.add(page)
            self.state[running] = tokens[:end]
            self.written_pages.add(running)
        self.seqs[rid] = seq
        self.computed[rid] = start
        self.scheduled[rid] = Chunk(start, first, end, hit if hit.num_tokens else None)
        self.check_groups()
        return True

    # -- rules ------------------------------------------------------------------

    @rule(
        prefix=st.integers(0, 3),
        suffix=st.lists(st.integers(0, VOCAB - 1), max_size=8),
        copies=st.integers(1, 2),
    )
    def add_request(self, prefix, suffix, copies):
        prompt = self.prefixes[prefix] + suffix or [0]
        for _ in range(copies):
            if len(self.waiting) + len(self.seqs) >= 7:
                return
            seq = CacheSequence(f"r{self.n}", list(prompt))
            self.n += 1
            seq = add_seq(self.m, seq)
            self.waiting[seq.request_id] = seq

    @rule(data=st.data(), masks=st.tuples(st.integers(0, 127), st.integers(0, 127)))
    def step(self, data, masks):
        """Schedule about 3 in 4 requests (running ones first, like the scheduler), run."""
        chosen = masks[0] | masks[1]
        for i, rid in enumerate([*sorted(self.seqs), *sorted(self.waiting)]):
            if chosen >> i & 1:
                seq = self.seqs.get(rid) or self.waiting[rid]
                if self.schedule(seq, data):
                    self.waiting.pop(rid, None)
        check_invariants(self.m, between_steps=False)
        self.m.end_step()
        for rid, chunk in self.scheduled.items():
            seq = self.seqs[rid]
            self.computed[rid] = chunk.end
            if chunk.end == len(seq.token_ids):
                seq.token_ids.append(next_token(seq.token_ids))
        self.scheduled.clear()
        self.written_kv.clear()
        self.written_pages.clear()
        self.check()
        for seq in list(self.seqs.values()):  # finish long requests
            if len(seq.token_ids) > MAX_LEN:
                self.free(seq)

    def free(self, seq: CacheSequence) -> None:
        assert not self.scheduled
        self.m.free(seq.request_id)
        del self.seqs[seq.request_id]
        del self.computed[seq.request_id]
        assert seq.kv_blocks == [[], [], []] and not seq.transient

    @rule(data=st.data(), preempt=st.booleans())
    def finish_or_preempt(self, data, preempt):
        if not self.seqs:
            return
        rid = data.draw(st.sampled_from(sorted(self.seqs)))
        seq = self.seqs[rid]
        self.free(seq)
        if preempt:  # re-admitted later through a full lookup
            self.waiting[rid] = seq

    @rule(data=st.data())
    def abort_waiting(self, data):
        if not self.waiting:
            return
        rid = data.draw(st.sampled_from(sorted(self.waiting)))
        seq = self.waiting.pop(rid)
        before = pool_state(self.m, list(self.seqs.values()))
        self.m.free(seq.request_id)  # holds nothing: a no-op
        assert pool_state(self.m, list(self.seqs.values())) == before

    @invariant()
    def between_steps(self):
        if hasattr(self, "m"):
            self.check()

    def check(self) -> None:
        m = self.m
        check_invariants(m, self.computed)
        self.check_groups()
        for rid, seq in self.seqs.items():
            tokens = tuple(seq.token_ids)
            done = self.computed[rid]
            for pos in range(done):
                assert self.kv.get(self.slot(seq, pos)) == tokens[: pos + 1], (
                    f"{rid}: slot of token {pos} holds another prefix"
                )
            for g in self.states:
                running = seq.kv_blocks[g][0].block_id
                assert self.state.get(running) == tokens[:done], f"{rid}: running state"
        held = {b.block_id for s in self.seqs.values() for t in s.kv_blocks for b in t}
        assert m.pool.num_used == len(held)

    def teardown(self):
        if not hasattr(self, "m") or self.scheduled:
            return
        for seq in list(self.seqs.values()):
            self.free(seq)
        assert_drained(self.m)


TestStateMachine = StateMachine.TestCase
TestStateMachine.settings = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
