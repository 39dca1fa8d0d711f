"""The incremental detokenizer against a full decode, on the demo's byte-level BPE."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from kvserve.engine.detokenizer import (
    REPLACEMENT,
    IncrementalDetokenizer,
    OutputText,
    decoder_for,
    skipped_ids,
)

WORDS = ["é", "€", "😀", "中文", " wörld", "ß", " naïve", "Hello", " the"]
"""Their multi-byte characters are split over byte tokens by the demo tokenizer."""


def stream(decode, prompt, ids, skipped=frozenset()):
    """Per-token pieces, then the flush at the end."""
    detokenizer = IncrementalDetokenizer.after(decode, prompt, skipped)
    pieces = [detokenizer.step(t) for t in ids]
    return pieces, detokenizer.flush()


@pytest.fixture(scope="module")
def pieces_of(demo_tokenizer):
    return [demo_tokenizer.encode(w) for w in WORDS]


def test_the_words_are_split_inside_characters(demo_tokenizer, pieces_of):
    decoded = [demo_tokenizer.decode([t]) for ids in pieces_of for t in ids]
    assert sum(REPLACEMENT in d for d in decoded) >= 10  # halves of characters, alone


def id_sequences(vocab: int, words: list[list[int]]):
    token = st.one_of(
        st.integers(0, vocab - 1).map(lambda t: [t]),  # any token: stray bytes, specials
        st.sampled_from(words),  # whole words whose characters span tokens
        st.sampled_from(words).map(lambda w: w[1:]),  # a word cut inside a character
    )
    return st.lists(token, max_size=40).map(lambda parts: [t for p in parts for t in p])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_pieces_add_up_to_a_full_decode(demo_tokenizer, pieces_of, data):
    ids = data.draw(id_sequences(len(demo_tokenizer), pieces_of), label="ids")
    prompt = data.draw(id_sequences(len(demo_tokenizer), pieces_of), label="prompt")
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    skipped = skipped_ids(demo_tokenizer) if skip else frozenset()
    pieces, rest = stream(decoder_for(demo_tokenizer, skip), prompt, ids, skipped)
    # Byte-level text is the same whatever came before a clean context.
    assert "".join(pieces) + rest == demo_tokenizer.decode(ids, skip_special_tokens=skip)
    # A piece never ends in a character a later token could still complete.
    assert not any(p.endswith(REPLACEMENT) for p in pieces)


def test_a_step_decodes_a_window_not_the_whole_output(demo_tokenizer, pieces_of):
    decode = decoder_for(demo_tokenizer, True)
    longest = 0

    def counting(ids):
        nonlocal longest
        longest = max(longest, len(ids))
        return decode(ids)

    eos = demo_tokenizer.eos_token_id
    assert skipped_ids(demo_tokenizer) == {0, 1, 2}  # the three special tokens
    # Words whose characters span tokens, then a model repeating EOS (ignore_eos).
    ids = [t for _ in range(50) for w in pieces_of for t in w] + [eos] * 500
    pieces, rest = stream(counting, [], ids, skipped_ids(demo_tokenizer))
    assert "".join(pieces) + rest == demo_tokenizer.decode(ids, skip_special_tokens=True)
    assert longest <= 12  # the last emitted tokens plus the pending ones


def test_a_leading_space_survives_thanks_to_the_prompt_context():
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3, "▁the": 4, "re": 5}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()  # SentencePiece: a decode drops its first space
    decode = decoder_for(tokenizer, True)
    assert decode([2, 3]) == "world!"
    assert stream(decode, [1], [2, 3, 4, 5]) == ([" world", "!", " the", "re"], "")
    assert stream(decode, [], [2, 3]) == (["world", "!"], "")


def test_a_decoder_that_rewrites_its_past_restarts_without_context():
    # Token 9 rewrites the text of the token before it (vLLM #17448's symptom).
    def decode(ids):
        text = "".join("ab"[t] if t < 2 else "" for t in ids)
        return ("X" + text[1:] if text else "X") if 9 in ids else text

    detokenizer = IncrementalDetokenizer.after(decode, [])
    assert [detokenizer.step(t) for t in (0, 1)] == ["a", "b"]
    assert detokenizer.step(9) == ""  # "X": shorter than the context's text: wait
    assert detokenizer.step(0) == "X"  # "Xa" does not start with "b": the pending alone
    assert detokenizer.step(1) == "b"


def text_of(words: list[str], **fields) -> OutputText:
    state = OutputText(IncrementalDetokenizer(lambda ids: "".join(words[t] for t in ids)), **fields)
    for token in range(len(words)):
        state.add(token)
    return state


def test_output_text_holds_back_and_hands_out_each_character_once():
    state = text_of(["ab", "cd", "ef"], reach=2, holdback=2)
    assert state.text(False) == "abcd" and state.text(True) == "abcdef"
    assert state.tail(3) == "def" and state.tail(99) == "abcdef"
    assert state.delta(False) == "abcd" and state.delta(False) == ""
    state.cut(2)  # a stop string starting in the held-back text
    assert state.text(True) == "abcd" and state.delta(True) == "" and state.length == 4
