"""`EngineArgs` as command-line options, generated from the dataclass so that the two cannot
drift: each field's flag (`block_size` -> `--block-size`), type, default and help come from
it; `_SPECIAL` keeps only what a type cannot say (lower bounds, spellings kvserve has used,
choices, sizes such as 2GiB). Every command that builds an engine adds them with
`add_engine_options`."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Collection
from typing import Any

from kvserve.cli.common import parse_bytes, positive
from kvserve.engine.engine_args import ATTENTION_BACKENDS, SCHEDULING_POLICIES, EngineArgs
from kvserve.kvcache.hashing import HASH_FUNCTIONS

_SPECIAL: dict[str, dict[str, Any]] = {
    **{
        name: {"type": positive}
        for name in (
            "block_size",
            "num_kv_blocks",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "num_threads",
        )
    },
    "kv_cache_memory": {"type": parse_bytes},
    "gpu_memory_utilization": {"metavar": "SHARE"},
    # vLLM spells it --no-enable-prefix-caching; kvserve has always said --no-prefix-caching.
    "enable_prefix_caching": {"flags": ("--no-prefix-caching", "--no-enable-prefix-caching")},
    "dtype": {"choices": ("auto", "float32", "bfloat16", "float16")},
    "quantization": {"choices": ("none", "int8", "int4", "gguf")},
    "attention_backend": {"choices": ATTENTION_BACKENDS},
    "scheduling_policy": {"choices": SCHEDULING_POLICIES},
    # `generate --seed` is the per-request sampling seed (SamplingParams.seed).
    "seed": {"flags": ("--engine-seed",), "dest": "engine_seed"},
    "hash_fn": {"flags": ("--hash", "--hash-fn"), "choices": sorted(HASH_FUNCTIONS)},
    "kv_events_config": {"type": str, "metavar": "JSON"},  # the engine parses the JSON
    "offload": {"metavar": "TIERS"},
    "speculative_config": {"type": str, "metavar": "JSON"},  # the engine parses the JSON
    "kv_transfer_config": {"type": str, "metavar": "JSON"},  # the engine parses the JSON
}


def engine_fields() -> tuple[dataclasses.Field, ...]:
    return dataclasses.fields(EngineArgs)


def dest_of(name: str) -> str:
    """The namespace attribute of field `name` (its own name unless another option has it)."""
    return _SPECIAL.get(name, {}).get("dest", name)


def field_help(name: str) -> str:
    """The help of field `name`, for a command that has an option of its own for it."""
    return next(f for f in engine_fields() if f.name == name).metadata["help"]


def add_engine_options(
    group: argparse._ActionsContainer, only: Collection[str] | None = None
) -> None:
    """Add an option for every `EngineArgs` field (or the fields in `only`) to `group`."""
    hints = typing.get_type_hints(EngineArgs)
    for field in engine_fields():
        if only is not None and field.name not in only:
            continue
        special = dict(_SPECIAL.get(field.name, {}))
        special.pop("flags", None)
        flags = _flags(field)
        try:
            text = field.metadata["help"]
        except KeyError:
            raise TypeError(f"EngineArgs.{field.name} has no metadata help") from None
        kwargs: dict[str, Any] = {"dest": dest_of(field.name), "default": field.default}
        kind = _base_type(hints[field.name])
        if kind is bool:
            kwargs["action"] = "store_false" if field.default else "store_true"
            text = f"{field.name}={not field.default} ({text})"
        else:
            kwargs["type"] = kind
        kwargs.update(special, help=text)
        if kwargs.get("type", bool) is Any:
            raise TypeError(f"EngineArgs.{field.name}: give its command-line type in _SPECIAL")
        group.add_argument(*flags, **kwargs)


def _flags(field: dataclasses.Field) -> tuple[str, ...]:
    """A field's flags; a bool's turns its default around: --x for False, --no-x for True."""
    flags = _SPECIAL.get(field.name, {}).get("flags")
    if flags:
        return flags
    dashed = field.name.replace("_", "-")
    if isinstance(field.default, bool):
        return (f"--no-{dashed}" if field.default else f"--{dashed}",)
    return (f"--{dashed}",)


def engine_argv(engine_args: EngineArgs) -> list[str]:
    """The options that give `engine_args` again (those off their defaults): how a parent
    hands its engine options on to child processes."""
    argv = []
    for field in engine_fields():
        value = getattr(engine_args, field.name)
        if value != field.default:
            flag = _flags(field)[0]
            argv.append(flag if isinstance(value, bool) else f"{flag}={value}")
    return argv


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    """The `EngineArgs` that options added by `add_engine_options` were parsed into."""
    return EngineArgs(**{f.name: getattr(args, dest_of(f.name)) for f in engine_fields()})


def _base_type(hint: Any) -> Any:
    """`int | None` -> int; a plain type stays itself (Any included)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        members = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if len(members) == 1:
            return members[0]
        return Any
    return hint
