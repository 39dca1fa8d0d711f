"""Conversations to prompts through the checkpoint's own chat template.

The template is the model's (transformers' `apply_chat_template` renders
it); kvserve never guesses one. The rendered text already holds the special
tokens the template wants (BOS, role markers), so it is tokenized without
adding any: a second BOS would change the model's answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvserve.request_limits import LimitError, decode_json

Message = dict[str, Any]
Conversation = Sequence[Message]


def as_conversations(messages: Conversation | Sequence[Conversation]) -> list[list[Message]]:
    """One conversation (a list of messages) or several (a list of such lists)."""
    if not isinstance(messages, list | tuple) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} messages")
    if all(isinstance(m, dict) for m in messages):
        conversations = [list(messages)]
    elif all(isinstance(c, list | tuple) for c in messages):
        conversations = [list(c) for c in messages]
    else:
        raise ValueError("messages must be a list of messages or a list of conversations")
    for i, conversation in enumerate(conversations):
        _check(conversation, i)
    return conversations


def _check(conversation: list[Any], index: int) -> None:
    if not conversation:
        raise ValueError(f"conversation {index} is empty")
    for j, message in enumerate(conversation):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"conversation {index}, message {j}: needs a string 'role'")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"conversation {index}, message {j}: needs a string 'content'")


ROLES = ("system", "developer", "user", "assistant", "tool", "function")
"""OpenAI's message roles: any other is refused, not handed to the template."""


def openai_messages(messages: Any) -> list[Message]:
    """OpenAI's `messages` as the template sees them: role and content, content given as
    text parts joined into one string (the server and the router agree on it). An
    assistant turn's `tool_calls` (its content may then be null: "" here) and a tool
    message's `tool_call_id` pass on, a call's arguments as a dict (OpenAI sends their
    JSON text; templates such as Qwen's iterate them), so the template renders them."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] needs a string 'role'")
        if message["role"] not in ROLES:
            raise ValueError(f"messages[{i}]: role must be one of {', '.join(ROLES)}")
        calls = message.get("tool_calls")
        content = message.get("content")
        if isinstance(content, list):
            parts = [p.get("text") for p in content if isinstance(p, dict)]
            texts = [p for p in parts if isinstance(p, str)]
            if len(texts) != len(content):
                raise ValueError(f"messages[{i}]: only text content parts")
            content = "".join(texts)
        if content is None and calls:
            content = ""
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}] needs a string 'content'")
        converted: Message = {"role": message["role"], "content": content}
        if calls:
            if message["role"] != "assistant":
                raise ValueError(f"messages[{i}]: only an assistant message has tool_calls")
            converted["tool_calls"] = _tool_calls(calls, f"messages[{i}].tool_calls")
        for key in ("tool_call_id", "name"):
            value = message.get(key)
            if value is not None:
                if not isinstance(value, str):
                    raise ValueError(f"messages[{i}].{key} must be a string")
                converted[key] = value
        out.append(converted)
    return out


def _tool_calls(calls: Any, where: str) -> list[Message]:
    """An assistant turn's calls for the template: arguments as a dict (vLLM's rule)."""
    if not isinstance(calls, list):
        raise ValueError(f"{where} must be a list")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"{where}[{j}] needs a function with a string name")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):  # read as a body is: at most MAX_JSON_DEPTH deep
            try:
                arguments = decode_json(arguments or "{}", f"{where}[{j}].function.arguments")
            except LimitError as exc:
                raise ValueError(exc.message) from None
        if not isinstance(arguments, dict):
            raise ValueError(f"{where}[{j}].function.arguments must be a JSON object")
        entry: Message = {
            "type": "function",
            "function": {"name": function["name"], "arguments": arguments},
        }
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


def offered_tools(tools: Any, tool_choice: Any) -> list[dict[str, Any]] | None:
    """The tools a chat request shows the template: its `tools`, unless none are given or
    `tool_choice` is "none" (the server and the router agree on it)."""
    if not isinstance(tools, list) or not tools or tool_choice == "none":
        return None
    return tools


RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "tools",
        "documents",
        "return_dict",
        "return_tensors",
        "return_assistant_tokens_mask",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
    }
)
"""apply_chat_template's own arguments: not template variables, refused in chat_template_kwargs."""


def template_kwargs(extra: Any, reasoning_effort: Any = None) -> dict[str, Any]:
    """A chat request's extra template variables: `chat_template_kwargs` (any key is the
    template's business but apply_chat_template's own arguments) and `reasoning_effort`,
    passed as a variable as vLLM passes it (`chat_template_kwargs` wins a clash).
    A ValueError's message starts with the field at fault."""
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise ValueError("chat_template_kwargs must be an object")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & extra.keys())
    if reserved:
        raise ValueError(
            f"chat_template_kwargs may not set {reserved[0]!r} (not a template variable)"
        )
    if reasoning_effort is not None and not isinstance(reasoning_effort, str):
        raise ValueError("reasoning_effort must be a string")
    effort = {} if reasoning_effort is None else {"reasoning_effort": reasoning_effort}
    return {**effort, **extra}


def render(
    tokenizer: Any,
    conversation: list[Message],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> tuple[str, list[int]]:
    """(prompt text, its token ids) of one conversation; `template_kwargs`: extra template
    variables (`enable_thinking`, ...), which a template that does not read them ignores;
    `tools`: the functions offered (OpenAI's tool dicts), the template's `tools`."""
    if tokenizer is None:
        raise ValueError("this checkpoint has no tokenizer, so it has no chat template")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "this checkpoint has no chat template: pass chat_template=... (a Jinja template), "
            "or use generate() with plain prompts"
        )
    import jinja2

    try:
        text = tokenizer.apply_chat_template(
            conversation,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            tools=tools,
            **(template_kwargs or {}),
        )
    except jinja2.TemplateError as exc:  # the template refused the conversation or a variable
        raise ValueError(f"the chat template failed: {exc}") from None
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if not ids:
        raise ValueError("the chat template rendered an empty prompt")
    return text, ids


def template_reads(tokenizer: Any, name: str) -> bool:
    """Whether the checkpoint's chat template reads the variable `name` (parsed, not run)."""
    import jinja2
    from jinja2 import meta

    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return False
    try:
        return name in meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateError:
        return False
