"""The builder's arguments: Serve's deployment options, and `kvserve serve`'s own for each
replica's engine and server.

`serve run kvserve.ray:app model=... num_replicas=2 max_num_seqs=8` hands the builder
strings; a config file's `args:` hands it YAML values. Everything that is not a deployment
option is parsed by `kvserve serve`'s own argument parser (each key the option's name:
`max_num_seqs`, `kv_cache_memory`, `enable_prefix_caching`), so every engine option is there,
checked and converted exactly as on the command line, and a bad one is a ValueError that
names it before any replica starts.

Prefill on one replica, decode on another: a `prefill` and a `decode` section (mappings,
or their JSON on `serve run`'s command line), each the builder's arguments for that
deployment over the common ones. The split's own (SPLIT_ARGS): `prefill_min_tokens`
(256), `prefill_timeout` (30 s: a prefill replica that has not answered by then is left,
and the decode replica computes the prompt, as `kvserve route --prefill-timeout`) and
`hold_seconds` (30: how long a prefill replica keeps a prompt's blocks for the decode
replica's pull, kv_transfer_config's). The builder gives each its KV transfer role
(replica.py); a prefill section must keep its blocks in a CPU tier (`offload: cpu:SIZE`).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from typing import Any, NoReturn

from kvserve.cli import serve as serve_cli
from kvserve.routing.policy import POLICIES
from kvserve.transfer.config import KVTransferConfig
from kvserve.transfer.engine_side import transfer_config

SERVE_DEFAULT = "serve-default"
"""`request_router=serve-default`: Ray Serve's own Power-of-Two router (for comparisons)."""
ROUTERS = ("kvserve", SERVE_DEFAULT)
NOT_HERE = {
    "host": "Serve's proxy listens (http_options in the config, or `serve start`)",
    "port": "Serve's proxy listens (http_options in the config, or `serve start`)",
    "data_parallel_size": "use num_replicas: Serve runs the replicas",
    "log_level": "Ray's logging_config sets it",
}
SECTIONS = ("prefill", "decode")
APP_WIDE = ("request_router", "ingress_replicas", "ingress_ray_actor_options")
"""Arguments of the whole application, never of a prefill or decode section."""
SPLIT_ARGS = ("prefill_min_tokens", "prefill_timeout", "hold_seconds")
"""Arguments of the prefill/decode split (of the whole application, as APP_WIDE)."""
MAX_PREFILL_TIMEOUT = 3600.0
SAME_ON_BOTH = ("model", "dtype", "block_size", "hash_fn", "hash_seed", "quantization")
"""What the blocks' fingerprint is made of: a decode replica pulls only blocks that fit."""


@dataclass(slots=True)
class RayOptions:
    """What the builder makes of its arguments (plain data: it travels to the replicas)."""

    serve_argv: list[str]
    """`kvserve serve`'s options for every replica (parsed again there, the same way)."""
    num_replicas: int | str | None = 1
    """A number, "auto", or None with an autoscaling_config."""
    autoscaling_config: dict[str, Any] | None = None
    ray_actor_options: dict[str, Any] = field(default_factory=dict)
    """Each replica's resources: num_cpus, num_gpus (one replica per GPU: num_gpus 1), ..."""
    max_ongoing_requests: int = 64
    """Requests a replica takes at once (Serve's admission; its engine batches them)."""
    request_router: str = "kvserve"
    policy: str = "cache-aware"
    """kvserve's routing policy (kvserve.routing) inside the kvserve request router."""
    routing_stats_period_s: float = 1.0
    """How often Serve asks each replica where its KV events are (a replica restarted
    is followed within about this long)."""
    health_check_period_s: float | None = None
    """How often Serve checks each replica (Serve's default: 10 s); a replica whose actor
    died is found, and replaced, at its next check."""
    ingress_replicas: int = 1
    ingress_ray_actor_options: dict[str, Any] = field(default_factory=lambda: {"num_cpus": 0})
    max_request_bytes: int = 0
    """The replicas' --max-request-bytes: the ingress reads no more of a body."""
    prefill: RayOptions | None = None
    """The prefill deployment's options: these are then the decode deployment's."""
    prefill_min_tokens: int = 256
    """A prompt with fewer tokens uncached on the best decode replica skips the prefill."""
    prefill_timeout: float = 30.0
    """Seconds the ingress waits for a prefill replica's answer (then decode computes)."""
    hold_seconds: float = 30.0
    """Seconds a prefill replica keeps a prompt's blocks unless pulled sooner."""


