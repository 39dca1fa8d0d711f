"""The limits the server and the router share (kvserve/request_limits.py), as plain checks:
what a replica reports, what the router makes of several, and the tools a chat offers."""

from __future__ import annotations

import json

import pytest

from kvserve.request_limits import LimitError, PromptLimits
from kvserve.router.limits import loosest

MESSAGES = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "description": "x" * 1000}}


def test_a_reported_limit_reads_back_as_sent():
    sent = PromptLimits(64, 40, 8, 16, True)
    assert PromptLimits.from_dict(sent.as_dict()) == sent
    assert PromptLimits.from_dict({"max_model_len": 64}) is None  # no chars_per_token: none


def test_the_loosest_of_several_replicas():
    a, b = PromptLimits(64, 40, 8, 16, True), PromptLimits(128, 32, 4, 32, False)
    assert loosest([a, b]) == PromptLimits(128, 40, 8, 32, False)
    assert loosest([a, None]) is None


def test_tools_count_against_max_tools():
    limits = PromptLimits(1000, 32, None, 2, False)
    limits.check_messages(MESSAGES, [TOOL, TOOL])
    with pytest.raises(LimitError, match=r"tools has 3 entries; at most 2 \(--max-tools\)") as e:
        limits.check_messages(MESSAGES, [TOOL] * 3)
    assert e.value.param == "tools"


def test_tools_count_toward_the_prompt_only_where_the_template_writes_them():
    tools = [TOOL] * 40  # about 42,000 characters of JSON
    longest = 1000 * 32
    assert len(json.dumps(tools)) > longest
    PromptLimits(1000, 32, None, 128, False).check_messages(MESSAGES, tools)
    with pytest.raises(LimitError, match="longer than any prompt") as e:
        PromptLimits(1000, 32, None, 128, True).check_messages(MESSAGES, tools)
    assert e.value.param == "tools"
