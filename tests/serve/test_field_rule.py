"""fields.py's rule without a server: neutral values, the header, one warning per name."""

from __future__ import annotations

import logging

import pytest

from kvserve.serve.http.errors import APIError
from kvserve.serve.request import fields
from kvserve.serve.request.protocol import CHAT_FIELDS, COMPLETION_FIELDS


def ignored(body: dict, chat: bool = False) -> list[str]:
    return fields.ignored_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS, chat)


def refused(body: dict, chat: bool = False) -> str | None:
    try:
        ignored(body, chat)
    except APIError as exc:
        return exc.param
    return None


def test_served_fields_are_neither_ignored_nor_in_the_tables():
    for chat, served in ((False, COMPLETION_FIELDS), (True, CHAT_FIELDS)):
        assert not served & fields.UNSUPPORTED[chat].keys()
    body = {"prompt": "x", "ignore_eos": True, "min_tokens": 3, "stop_token_ids": [2]}
    assert ignored(body) == []
    chat = {"chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "low"}
    assert ignored({**chat, "echo": True}, chat=True) == []  # served in chat since issue 30


def test_unknown_names_are_ignored_in_body_order():
    assert ignored({"zeta": 1, "prompt": "x", "alpha": None}) == ["zeta", "alpha"]
    # a field of the other endpoint is unknown here, not served
    assert ignored({"messages": [], "suffix": "x"}, chat=True) == ["suffix"]
    assert ignored({"prompt": "x", "top_logprobs": 2}) == ["top_logprobs"]


@pytest.mark.parametrize(
    ("body", "chat"),
    [
        ({"tools": None, "tool_choice": "none"}, True),
        ({"tool_choice": "auto"}, True),
        ({"function_call": "auto", "functions": []}, True),
        ({"response_format": {"type": "text"}}, False),
        ({"best_of": 1}, False),
        ({"best_of": 3, "n": 3}, False),
        ({"length_penalty": 1}, False),  # 1 is 1.0
        ({"add_special_tokens": True}, False),
        ({"add_special_tokens": False}, True),
        ({"modalities": ["text"], "echo": False}, True),
    ],
)
def test_neutral_values_are_accepted(body, chat):
    assert refused(body, chat) is None and ignored(body, chat) == []


@pytest.mark.parametrize(
    ("body", "chat", "param"),
    [
        ({"function_call": "auto", "functions": [{"name": "f"}]}, True, "function_call"),
        ({"function_call": "none", "functions": [{"name": "f"}]}, True, "functions"),
        ({"structural_tag": '{"structures": []}'}, False, "structural_tag"),
        ({"best_of": 2}, False, "best_of"),
        ({"use_beam_search": 0}, False, "use_beam_search"),  # 0 is not false
        ({"spaces_between_special_tokens": 1}, False, "spaces_between_special_tokens"),
        ({"modalities": ["text", "audio"]}, True, "modalities"),
        ({"add_special_tokens": False}, False, "add_special_tokens"),
        ({"add_special_tokens": True}, True, "add_special_tokens"),
    ],
)
def test_values_that_ask_for_something_are_refused_by_name(body, chat, param):
    assert refused(body, chat) == param


def test_the_refusal_says_what_is_accepted():
    with pytest.raises(APIError, match=r"'functions'.*function calling.*only as null, \[\]"):
        ignored({"functions": [{"name": "f"}]}, chat=True)


def test_the_header_lists_names_percent_encoded_and_counts_the_rest():
    assert fields.header([]) == {}
    assert fields.header(["a_b", "c,d", "é\n"]) == {fields.HEADER: "a_b,c%2Cd,%C3%A9%0A"}
    many = [f"f{i}" for i in range(fields.MAX_LISTED + 3)]
    value = fields.header(many)[fields.HEADER].split(",")
    assert value[:-1] == many[: fields.MAX_LISTED] and value[-1] == "+3"


def test_each_name_is_warned_about_once_up_to_a_limit(caplog):
    log = fields.IgnoredLog()
    with caplog.at_level(logging.WARNING, logger="kvserve.serve"):
        log.note(["a", "b", "a"])
        log.note(["b", "a"])
        log.note(["c", "a"])
    assert [r.getMessage().count("'") // 2 for r in caplog.records] == [2, 1]
    assert "'c'" in caplog.records[1].getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvserve.serve"):
        log.note(f"n{i}" for i in range(fields.MAX_LOGGED))
        log.note(["later"])
    assert len(log.logged) == fields.MAX_LOGGED and "later" not in log.logged
    assert len(caplog.records) == 2 and "no more" in caplog.records[1].getMessage()
