"""The server's OpenAPI document (GET /openapi.json): its routes and their request bodies.

The handlers read bodies by hand (request/protocol.py), so FastAPI cannot derive the
schemas: they are written here, with the ranges the server enforces. The fuzz
test (tests/serve/test_fuzz.py) generates requests from this document, valid
and invalid, and checks that every answer is a 2xx or a 4xx in OpenAI's body.
"""

from __future__ import annotations

from typing import Any

from kvserve.chat_template import ROLES
from kvserve.request_limits import MAX_BATCH_PROMPTS
from kvserve.sampling_params import INT64_MAX, INT64_MIN, MAX_LOGIT_BIAS, MAX_LOGPROBS

_INT64 = {"type": "integer", "minimum": INT64_MIN, "maximum": INT64_MAX}
_TOKENS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
_STOP = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}
_SCHEMA = {"type": "object"}
_PRIORITY = {"type": "integer", "minimum": INT64_MIN, "maximum": INT64_MAX}
BATCH = MAX_BATCH_PROMPTS
_CHOICE = {"type": "array", "items": {"type": "string"}, "minItems": 1}
_STRUCTURED: dict[str, Any] = {
    # One constraint per request (request/structured.py); the fuzz test sends them one by one.
    "response_format": {
        "oneOf": [
            {
                "type": "object",
                "required": ["type"],
                "properties": {"type": {"enum": ["text", "json_object"]}},
                "additionalProperties": False,
            },
            {
                "type": "object",
                "required": ["type", "json_schema"],
                "properties": {
                    "type": {"const": "json_schema"},
                    "json_schema": {
                        "type": "object",
                        "required": ["name", "schema"],
                        "properties": {
                            "name": {"type": "string", "minLength": 1},
                            "schema": _SCHEMA,
                            "strict": {"type": "boolean"},
                        },
                    },
                },
                "additionalProperties": False,
            },
        ]
    },
    "structured_outputs": {
        "type": "object",
        "minProperties": 1,
        "maxProperties": 1,
        "properties": {
            "json": _SCHEMA,
            "json_object": {"type": "boolean"},
            "regex": {"type": "string", "minLength": 1},
            "choice": _CHOICE,
            "grammar": {"type": "string", "minLength": 1},
            "structural_tag": {"type": "string", "minLength": 1},
        },
        "additionalProperties": False,
    },
    "guided_json": _SCHEMA,
    "guided_regex": {"type": "string", "minLength": 1},
    "guided_choice": _CHOICE,
    "guided_grammar": {"type": "string", "minLength": 1},
}
_SAMPLING: dict[str, Any] = {
    "model": {"type": "string"},
    "max_tokens": {"type": "integer", "minimum": 1},
    "max_completion_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": -1},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "n": {"type": "integer", "minimum": 1},
    "seed": _INT64,
    "stop": _STOP,
    "stop_token_ids": _TOKENS,
    "ignore_eos": {"type": "boolean"},
    "min_tokens": {"type": "integer", "minimum": 0},
    "skip_special_tokens": {"type": "boolean"},
    "include_stop_str_in_output": {"type": "boolean"},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "repetition_penalty": {"type": "number", "exclusiveMinimum": 0},
    "logit_bias": {
        "type": "object",
        "additionalProperties": {
            "type": "number",
            "minimum": -MAX_LOGIT_BIAS,
            "maximum": MAX_LOGIT_BIAS,
        },
    },
    "stream": {"type": "boolean"},
    "stream_options": {
        "type": "object",
        "properties": {
            "include_usage": {"type": "boolean"},
            "continuous_usage_stats": {"type": "boolean"},
        },
    },
    "user": {"type": "string"},
    "cache_salt": {"type": "string", "minLength": 1},
    "priority": _PRIORITY,
    **_STRUCTURED,
}
_PROMPT = {
    "oneOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": BATCH},
        {**_TOKENS, "minItems": 1},
        {"type": "array", "items": {**_TOKENS, "minItems": 1}, "minItems": 1, "maxItems": BATCH},
    ]
}
_FUNCTION_NAME = {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"}


def _function(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    """`{"type": "function", "function": {...}}`: a tool, a call, a named tool_choice."""
    function = {"type": "object", "required": required, "properties": properties}
    return {
        "type": "object",
        "required": ["type", "function"],
        "properties": {"type": {"const": "function"}, "function": function},
    }


_CALL = _function({"name": _FUNCTION_NAME, "arguments": {"type": "string"}}, ["name", "arguments"])
_CALL["properties"]["id"] = {"type": "string"}
_MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"enum": list(ROLES)},
        "content": {"type": ["string", "null"]},
        "tool_calls": {"type": "array", "items": _CALL},
        "tool_call_id": {"type": "string"},
    },
}
_TOOL = {
    "name": _FUNCTION_NAME,
    "description": {"type": "string"},
    "parameters": _SCHEMA,
    "strict": {"type": "boolean"},
}
_TOOLS: dict[str, Any] = {
    "tools": {"type": "array", "items": _function(_TOOL, ["name"])},
    "tool_choice": {
        "oneOf": [
            {"enum": ["none", "auto", "required"]},
            _function({"name": _FUNCTION_NAME}, ["name"]),
        ]
    },
    "parallel_tool_calls": {"type": "boolean"},
}
BODIES: dict[str, dict[str, Any]] = {
    "/v1/completions": {
        "type": "object",
        "required": ["prompt"],
        "properties": {
            **_SAMPLING,
            "prompt": _PROMPT,
            "echo": {"type": "boolean"},
            "logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS},
        },
    },
    "/v1/chat/completions": {
        "type": "object",
        "required": ["messages"],
        "properties": {
            **_SAMPLING,
            "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
            "logprobs": {"type": "boolean"},
            "top_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS},
            "echo": {"type": "boolean"},
            "chat_template_kwargs": {"type": "object"},
            "reasoning_effort": {"type": "string"},
            **_TOOLS,
        },
    },
    "/v1/embeddings": {
        "type": "object",
        "required": ["input"],
        "properties": {
            "model": {"type": "string"},
            "input": _PROMPT,
            "encoding_format": {"enum": ["float", "base64"]},
            "dimensions": {"type": "integer"},
            "add_special_tokens": {"type": "boolean"},
            "priority": _PRIORITY,
            "user": {"type": "string"},
        },
    },
    "/tokenize": {
        "type": "object",
        "properties": {
            "model": {"type": "string"},
            "prompt": {"type": "string"},
            "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
            "add_special_tokens": {"type": "boolean"},
            **_TOOLS,
        },
        "additionalProperties": False,
    },
    "/detokenize": {
        "type": "object",
        "required": ["tokens"],
        "properties": {"model": {"type": "string"}, "tokens": _TOKENS},
    },
}
_TEXT = {"type": "string", "minLength": 1}
_NUMBERS = {
    "temperature": {"type": "number", "minimum": 0},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
}
_RESPONSES_TOOLS = {
    "tools": {
        "type": "array",
        "items": {
            "type": "object",
            "required": ["type", "name"],
            "properties": {
                "type": {"const": "function"},
                "name": _FUNCTION_NAME,
                "parameters": _SCHEMA,
            },
        },
    },
    "tool_choice": {"enum": ["none", "auto", "required"]},
    "parallel_tool_calls": {"type": "boolean"},
}
_ANTHROPIC_TOOLS = {
    "tools": {
        "type": "array",
        "items": {
            "type": "object",
            "required": ["name", "input_schema"],
            "properties": {"name": _FUNCTION_NAME, "input_schema": _SCHEMA},
        },
    },
    "tool_choice": {
        "type": "object",
        "required": ["type"],
        "properties": {"type": {"enum": ["auto", "any", "none"]}},
    },
}
_TURN = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {"role": {"enum": ["user", "assistant"]}, "content": _TEXT},
}
_MESSAGES = {
    "model": {"type": "string"},
    "messages": {"type": "array", "items": _TURN, "minItems": 1},
    "system": {"type": "string"},
    **_ANTHROPIC_TOOLS,
}
BODIES["/v1/responses"] = {
    "type": "object",
    "required": ["input"],
    "properties": {
        "model": {"type": "string"},
        "input": {"oneOf": [_TEXT, {"type": "array", "items": _MESSAGE, "minItems": 1}]},
        "instructions": {"type": "string"},
        "max_output_tokens": {"type": "integer", "minimum": 1},
        **_NUMBERS,
        **_RESPONSES_TOOLS,
        "text": {
            "type": "object",
            "properties": {
                "format": {
                    "type": "object",
                    "required": ["type"],
                    "properties": {"type": {"enum": ["text", "json_object"]}},
                }
            },
            "additionalProperties": False,
        },
        "stream": {"type": "boolean"},
        "store": {"type": "boolean"},
        "metadata": {"type": "object"},
    },
    "additionalProperties": False,
}
BODIES["/v1/messages"] = {
    "type": "object",
    "required": ["max_tokens", "messages"],
    "properties": {
        **_MESSAGES,
        "max_tokens": {"type": "integer", "minimum": 1},
        "stop_sequences": {"type": "array", "items": _TEXT},
        **_NUMBERS,
        "top_k": {"type": "integer", "minimum": -1},
        "stream": {"type": "boolean"},
    },
    "additionalProperties": False,
}
BODIES["/v1/messages/count_tokens"] = {
    "type": "object",
    "required": ["messages"],
    "properties": _MESSAGES,
    "additionalProperties": False,
}
"""The Responses and Messages APIs (their errors on /v1/messages are Anthropic's body)."""
_NAME = {"type": "string", "minLength": 1, "maxLength": 4096}
BODIES["/v1/load_lora_adapter"] = {
    "type": "object",
    "required": ["lora_name", "lora_path"],
    "properties": {"lora_name": _NAME, "lora_path": _NAME},
    "additionalProperties": False,
}
BODIES["/v1/unload_lora_adapter"] = {
    "type": "object",
    "required": ["lora_name"],
    "properties": {"lora_name": _NAME, "lora_int_id": {"type": "integer"}},
    "additionalProperties": False,
}
"""vLLM's run-time LoRA routes (--enable-lora; a 404 without it): plain text on success;
`model` on every route above names the base model or a served adapter."""
GETS = ("/health", "/metrics", "/version", "/v1/models", "/kv-metadata")
_ERROR = {
    "description": "OpenAI's error body",
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "required": ["error"],
                "properties": {"error": {"type": "object", "required": ["message", "type"]}},
            }
        }
    },
}


def openapi_document(version: str) -> dict[str, Any]:
    paths: dict[str, Any] = {}
    for path in GETS:
        paths[path] = {"get": {"responses": {"200": {"description": "OK"}}}}
    for path, schema in BODIES.items():
        paths[path] = {
            "post": {
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": schema}},
                },
                "responses": {"200": {"description": "OK"}, "default": _ERROR},
            }
        }
    return {
        "openapi": "3.1.0",
        "info": {"title": "kvserve", "version": version},
        "paths": paths,
    }
