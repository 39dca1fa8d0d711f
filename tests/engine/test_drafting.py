"""Prompt-lookup drafts, and the back-off that makes random text pay (almost) nothing."""

from __future__ import annotations

from kvserve.engine.drafter import Drafter
from kvserve.engine.ngram import propose_ngram
from kvserve.engine.speculative import SpecState, SpeculativeConfig
from kvserve.sampling_params import SamplingParams


def test_the_latest_longest_match_proposes_what_followed_it():
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 6, 7, 8, 2, 3]
    # The suffix [2, 3] last occurred before 4, 5, 6: those are proposed (not 9, 9).
    assert propose_ngram(tokens, 3, 1, 3) == [4, 5, 6]
    # The longest n is tried first: [8, 2, 3] never occurred, [2, 3] did.
    assert propose_ngram(tokens, 2, 2, 3) == [4, 5]
    assert propose_ngram(tokens, 10, 1, 3) == [4, 5, 6, 7, 8, 2, 3]  # what there is
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == []  # nothing repeats
    assert propose_ngram([5], 3, 1, 3) == []


def test_a_byte_match_across_token_boundaries_is_not_a_match():
    # 0x00000100 then 0x00000200: little-endian bytes 00 01 00 00 00 02 00 00; the
    # suffix token 0x00020000 (bytes 00 00 02 00) occurs in them, but misaligned.
    tokens = [0x100, 0x200, 7, 0x20000]
    assert propose_ngram(tokens, 2, 1, 1) == []
    assert propose_ngram([*tokens, 0x100], 2, 1, 1) == [0x200, 7]


def test_back_off_pauses_longer_while_drafts_keep_failing():
    state = SpecState()
    drafted = sum(_step(state, accepted=0) for _ in range(400))
    assert drafted <= 16  # pauses of 4, 8, 16 ... 256 steps: a handful of tries
    good = SpecState()
    assert sum(_step(good, accepted=3) for _ in range(50)) == 50


def test_a_good_run_after_a_pause_restores_the_short_pause():
    state = SpecState()
    for _ in range(40):
        _step(state, accepted=0)
    while not state.drafting():
        pass
    state.verified(3, 3)
    assert state.next_pause == 4


def _step(state: SpecState, accepted: int) -> bool:
    if not state.drafting():
        return False
    state.verified(3, accepted)
    return True


def test_only_sampling_from_one_rows_logits_drafts():
    drafter = Drafter(SpeculativeConfig())
    assert drafter.state_for(SamplingParams()) is not None
    assert drafter.state_for(SamplingParams(temperature=0.7, top_p=0.9)) is not None
    assert drafter.state_for(SamplingParams(logprobs=2)) is None
    assert drafter.state_for(SamplingParams(repetition_penalty=1.2)) is None
    assert drafter.state_for(SamplingParams(logit_bias={3: 1.0})) is None
