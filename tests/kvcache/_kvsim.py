"""A small driver for KVCacheManager tests, with an oracle that is not the manager.

`Sim` plays the scheduler's part (admit, chunk, decode, free) and keeps its own
record of which prefix every physical block was written for (`content`). A hit
or a merge is only right if the block it hands over was written for exactly the
request's prefix (tokens of every block up to it, LoRA name and salt): that is
checked on every hit and, after every step, for every full block held.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.kvcache import CacheSequence, KVCacheManager, PrefixHit, check_invariants
from kvserve.kvcache.hashing import pack_tokens

VOCAB = 3


def next_token(tokens: list[int]) -> int:
    """A greedy-like continuation: identical sequences continue identically."""
    return (sum(tokens[-4:]) + len(tokens)) % VOCAB


def assert_drained(m: KVCacheManager) -> None:
    """Every request freed: the pool is all free, once each, and still consistent."""
    pool = m.pool
    assert pool.num_used == 0
    assert sorted(pool.free_block_ids()) == list(range(1, len(pool.blocks)))
    check_invariants(m, {})


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def prefix_key(seq: CacheSequence, i: int, bs: int) -> tuple:
    """What block `i` of `seq` holds: its whole prefix and the extra keys."""
    return (seq.lora_name, seq.cache_salt, tuple(seq.token_ids[: (i + 1) * bs]))


def snapshot(m: KVCacheManager, seqs) -> tuple:
    """Everything an allocation may change (to prove a failed one changed nothing)."""
    return (
        [m.block_ids(s.request_id) for s in seqs],
        [(s.num_cached_blocks, len(s.merges), s.cache_chain_broken) for s in seqs],
        m.pool.free_block_ids(),
        m.pool.num_used,
        [sorted(ix) for ix in m.pool.index],
        [(b.ref_cnt, b.block_hash, b.computed) for b in m.pool.blocks],
        m.pool.num_evictions,
    )


@dataclass
class Scheduled:
    seq: CacheSequence
    start: int
    num_new: int
    drafts: list[int] = field(default_factory=list)
    """Draft tokens in lookahead slots (speculative decoding); verified in end_step."""


@dataclass
class Sim:
    m: KVCacheManager
    strong_hash: bool = True
    """False for injected weak hashes: collisions make misses (and duplicates) legal."""
    seqs: dict[str, CacheSequence] = field(default_factory=dict)
    """Sequences that hold blocks."""
    computed: dict[str, int] = field(default_factory=dict)
    scheduled: dict[str, Scheduled] = field(default_factory=dict)
    content: dict[int, tuple] = field(default_factory=dict)
    """Block id -> prefix key it was last written for."""
    hits: list[tuple[str, int]] = field(default_factory=list)
    failures: int = 0

    @property
    def bs(self) -> int:
        return self.m.block_size

    def hittable_keys(self) -> set[tuple]:
        """Prefixes a hit must find: full blocks held by running sequences (incl.
        blocks scheduled in this step, which are registered as pending)."""
        keys = set()
        for rid, seq in self.seqs.items():
            sch = self.scheduled.get(rid)
            end = sch.start + sch.num_new if sch else self.computed[rid]
            for i in range(end // self.bs):
                keys.add(prefix_key(seq, i, self.bs))
        return keys

    def check_hit(self, seq: CacheSequence, computed: int, hit: PrefixHit) -> None:
        bs, n = self.bs, len(seq.token_ids)
        held = len(seq.kv_blocks[0])
        blocks = hit.blocks[0] if hit.num_tokens else []
        k = len(blocks)
        if computed % bs or held * bs != computed or computed >= n - 1:
            assert hit.num_tokens == 0, (computed, n, hit.num_tokens)
            return
        for j, block in enumerate(blocks):
            i = held + j
            assert block.token_ids == pack_tokens(seq.token_ids[i * bs : (i + 1) * bs])
            assert self.content.get(block.block_id) == prefix_key(seq, i, bs), "wrong hit"
        end = (held + k) * bs
        if k == 0:
            assert hit.num_tokens == 0
        elif end >= n:
            assert (hit.num_tokens, hit.skip_write_tokens) == (n - 1 - computed, end)
        else:
            assert (hit.num_tokens, hit.skip_write_tokens) == (end - computed, 0)
        assert end <= n and hit.num_tokens < n - computed
        if self.strong_hash:
            keys = self.hittable_keys()
            lo = 0
            while held + lo < n // bs and prefix_key(seq, held + lo, bs) in keys:
                lo += 1
            assert k >= lo, f"{seq.request_id}: hit {k} blocks, {lo} are held by others"

    def schedule(
        self, seq: CacheSequence, max_new: int | None = None, drafts: list[int] | None = None
    ) -> bool:
        """Look up, then allocate (all or nothing) one chunk of `seq`; a decode with
        `drafts` gets lookahead slots for them (speculative decoding)."""
        m, bs, rid = self.m, self.bs, seq.request_id
        assert rid not in self.scheduled
        computed = self.computed.get(rid, 0)
        before_lookup = snapshot(m, [seq, *self.seqs.values()])
        hit = m.get_computed_blocks(seq.request_id, computed)
        assert snapshot(m, [seq, *self.seqs.values()]) == before_lookup, "lookup changed state"
        self.check_hit(seq, computed, hit)
        start = computed + hit.num_tokens
        remaining = len(seq.token_ids) - start
        assert remaining >= 1
        n = remaining if max_new is None else max(1, min(max_new, remaining))
        drafts = drafts if drafts and remaining == 1 and not hit.num_tokens else []
        old = list(seq.kv_blocks[0])
        others = [s for s in self.seqs.values() if s is not seq]
        before = snapshot(m, [seq, *others])
        if not m.allocate_slots(seq.request_id, n, start, hit, num_lookahead_tokens=len(drafts)):
            assert snapshot(m, [seq, *others]) == before, "failed allocation changed state"
            self.failures += 1
            return False
        table = seq.kv_blocks[0]
        # Slots for the scheduled tokens and the drafts; earlier drafts' blocks are kept.
        expected = max(len(old), ceil_div(start + n + len(drafts), bs))
        assert len(table) == expected, "slots != scheduled tokens and drafts"
        plan = m.step_plan(rid)
        assert (plan.start, plan.num_tokens, plan.num_lookahead_tokens) == (
            start,
            n + len(drafts),
            len(drafts),
        )
        assert plan.num_cacheable_blocks <= (start + n) // bs, "a draft slot is offered"
        assert table[: len(old)] == old
        hit_blocks = hit.blocks[0] if hit.num_tokens else []
        assert table[len(old) : len(old) + len(hit_blocks)] == hit_blocks
        if hit.num_tokens:
            self.hits.append((rid, hit.num_tokens))
        for i in range(computed // bs, (start + n) // bs):
            key = prefix_key(seq, i, bs)
            if len(old) <= i < len(old) + len(hit_blocks):
                assert self.content.get(table[i].block_id) == key
            else:  # written by this step (own block; a late merge may swap it later)
                assert table[i].ref_cnt == 1, "a block written this step is shared"
                self.content[table[i].block_id] = key
        self.seqs[rid] = seq
        self.computed.setdefault(rid, 0)
        self.scheduled[rid] = Scheduled(seq, start, n, drafts)
        return True

    def end_step(self, append: bool = True) -> None:
        """Run the step: drafts verified (accepted ones appended, their blocks registered
        before end_step), computed counts advance, sampled tokens are appended."""
        m, bs = self.m, self.bs
        check_invariants(m, between_steps=False)
        for rid, sch in self.scheduled.items():
            seq = sch.seq
            computed = sch.start + sch.num_new
            accepted = computed
            for draft in sch.drafts:  # the "model" is next_token: greedy verification
                if draft != next_token(seq.token_ids):
                    break
                seq.token_ids.append(draft)
                accepted += 1
            if accepted > computed:
                m.accept_tokens(rid, accepted)
                table = seq.kv_blocks[0]
                for i in range(computed // bs, accepted // bs):  # filled by accepted drafts
                    assert table[i].ref_cnt == 1, "a block of drafts is shared"
                    self.content[table[i].block_id] = prefix_key(seq, i, bs)
                computed = accepted
            self.computed[rid] = computed
        m.end_step()
        for rid, sch in self.scheduled.items():
            if append and self.computed[rid] == len(sch.seq.token_ids):
                sch.seq.token_ids.append(next_token(sch.seq.token_ids))
        self.scheduled.clear()
        self.check()

    def check(self) -> None:
        m, bs = self.m, self.bs
        if self.strong_hash:
            check_invariants(m, self.computed)
        else:  # duplicates are legal after a collision; slots still exact
            check_invariants(m)
            for rid, seq in self.seqs.items():
                need = ceil_div(self.computed[rid], bs)
                assert need <= len(seq.kv_blocks[0]) <= max(need, ceil_div(seq.slot_end, bs))
        for rid, seq in self.seqs.items():
            table = seq.kv_blocks[0]
            for i in range(self.computed[rid] // bs):
                assert self.content.get(table[i].block_id) == prefix_key(seq, i, bs), (
                    f"{rid}: block {i} (id {table[i].block_id}) holds another prefix"
                )
        assert m.pool.num_used == len(
            {b.block_id for s in self.seqs.values() for b in s.kv_blocks[0]}
        )

    def free(self, seq: CacheSequence) -> None:
        assert not self.scheduled, "free between steps"
        self.m.free(seq.request_id)
        del self.seqs[seq.request_id]
        del self.computed[seq.request_id]
        assert seq.kv_blocks == [[]]

    def run_to_completion(self, seq: CacheSequence, max_new: int | None = None) -> None:
        """Prefill `seq` alone (in chunks of `max_new`), one step per chunk."""
        while self.computed.get(seq.request_id, 0) < len(seq.token_ids):
            assert self.schedule(seq, max_new)
            self.end_step(append=False)
