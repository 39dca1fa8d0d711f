"""The reasoning parsers on known text: whole, and streamed in every way a text can be cut
(the deltas add up to the whole split; no marker ever reaches either part)."""

from __future__ import annotations

import pytest

from kvserve.reasoning.base import ReasoningSplit, ThinkParser
from kvserve.reasoning.registry import REASONING_PARSERS, reasoning_parser

ORDER = ("qwen3", "deepseek_r1")
CASES = {
    # text: (qwen3's split, deepseek_r1's split), as (reasoning, content)
    "<think>\nplan it</think>\n\nThe answer.": (
        ("\nplan it", "\n\nThe answer."),
        ("\nplan it", "\n\nThe answer."),
    ),
    "plan it</think>answer": (("", "plan it</think>answer"), ("plan it", "answer")),
    "<think>cut short by max_tokens": (("cut short by max_tokens", ""),) * 2,
    "no thinking at all": (("", "no thinking at all"), ("no thinking at all", "")),
    "<thin": (("", "<thin"), ("<thin", "")),
    "<think>a < b </thin </think>x</think>y": (("a < b </thin ", "x</think>y"),) * 2,
    "": (("", ""), ("", "")),
}


@pytest.mark.parametrize("text", CASES)
@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_whole_and_streamed_splits_agree_for_every_cut(name: str, text: str):
    parser = reasoning_parser(name)
    want = CASES[text][ORDER.index(name)]
    assert parser.split(text) == ReasoningSplit(*want)
    cuts = [[text[:i], text[i:j], text[j:]] for i in range(len(text) + 1) for j in range(i, i + 9)]
    cuts.append(list(text))  # one character per delta
    for deltas in cuts:
        stream = parser.stream()
        parts = [stream.feed(d) for d in deltas] + [stream.finish()]
        assert "".join(p.reasoning for p in parts) == want[0], deltas
        assert "".join(p.content for p in parts) == want[1], deltas


def test_a_marker_cut_over_two_deltas_is_held_then_never_sent():
    stream = reasoning_parser("qwen3").stream()
    assert stream.feed("<th") == ReasoningSplit()
    assert stream.feed("ink>I think") == ReasoningSplit(reasoning="I think")
    assert stream.feed(" hard</thi") == ReasoningSplit(reasoning=" hard")
    assert stream.feed("nk>Done") == ReasoningSplit(content="Done")
    assert stream.finish() == ReasoningSplit()


def test_thinking_turned_off_makes_everything_content():
    off = reasoning_parser("qwen3", {"enable_thinking": False})
    assert not off.thinking
    assert off.split("<think>x</think>y") == ReasoningSplit(content="<think>x</think>y")
    assert reasoning_parser("qwen3", {"enable_thinking": True}).thinking
    # DeepSeek-R1's template always opens the thinking: no switch turns it off
    assert reasoning_parser("deepseek_r1", {"enable_thinking": False}).thinking


def test_an_unknown_parser_is_refused_by_name():
    with pytest.raises(ValueError, match="'qwen9'"):
        reasoning_parser("qwen9")
    assert all(issubclass(p, ThinkParser) for p in REASONING_PARSERS.values())
