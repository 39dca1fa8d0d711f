"""A request's prompts as a replica will tokenize them, so the router can predict their hits.

Completions: a string is encoded as the engine encodes it (`tokenizer.encode`,
special tokens added), token ids are taken as they are, and a batch is a
list of either. Chat: the messages as the server reads them
(kvserve.chat_template.openai_messages) through the checkpoint's own
template (`render`, with the request's `chat_template_kwargs` and
`reasoning_effort`, and the `tools` it offers). Embeddings: `input` read as
completions read `prompt` (the same shapes), strings encoded with the
request's `add_special_tokens`; a batch is predicted whole (every input's hit,
summed), as a completions batch is. A body the router does not understand gets no
prediction: it is forwarded all the same, and the replica answers it
(with the 400 that names the problem).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal

from kvserve.chat_template import offered_tools, openai_messages, render, template_kwargs
from kvserve.prompt_fields import completion_prompts

Endpoint = Literal["completions", "chat", "embeddings"]


def prompt_token_ids(tokenizer: Any, endpoint: Endpoint, body: Any) -> list[list[int]] | None:
    """One token list per prompt the replica will run, or None if unknown."""
    if not isinstance(body, dict):
        return None
    try:
        if endpoint == "embeddings":
            special = body.get("add_special_tokens", True)
            if not isinstance(special, bool):
                return None
            return _completion_prompts(tokenizer, body.get("input"), special)
        if endpoint == "chat":
            if tokenizer is None:
                return None
            messages = openai_messages(body.get("messages"))
            extra = template_kwargs(body.get("chat_template_kwargs"), body.get("reasoning_effort"))
            tools = offered_tools(body.get("tools"), body.get("tool_choice"))
            return [render(tokenizer, messages, template_kwargs=extra, tools=tools)[1]]
        return _completion_prompts(tokenizer, body.get("prompt"))
    except ValueError:
        return None


def extra_keys(
    body: Any, served_name: Any, adapters: Mapping[str, str]
) -> dict[str, str | None] | None:
    """What the engine mixes into a request's block hashes besides its tokens: the cache
    salt, and the content identity of the LoRA adapter its `model` names (`adapters`:
    name -> identity, `adapter_identities`). None for a model the router cannot hash
    for (an adapter loaded after it read the replicas): no prediction, never a guess."""
    if not isinstance(body, dict):
        return {"lora_name": None, "cache_salt": None}
    salt = body.get("cache_salt")
    model = body.get("model")
    lora = None
    if model is not None and model != served_name:
        if not isinstance(model, str) or model not in adapters:
            return None
        lora = adapters[model]
    return {"lora_name": lora, "cache_salt": salt if isinstance(salt, str) and salt else None}


def adapter_identities(infos: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """Adapter name -> content identity, from the replicas' /kv-metadata `lora_adapters`:
    the names every replica that lists them lists with one identity (a name two replicas
    hold with different weights gets no prediction)."""
    seen: dict[str, set[str]] = {}
    for info in infos:
        for entry in info.get("lora_adapters") or ():
            if isinstance(entry, dict) and isinstance(entry.get("name"), str):
                seen.setdefault(entry["name"], set()).add(str(entry.get("identity")))
    return {name: next(iter(ids)) for name, ids in seen.items() if len(ids) == 1}


def _completion_prompts(
    tokenizer: Any, prompt: Any, special: bool = True
) -> list[list[int]] | None:
    prompts = completion_prompts(prompt)  # a ValueError: the caller gives no prediction
    if tokenizer is None and any(isinstance(p, str) for p in prompts):
        return None
    return [
        list(p) if isinstance(p, list) else list(tokenizer.encode(p, add_special_tokens=special))
        for p in prompts
    ]
