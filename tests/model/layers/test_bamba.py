"""Bamba (Mamba2 + attention) at module level against transformers, float32.

The model is driven directly, as the runner will: attention layers through
block tables and AttentionMetadata, mamba layers through state pages and
StateMetadata. However the tokens arrive (whole prompt, uneven chunks, one by
one, batched with another request, resumed from a snapshot), the logits must
be those of transformers' full forward.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import pytest
import torch

from kvserve.model.attention.attention_metadata import AttentionMetadata
from kvserve.model.checkpoint.config import ModelConfig
from kvserve.model.checkpoint.errors import ModelLoadError
from kvserve.model.layers.mamba2 import StateMetadata, StateSegment, state_shapes
from kvserve.model.loader import load_model

BLOCK = 4
NUM_BLOCKS = 48
NUM_PAGES = 12
ATOL = 1e-4


@dataclass
class Chunk:
    """One request's tokens in a step: where they go in the KV blocks and state pages."""

    tokens: list[int]
    start: int
    table: list[int]
    state_in: int
    state_out: int
    snapshots: list[tuple[int, int]] = field(default_factory=list)


class Paged:
    """Our model with its own KV blocks and state pages (page and block 0 are null)."""

    def __init__(self, path: str) -> None:
        self.model, self.config = load_model(path, torch.float32, torch.device("cpu"))
        conv, ssm = state_shapes(self.config)
        kv = (NUM_BLOCKS, BLOCK, self.config.num_kv_heads, self.config.head_dim)
        self.caches = []
        for kind in self.config.layer_kinds:
            if kind == "attention":
                self.caches.append((torch.zeros(kv), torch.zeros(kv)))
            else:
                # NaN in the null page: reading it instead of a zero state would show.
                pools = (torch.zeros(NUM_PAGES, *conv), torch.zeros(NUM_PAGES, *ssm))
                for pool in pools:
                    pool[0] = math.nan
                self.caches.append(pools)

    def step(self, chunks: list[Chunk]) -> list[torch.Tensor]:
        """Run one flattened batch; each chunk's logits [num_tokens, vocab]."""
        spans, segments, ids, positions = [], [], [], []
        for c in chunks:
            n = len(c.tokens)
            spans.append((c.start, n, c.table, 0))
            segments.append(StateSegment(len(ids), n, c.state_in, c.state_out, c.snapshots))
            ids += c.tokens
            positions += range(c.start, c.start + n)
        attn = AttentionMetadata.build(spans, BLOCK, torch.device("cpu"))
        state = StateMetadata(segments)
        metas = [attn if k == "attention" else state for k in self.config.layer_kinds]
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.caches, metas)
            logits = self.model.compute_logits(hidden)
        return list(logits.split([len(c.tokens) for c in chunks]))

    def state(self, page: int) -> list[torch.Tensor]:
        return [t[page].clone() for kind, pools in self._mamba() for t in pools]

    def _mamba(self):
        return [
            (k, c)
            for k, c in zip(self.config.layer_kinds, self.caches, strict=True)
            if k == "mamba"
        ]


