"""Random schedules against a hybrid manager: one full-attention and two sliding-window groups.

A rule-based state machine plays a scheduler over a small pool (so allocations
fail, cached blocks are evicted and requests are preempted): admit requests
(a small alphabet with shared prefixes and identical prompts, some with LoRA or
salt), run a step for a random subset (prefix lookup at admission, sometimes
with tokens from an external tier; chunked prefill with a lookup before every
chunk that starts on a block boundary; decodes append a token derived from the
sequence, so identical sequences continue identically), finish, preempt (free,
re-admit later through a full lookup), reset the prefix cache.

Checked independently of the manager, which block holds what being recorded
here (`content`: block id -> group and the prefix it was written for):

- every hit is exact: each non-null hit block holds exactly the request's
  prefix for its group and position; full-attention hits are a run from the
  left; every group's hit has the same length; a hit is never shorter than
  what running requests hold in every group;
- every token computed in a step finds its whole window in non-null blocks
  (the last prompt token of a fully cached prompt too, whose write is skipped);
- slots are exact per group; no block id is held by two groups or twice in one
  table; the null block only as a leading run of a sliding-window table;
  every held block is referenced;
- a failed allocation changes nothing except releasing sliding-window blocks
  that no token from the computed ones on reads;
- `check_invariants` (ref counts, free queue, index, slots, windows, zero
  duplicates) after every step.
"""

from __future__ import annotations

from dataclasses import dataclass

from _cache_seqs import add_seq
from _kvsim import assert_drained, ceil_div, next_token, prefix_key
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvserve.kvcache import (
    CacheSequence,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheManager,
    PrefixHit,
    check_invariants,
)
from kvserve.kvcache.hashing import unpack_tokens
from kvserve.kvcache.specs import SlidingWindowSpec

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


def first_needed(position: int, window: int, bs: int) -> int:
    """First block a token at `position` reads (keys position - window + 1 .. position)."""
    return max(0, position - window + 1) // bs


@dataclass
class Chunk:
    start: int
    """Computed tokens including the hit: external tokens follow."""
    first: int
    """First token the runner computes (start + external tokens)."""
    end: int


def table_ids(m: KVCacheManager, seqs) -> dict[str, list[list[int]]]:
    return {s.request_id: m.block_ids(s.request_id) for s in seqs}


def pool_state(m: KVCacheManager) -> tuple:
    return (
        [b.ref_cnt for b in m.pool.blocks],
        [{h: b.block_id for h, b in ix.items()} for ix in m.pool.index],
        m.pool.num_evictions,
    )


class HybridMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m: KVCacheManager
        self.waiting: dict[str, CacheSequence] = {}
        self.seqs: dict[str, CacheSequence] = {}
        """Sequences that hold blocks."""
        self.computed: dict[str, int] = {}
        self.scheduled: dict[str, Chunk] = {}
        self.content: dict[int, tuple] = {}
        self.n = 0
        self.hits = 0
        self.failures = 0

    @initialize(
        bs=st.sampled_from([2, 4]),
        windows=st.lists(st.sampled_from([1, 3, 5, 8]), min_size=2, max_size=2, unique=True),
        num_blocks=st.integers(6, 32),
        seed=st.integers(0, 3),
        anchored=st.booleans(),
    )
    def setup(self, bs, windows, num_blocks, seed, anchored):
        """`anchored` False: windows alone (Mistral's shape), no full-attention group."""
        specs = [FullAttentionSpec(block_size=bs)] if anchored else []
        specs += [SlidingWindowSpec(block_size=bs, sliding_window=w) for w in windows]
        self.bs = bs
        self.windows = [None, *windows] if anchored else list(windows)
        self.m = KVCacheManager(KVCacheConfig(num_blocks, bs, hash_seed=seed, specs=specs))

    # -- the independent record -------------------------------------------------

    def key(self, g: int, seq: CacheSequence, i: int) -> tuple:
        return (g, prefix_key(seq, i, self.bs))

    def hittable(self) -> list[set[tuple]]:
        """Per group, prefixes of full blocks that running requests hold (incl. pending)."""
        keys: list[set[tuple]] = [set() for _ in self.windows]
        for rid, seq in self.seqs.items():
            sch = self.scheduled.get(rid)
            end = sch.end if sch else self.computed[rid]
            for g, table in enumerate(seq.kv_blocks):
                for i in range(min(end // self.bs, len(table))):
                    if table[i].block_id:
                        keys[g].add(self.key(g, seq, i))
            for g, i, _copy in seq.merges:
                keys[g].add(self.key(g, seq, i))
        return keys

    def needed(self, g: int, position: int, upto: int) -> range:
        """Blocks group `g` must hold for a token at `position` (keys < upto)."""
        w = self.windows[g]
        lo = 0 if w is None else first_needed(position, w, self.bs)
        return range(lo, ceil_div(upto, self.bs))

    def acceptable(self, seq: CacheSequence, held: int, k: int, keys) -> bool:
        n, bs = len(seq.token_ids), self.bs
        p = n - 1 if k * bs >= n else k * bs
        for g in range(len(self.windows)):
            for i in self.needed(g, p, min(k * bs, p + 1)):
                if i >= held and self.key(g, seq, i) not in keys[g]:
                    return False
        return True

    def check_hit(self, seq: CacheSequence, computed: int, hit: PrefixHit) -> None:
        bs, n = self.bs, len(seq.token_ids)
        held = len(seq.kv_blocks[0])
        if computed % bs or held * bs != computed or computed >= n - 1:
            assert hit.num_tokens == 0, (computed, n, hit.num_tokens)
            return
        if not hit.num_tokens:
            k = 0
        else:
            k = len(hit.blocks[0])
            assert [len(b) for b in hit.blocks] == [k] * len(self.windows), "ragged hit"
            for g, blocks in enumerate(hit.blocks):
                nulls = 0
                for j, block in enumerate(blocks):
                    if not block.block_id:
                        assert self.windows[g] and j == nulls, "null block inside a hit"
                        nulls += 1
                        continue
                    i = held + j
                    assert unpack_tokens(block.token_ids) == seq.token_ids[i * bs : (i + 1) * bs]
                    assert self.content.get(block.block_id) == self.key(g, seq, i), "wrong hit"
            end = (held + k) * bs
            assert k > 0 and end <= n
            if end >= n:
                assert (hit.num_tokens, hit.skip_write_tokens) == (n - 1 - computed, end)
            else:
                assert (hit.num_tokens, hit.skip_write_tokens) == (end - computed, 0)
            # Every group holds what the first computed token reads (full attention: all).
            p = computed + hit.num_tokens
            for g, blocks in enumerate(hit.blocks):
                for i in self.needed(g, p, min(end, p + 1)):
                    if i >= held:
                        assert blocks[i - held].block_id, (
                            f"group {g}: hit at {p} lacks block {i} of its window"
                        )
        keys = self.hittable()
        best = next(
            (kk for kk in range(n // bs, held, -1) if self.acceptable(seq, held, kk, keys)), held
        )
        assert held + k >= best, f"{seq.request_id}: hit {k} blocks, running requests hold more"

    def check_tables(self) -> None:
        """No id in two groups or twice in a table; nulls lead window tables; all referenced."""
        owner: dict[int, int] = {}
        for seq in self.seqs.values():
            for g, table in enumerate(seq.kv_blocks):
                nulls = 0
                for j, block in enumerate(table):
                    if not block.block_id:
                        assert self.windows[g] is not None and j == nulls, "misplaced null block"
                        nulls += 1
                        continue
                    assert block.ref_cnt > 0, f"held block {block.block_id} unreferenced"
                    assert owner.setdefault(block.block_id, g) == g, (
                        f"block {block.block_id} held by groups {owner[block.block_id]} and {g}"
                    )
            # Within one sequence: each id at most once in its table.
            for table in seq.kv_blocks:
                ids = [b.block_id for b in table if b.block_id]
                assert len(ids) == len(set(ids)), "a block twice in one table"

    # -- one request's chunk ------------------------------------------------------

    def schedule(self, seq: CacheSequence, data) -> bool:
        m, bs, rid = self.m, self.bs, seq.request_id
        assert rid not in self.scheduled
        computed = self.computed.get(rid, 0)
        n = len(seq.token_ids)
        everyone = [seq, *(s for s in self.seqs.values() if s is not seq)]
        before_lookup = (table_ids(m, everyone), pool_state(m))
        hit = m.get_computed_blocks(seq.request_id, computed)
        assert (table_ids(m, everyone), pool_state(m)) == before_lookup, "lookup changed state"
        self.check_hit(seq, computed, hit)
        start = computed + hit.num_tokens
        external = 0
        if rid not in self.seqs and n - start > 1:
            external = min(n - start - 1, data.draw(st.sampled_from([0, 0, 0, 1, bs, n])))
        first = start + external
        remaining = n - first
        assert remaining >= 1
        # Block-aligned chunks are frequent: the next chunk then starts with a lookup.
        chunk = data.draw(st.sampled_from([None, bs, bs, 2 * bs, 1, bs + 1]))
        num_new = remaining if chunk is None else min(chunk, remaining)
        end = first + num_new

        old_tables = table_ids(m, everyone)
        old_pool = pool_state(m)
        old_fields = (seq.num_cached_blocks, len(seq.merges), seq.skip_write_tokens)
        old_free = set(m.pool.free_block_ids())
        idle = m.pool.num_used == 0
        ok = m.allocate_slots(seq.request_id, num_new, start, hit, num_external_tokens=external)
        # Liveness: on an idle pool, a chunk fits whenever admission's bound says it does.
        if idle and m.blocks_for_tokens(end, num_new) <= m.num_usable_blocks:
            assert ok, f"no slots for tokens {first}..{end} on an idle pool"
        new_tables = table_ids(m, everyone)
        # Only window blocks below what the next token from `computed` (failure) or
        # `first` (success: the first one computed) reads may have been released;
        # nothing else may change.
        released: list[int] = []
        for g, (old, new) in enumerate(zip(old_tables[rid], new_tables[rid], strict=True)):
            w = self.windows[g]
            limit = 0 if w is None else first_needed(first if ok else computed, w, bs)
            prefix = new[: len(old)]
            assert len(new) >= len(old)
            for i, (a, b) in enumerate(zip(old, prefix, strict=True)):
                if a != b:
                    assert b == 0 and i < limit, (
                        f"group {g}: block {i} released (ok={ok}), token {computed} reads it"
                    )
                    released.append(a)
        for other in everyone[1:]:
            assert new_tables[other.request_id] == old_tables[other.request_id]
        event(
            f"alloc ok={ok} hit={bool(hit.num_tokens)} mid={computed > 0} "
            f"skip={bool(hit.skip_write_tokens)} ext={external > 0} released={bool(released)}"
        )
        if not ok:
            self.failures += 1
            assert len(new_tables[rid][0]) == len(old_tables[rid][0])
            assert all(
                len(a) == len(b) for a, b in zip(old_tables[rid], new_tables[rid], strict=True)
            )
            refs, index, evictions = old_pool
            for bid in released:
                refs[bid] -= 1
            assert pool_state(m) == (refs, index, evictions), "failed allocation changed state"
            assert (seq.num_cached_blocks, len(seq.merges), seq.skip_write_tokens) == old_fields
            assert set(m.pool.free_block_ids()) == old_free | {
                b for b in released if m.pool.blocks[b].ref_cnt == 0
            }
            self.check_tables()
            return False

        if hit.num_tokens:
            self.hits += 1
        held = len(old_tables[rid][0])
        for g, table in enumerate(seq.kv_blocks):
            assert len(table) == ceil_div(end, bs), f"group {g}: slots != scheduled tokens"
            hit_blocks = hit.blocks[g] if hit.num_tokens else []
            k = len(hit_blocks)
            # A window takes no block wholly before the first computed token's window
            # (after external tokens, even a hit's): the null block stands for it.
            skipped = 0 if self.windows[g] is None else first_needed(first, self.windows[g], bs)
            null = m.pool.null_block
            assert table[held : held + k] == [
                null if held + j < skipped else b for j, b in enumerate(hit_blocks)
            ]
            # Every token the runner computes this step finds its window.
            w = self.windows[g]
            for t in range(first, end):
                lo = 0 if w is None else first_needed(t, w, bs)
                missing = [i for i in range(lo, t // bs + 1) if not table[i].block_id]
                assert not missing, f"group {g}: token {t} reads null blocks {missing}"
            for i in range(computed // bs, ceil_div(end, bs)):
                if held <= i < held + k:
                    continue  # checked as a hit
                block = table[i]
                if i < skipped:
                    assert block is null, f"group {g}: block {i} taken before the window"
                    continue
                assert block.ref_cnt == 1, "a block written this step is shared"
                if (i + 1) * bs <= end:
                    self.content[block.block_id] = self.key(g, seq, i)
                else:
                    self.content.pop(block.block_id, None)
        self.seqs[rid] = seq
        self.computed.setdefault(rid, 0)
        self.scheduled[rid] = Chunk(start, first, end)
        self.check_tables()
        return True

    # -- rules ------------------------------------------------------------------

    @precondition(lambda self: len(self.waiting) + len(self.seqs) < 8)
    @rule(
        prompt=prompts,
        copies=st.integers(1, 3),
        lora=st.sampled_from([None, None, None, "ad"]),
        salt=st.sampled_from([None, None, None, "t"]),
    )
    def admit(self, prompt, copies, lora, salt):
        for _ in range(copies):
            seq = CacheSequence(f"r{self.n}", list(prompt), lora_name=lora, cache_salt=salt)
            self.n += 1
            seq = add_seq(self.m, seq)
            self.waiting[seq.request_id] = seq

    @rule(data=st.data())
    def step(self, data):
        candidates = sorted([*self.seqs, *self.waiting])
        chosen = data.draw(st.lists(st.sampled_from(candidates), unique=True)) if candidates else []
        for rid in chosen:
            seq = self.seqs.get(rid) or self.waiting[rid]
            if self.schedule(seq, data):
                self.waiting.pop(rid, None)
        self.end_step()

    def end_step(self):
        check_invariants(self.m, between_steps=False)
        self.m.end_step()
        for rid, sch in self.scheduled.items():
            seq = self.seqs[rid]
            self.computed[rid] = sch.end
            if sch.end == len(seq.token_ids):
                seq.token_ids.append(next_token(seq.token_ids))
        self.scheduled.clear()
        self.check()
        for seq in list(self.seqs.values()):  # finish long requests
            if len(seq.token_ids) > MAX_LEN:
                self.free(seq)

    def free(self, seq: CacheSequence) -> None:
        assert not self.scheduled
        self.m.free(seq.request_id)
        del self.seqs[seq.request_id]
        del self.computed[seq.request_id]
        assert seq.kv_blocks == [[] for _ in self.windows]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), preempt=st.booleans())
    def finish_or_preempt(self, data, preempt):
        rid = data.draw(st.sampled_from(sorted(self.seqs)))
        seq = self.seqs[rid]
        self.free(seq)
        if preempt:  # re-admitted later through a full lookup
            self.waiting[rid] = seq

    @rule()
    def reset_prefix_cache(self):
        idle = not self.seqs
        assert (self.m.pool.num_used == 0) == idle
        entries = [dict(ix) for ix in self.m.pool.index]
        assert self.m.reset_prefix_cache() is idle
        if idle:
            assert all(not ix for ix in self.m.pool.index)
        else:
            assert [dict(ix) for ix in self.m.pool.index] == entries

    @invariant()
    def between_steps(self):
        if hasattr(self, "m"):
            self.check()

    def check(self) -> None:
        m, bs = self.m, self.bs
        check_invariants(m, self.computed)
        self.check_tables()
        for rid, seq in self.seqs.items():
            # sha256: no collision, so nothing may stop a sequence's blocks being cached.
            assert not seq.cache_chain_broken, f"{rid}: cache chain broken without a collision"
            for g, table in enumerate(seq.kv_blocks):
                for i in range(self.computed[rid] // bs):
                    bid = table[i].block_id
                    if bid:
                        assert self.content.get(bid) == self.key(g, seq, i), (
                            f"{rid}: group {g} block {i} (id {bid}) holds another prefix"
                        )
        held = {b.block_id for s in self.seqs.values() for t in s.kv_blocks for b in t}
        assert m.pool.num_used == len(held - {0})

    def teardown(self):
        if not hasattr(self, "m") or self.scheduled:  # no setup, or failed inside a step
            return
        for seq in list(self.seqs.values()):
            self.free(seq)
        assert_drained(self.m)


TestHybridMachine = HybridMachine.TestCase
TestHybridMachine.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