def ray_options(args: dict[str, Any]) -> RayOptions:
    """ValueError naming the argument that is wrong."""
    args = dict(args)
    sections = {name: _section(name, args.pop(name)) for name in SECTIONS if name in args}
    split = {name: args.pop(name) for name in SPLIT_ARGS if name in args}
    if not sections:
        if split:
            raise ValueError(f"{next(iter(split))}: only with prefill and decode sections")
        return _options(args)
    if len(sections) != 2:
        (given,) = sections
        missing = next(n for n in SECTIONS if n != given)
        raise ValueError(
            f"{given} without {missing}: prefill and decode go together (prefill on one "
            "replica, decode on another)"
        )
    for key in [k for section in (args, *sections.values()) for k in section]:
        if key.replace("-", "_") == "kv_transfer_config":
            raise ValueError(
                "kv_transfer_config: the builder gives each section its role (prefill: "
                "kv_producer, decode: kv_consumer of the prefill replicas)"
            )
    decode = _options({**args, **sections["decode"]})
    prefill = _options({**args, **sections["prefill"]})
    if decode.request_router == SERVE_DEFAULT:
        raise ValueError(
            "request_router serve-default: the prefill/decode split needs kvserve's router "
            "(its predictions choose the prefill replica and skip short prompts)"
        )
    _check_split(parse_serve_argv(prefill.serve_argv), parse_serve_argv(decode.serve_argv))
    decode.prefill = prefill
    _split_args(decode, split)
    return decode


def _split_args(decode: RayOptions, split: dict[str, Any]) -> None:
    """The split's own arguments onto the decode options, each checked by name."""
    if "prefill_min_tokens" in split:
        value = split["prefill_min_tokens"]
        decode.prefill_min_tokens = int(_number("prefill_min_tokens", value, integer=True))
        if decode.prefill_min_tokens < 0:
            raise ValueError(f"prefill_min_tokens must be >= 0, got {value!r}")
    if "prefill_timeout" in split:
        decode.prefill_timeout = _number("prefill_timeout", split["prefill_timeout"])
        if not 0 < decode.prefill_timeout <= MAX_PREFILL_TIMEOUT:
            raise ValueError(
                f"prefill_timeout must be in (0, {MAX_PREFILL_TIMEOUT:g}] seconds, "
                f"got {split['prefill_timeout']!r}"
            )
    if "hold_seconds" in split:
        decode.hold_seconds = _number("hold_seconds", split["hold_seconds"])
        try:  # kv_transfer_config's own check, with its bounds
            KVTransferConfig.from_any(
                {"kv_role": "kv_producer", "kv_connector_extra_config":
                 {"hold_seconds": decode.hold_seconds}}
            )  # fmt: skip
        except ValueError as exc:
            raise ValueError(str(exc).removeprefix("kv_transfer_config: ")) from None