def tokens(length: int, salt: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(100 * salt + length)
    return torch.randint(3, 300, (length,), generator=gen).tolist()


def reference(checkpoint, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return checkpoint.hf_model(torch.tensor([ids])).logits[0]


def close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def ck(bamba_checkpoint):
    return bamba_checkpoint


@pytest.fixture
def paged(ck) -> Paged:
    return Paged(ck.path)


def test_config_layer_kinds_and_shapes(paged):
    config = paged.config
    assert config.layer_kinds == ["mamba", "attention", "mamba", "mamba"]
    assert config.rotary_dim == config.head_dim // 2  # Bamba's forced partial_rotary_factor
    assert state_shapes(config) == ((128 + 2 * 2 * 16, 3), (8, 16, 16))
    assert config.mamba.time_step_limit == (0.0, math.inf)


def test_full_prompt_matches_transformers(ck, paged):
    ids = tokens(21)  # 2 full scan chunks of 8 and a partial one
    (logits,) = paged.step([Chunk(ids, 0, list(range(1, 7)), 0, 1)])
    close(logits, reference(ck, ids))


def test_uneven_chunks_then_decode_match_transformers(ck, paged):
    ids = tokens(26, salt=1)
    ref = reference(ck, ids)
    table = list(range(1, 8))
    # (length, state_in, state_out): fresh, moved to another page, then in place.
    plan = [(5, 0, 1), (1, 1, 2), (9, 2, 2), (3, 2, 3), (2, 3, 3)] + [(1, 3, 3)] * 6
    pos = 0
    for n, state_in, state_out in plan:
        (logits,) = paged.step([Chunk(ids[pos : pos + n], pos, table, state_in, state_out)])
        close(logits, ref[pos : pos + n])
        pos += n
    assert pos == len(ids)


def test_two_requests_in_one_batch(ck, paged):
    a, b = tokens(15, salt=2), tokens(12, salt=3)
    ref_a, ref_b = reference(ck, a), reference(ck, b)
    ta, tb = list(range(1, 5)), list(range(10, 14))
    # Step 1: two prefills; step 2: a decode beside a prefill chunk; step 3: two decodes.
    steps = [((0, 13), (0, 7)), ((13, 14), (7, 11)), ((14, 15), (11, 12))]
    for (a0, a1), (b0, b1) in steps:
        la, lb = paged.step(
            [
                Chunk(a[a0:a1], a0, ta, 1 if a0 else 0, 1),
                Chunk(b[b0:b1], b0, tb, 2 if b0 else 0, 2),
            ]
        )
        close(la, ref_a[a0:a1])
        close(lb, ref_b[b0:b1])
    # Each equals its own run alone, from fresh pages.
    (alone,) = Paged(ck.path).step([Chunk(a, 0, ta, 0, 5)])
    close(alone, ref_a)


def test_snapshots_resume_exactly(ck, paged):
    ids = tokens(20, salt=4)
    ref = reference(ck, ids)
    table = list(range(1, 6))
    snaps = [(8, 4), (13, 5), (1, 6), (20, 7)]  # a chunk boundary, mid-chunk, 1 token, the end
    (logits,) = paged.step([Chunk(ids, 0, table, 0, 1, snaps)])
    close(logits, ref)
    assert all(torch.equal(x, y) for x, y in zip(paged.state(7), paged.state(1), strict=True))
    for k, page in snaps[:3]:
        # A fresh request resumes after k tokens (the attention KV of 0..k-1 is in `table`).
        (rest,) = paged.step([Chunk(ids[k:], k, table, page, 8)])
        close(rest, ref[k:])
    # The state after a prompt cut at k equals the snapshot at k.
    paged.step([Chunk(ids[:13], 0, table, 0, 9)])
    for x, y in zip(paged.state(9), paged.state(5), strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


def test_decode_snapshot_and_page_zero_untouched(ck, paged):
    ids = tokens(10, salt=5)
    ref = reference(ck, ids)
    table = list(range(1, 4))
    paged.step([Chunk(ids[:9], 0, table, 0, 1)])
    (last,) = paged.step([Chunk(ids[9:], 9, table, 1, 2, [(1, 3)])])
    close(last, ref[9:])
    assert all(torch.equal(x, y) for x, y in zip(paged.state(3), paged.state(2), strict=True))
    assert all(t.isnan().all() for t in paged.state(0))


def test_bad_segments_are_refused(paged):
    with pytest.raises(ValueError, match="snapshot offsets"):
        paged.step([Chunk(tokens(4), 0, [1], 0, 1, [(5, 2)])])
    with pytest.raises(ValueError, match="null page"):
        paged.step([Chunk(tokens(4), 0, [1], 0, 0)])


def test_greedy_generation_matches_generate(ck, paged):
    prompt = tokens(11, salt=6)
    expected = ck.reference(prompt, 16)
    assert len(set(expected)) > 3  # the oracle means something
    table = list(range(1, 8))
    seq = list(prompt)
    (logits,) = paged.step([Chunk(seq[:6], 0, table, 0, 1)])  # chunked prefill, then decode
    (logits,) = paged.step([Chunk(seq[6:], 6, table, 1, 1)])
    out = []
    while len(out) < 16:
        token = int(logits[-1].argmax())
        out.append(token)
        seq.append(token)
        (logits,) = paged.step([Chunk([token], len(seq) - 1, table, 1, 1)])
    assert out == expected


def _raw(ck) -> dict:
    with open(f"{ck.path}/config.json", encoding="utf-8") as f:
        return json.load(f)


def test_config_parsing(ck):
    raw = _raw(ck)
    assert ModelConfig.from_dict({**raw, "partial_rotary_factor": 1.0}).rotary_dim == 8
    full = {**raw["rope_parameters"], "partial_rotary_factor": 1.0}
    assert ModelConfig.from_dict({**raw, "rope_parameters": full}).rotary_dim == 16
    limited = ModelConfig.from_dict({**raw, "time_step_limit": [0.01, 10]}).mamba
    assert limited.time_step_limit == (0.01, 10.0)
    no_attn = ModelConfig.from_dict({**raw, "attn_layer_indices": None})
    assert no_attn.layer_kinds == ["mamba"] * 4
    for key in ("mamba_d_state", "mamba_n_heads", "mamba_chunk_size"):
        with pytest.raises(ModelLoadError, match=key):
            ModelConfig.from_dict({k: v for k, v in raw.items() if k != key})
    with pytest.raises(ModelLoadError, match="attn_layer_indices"):
        ModelConfig.from_dict({**raw, "attn_layer_indices": [4]})
    with pytest.raises(ModelLoadError, match="mamba_d_head"):
        ModelConfig.from_dict({**raw, "mamba_d_head": 12})
