"""A request's prompts, checked and tokenized before anything reaches the engine.

Chat's body becomes one rendered prompt and its SamplingParams here (`chat_prompt`):
the OpenAI chat route, the Responses API and the Messages API (which translate
their bodies into chat bodies first) all come through it, so every API gets the
same checks in the same order. Completions' prompts need no rendering (plain text
or token ids: openai/completions.py checks them); both endpoints name the fields
their answer ignores (`note_ignored`, request/fields.py: the rule).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.lora.request import LoRARequest
from kvserve.sampling_params import SamplingParams
from kvserve.serve.http.admission import request_priority
from kvserve.serve.http.errors import APIError
from kvserve.serve.request import fields, protocol, structured, tools
from kvserve.serve.request.grammar_limits import check_grammar, check_tools
from kvserve.serve.request.reasoning import ChatReasoning, chat_reasoning
from kvserve.serve.state import ServerState
from kvserve.tool_calls.parser import ToolParser


@dataclass(slots=True)
class ChatPrompt:
    """A chat body checked and rendered: what the engine runs, and how."""

    ids: list[int]
    params: SamplingParams
    echo: str
    """What chat's echo puts first (the last message's content when it is the assistant's)."""
    ignored: list[str]
    tool_parser: ToolParser | None = None
    """Chat with tools: the answer is read for tool calls."""
    reasoning: ChatReasoning | None = None
    """Chat with --reasoning-parser: the answer is split into reasoning and content."""
    lora: LoRARequest | None = None
    """The LoRA adapter `model` named (None: the base model)."""
    model: str = ""
    """The name the answer carries: the one the client asked for."""


async def chat_prompt(state: ServerState, body: dict[str, Any]) -> ChatPrompt:
    """The one place a chat body becomes a prompt and SamplingParams (the Responses and
    Messages APIs translate their bodies into chat bodies and come here too)."""
    ignored = note_ignored(body, state, chat=True)
    lora = state.check_model(body.get("model"))
    messages = protocol.chat_messages(body)
    context = state.max_request_tokens
    default = protocol.DEFAULT_MAX_TOKENS if context is None else context
    params = protocol.sampling_params(body, True, state.max_n, default_max_tokens=default)
    tool_request = tools.read_tools(body)
    check_tools(tool_request, state.limits)
    parser = state.tool_parser
    assert parser is not None
    constraint = structured.structured_outputs(body)
    field_name = "response_format" if constraint is None else constraint[1]
    params = tools.constrained(params, tool_request, parser)
    calls = tool_request is not None and tool_request.parses
    check_grammar(params, "tools" if calls else field_name, state.limits)
    kwargs = protocol.template_kwargs(body)
    if "reasoning_effort" in kwargs and not state.tokens.template_reads("reasoning_effort"):
        ignored = [*ignored, "reasoning_effort"]  # passed on; this template has no use for it
        state.ignored_log.note(["reasoning_effort"])
    reasoning, params = chat_reasoning(state.reasoning_parser, kwargs, params, field_name)
    request_priority(body, state.scheduling_policy)
    state.check_admission()
    offered = None if tool_request is None else tool_request.template_tools
    ids = await state.tokens.render(messages, kwargs, offered)
    if context is not None and not protocol.sets_max_tokens(body):
        if len(ids) >= context:
            raise APIError(
                f"the prompt is {len(ids)} tokens, leaving no room to answer in "
                f"{context} (max_model_len, or what the KV pool holds)",
                param="messages",
            )
        params = protocol.with_max_tokens(params, context - len(ids))
    echo = messages[-1]["content"] if messages[-1]["role"] == "assistant" else ""
    tool_parser = parser if tool_request is not None and tool_request.parses else None
    model = state.answer_name(body.get("model"))
    return ChatPrompt(ids, params, echo, ignored, tool_parser, reasoning, lora, model)


def note_ignored(body: dict[str, Any], state: ServerState, chat: bool) -> list[str]:
    """The fields this request's answer ignores (request/fields.py: the rule), each logged once."""
    served = protocol.CHAT_FIELDS if chat else protocol.COMPLETION_FIELDS
    ignored = fields.ignored_fields(body, served, chat)
    state.ignored_log.note(ignored)
    return ignored