def _number(name: str, value: Any, integer: bool = False) -> float:
    """A number from YAML or from `serve run`'s strings (ValueError naming the argument)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return float(int(value)) if integer else float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None


def _section(name: str, value: Any) -> dict[str, Any]:
    section = _deployment_value(name, value)
    for key in section:
        if key in SECTIONS or key in APP_WIDE or key in SPLIT_ARGS:
            raise ValueError(f"{name}.{key}: an argument of the whole application, not of {name}")
    return dict(section)


def _check_split(prefill: argparse.Namespace, decode: argparse.Namespace) -> None:
    for key in SAME_ON_BOTH:
        if getattr(prefill, key, None) != getattr(decode, key, None):
            raise ValueError(
                f"prefill and decode differ in {key}: a decode replica pulls only blocks "
                "computed by the same model, dtype, block size and hashing"
            )
    try:
        transfer_config(argparse.Namespace(
            kv_transfer_config={"kv_role": "kv_producer"}, offload=prefill.offload
        ))  # fmt: skip
    except ValueError as exc:
        raise ValueError(f"prefill: {exc}") from None


def _options(args: dict[str, Any]) -> RayOptions:
    options = RayOptions(serve_argv=[])
    replicas_given = "num_replicas" in args
    for name in (
        "num_replicas", "autoscaling_config", "ray_actor_options", "max_ongoing_requests",
        "request_router", "policy", "routing_stats_period_s", "health_check_period_s",
        "ingress_replicas", "ingress_ray_actor_options",
    ):  # fmt: skip
        if name in args:
            setattr(options, name, _deployment_value(name, args.pop(name)))
    if options.request_router not in ROUTERS:
        raise ValueError(
            f"request_router {options.request_router!r}: choose one of {', '.join(ROUTERS)}"
        )
    if options.policy not in POLICIES:
        raise ValueError(f"policy {options.policy!r}: choose one of {', '.join(POLICIES)}")
    if options.autoscaling_config is not None:
        if replicas_given and options.num_replicas != "auto":
            raise ValueError("num_replicas and autoscaling_config: give one (or num_replicas=auto)")
        if not replicas_given:
            options.num_replicas = None
    options.serve_argv = serve_argv(args)
    options.max_request_bytes = parse_serve_argv(options.serve_argv).max_request_bytes
    return options


def _deployment_value(name: str, value: Any) -> Any:
    if name in ("autoscaling_config", "ray_actor_options", "ingress_ray_actor_options", *SECTIONS):
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{name} must be a JSON object: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"{name} must be a mapping, got {type(value).__name__}")
        return value
    if name in ("request_router", "policy"):
        return str(value)
    if name == "num_replicas" and value == "auto":
        return value
    try:
        number = float(value) if name.endswith("_period_s") else int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if number <= 0 and name != "ingress_replicas":
        raise ValueError(f"{name} must be positive, got {value!r}")
    return number


class _Refusal(argparse.ArgumentParser):
    """`kvserve serve`'s parser, whose complaints are ValueErrors (a builder must not exit)."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(f"kvserve.ray: {message}")


def _serve_parser() -> argparse.ArgumentParser:
    parser = _Refusal(prog="kvserve.ray")
    serve_cli.add_parser(parser.add_subparsers(dest="command"))
    return parser


def _serve_actions() -> dict[str, argparse.Action]:
    sub = next(a for a in _serve_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a for a in sub.choices["serve"]._actions if a.option_strings}


def serve_argv(args: dict[str, Any]) -> list[str]:
    """The builder's other arguments as `kvserve serve` options (checked by parsing them)."""
    actions = _serve_actions()
    argv: list[str] = []
    for key, value in args.items():
        name = key.replace("-", "_")
        if name in NOT_HERE:
            raise ValueError(f"{key}: not an option here ({NOT_HERE[name]})")
        action = actions.get(name) or next(
            (a for a in actions.values() if f"--{key.replace('_', '-')}" in a.option_strings),
            None,
        )
        if action is None or name == "help":
            raise ValueError(
                f"unknown argument {key!r}: not a deployment or `kvserve serve` option"
            )
        flag = action.option_strings[0]
        if action.nargs == 0:  # a flag: it says true or false itself
            wanted = _boolean(key, value)
            if wanted == action.const:
                argv.append(flag)
            elif wanted != action.default:
                raise ValueError(f"{key}: {value!r} cannot be said with {flag}")
            continue
        if isinstance(value, list) and action.nargs in ("+", "*"):  # --lora-modules A=x B=y
            argv += [flag, *(json.dumps(v) if isinstance(v, dict) else str(v) for v in value)]
            continue
        text = json.dumps(value) if isinstance(value, dict | list) else str(value)
        argv.append(f"{flag}={text}")
    parse_serve_argv(argv)
    return argv


def parse_serve_argv(argv: list[str]) -> argparse.Namespace:
    return _serve_parser().parse_args(["serve", *argv])


def _boolean(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"{key} must be true or false, got {value!r}")
