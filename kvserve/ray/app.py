"""`app`: the Ray Serve application builder (`serve run kvserve.ray:app model=... num_replicas=2`,
or `import_path: kvserve.ray:app` in a Serve config file).

Two deployments: `kvserve-engine`, the replicas (each one engine; replica.py), with the
kvserve request router (router.py) in its `request_router_config`, its `ray_actor_options`
and `autoscaling_config` as given; and `kvserve-ingress` in front (ingress.py), the route
Serve's proxy sends to, which holds the handle the router chooses for. With LoRA on,
`kvserve-adapters` (adapters.py): the run-time adapters every replica takes.

With `prefill` and `decode` sections (options.py): `kvserve-prefill` and `kvserve-decode`
in its place, each with the kvserve request router; the ingress runs each prompt on a
prefill replica first (split.py), then sends the request to a decode replica.
"""

from __future__ import annotations

from typing import Any, cast

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Deployment

from kvserve.ray.adapters import AdapterBook
from kvserve.ray.ingress import KVServeIngress
from kvserve.ray.options import SERVE_DEFAULT, RayOptions, parse_serve_argv, ray_options
from kvserve.ray.replica import KVServeReplica

ENGINE = "kvserve-engine"
PREFILL = "kvserve-prefill"
DECODE = "kvserve-decode"
INGRESS = "kvserve-ingress"
BOOK = "kvserve-adapters"
ROUTER_CLASS = "kvserve.ray.router:KVServeRequestRouter"


def app(args: dict[str, Any]) -> Application:
    """The application for these arguments (ray_options: what each one means)."""
    return build_app(ray_options(args))


def build_app(options: RayOptions) -> Application:
    ingress = _deployment(KVServeIngress).options(
        name=INGRESS,
        num_replicas=options.ingress_replicas,
        ray_actor_options=options.ingress_ray_actor_options,
        max_ongoing_requests=max(options.max_ongoing_requests * 4, 256),
    )
    book = _book(options)
    if options.prefill is None:
        engine = _engine(options, ENGINE).bind(options.serve_argv, "both", book)
        return ingress.bind(engine, options.max_request_bytes, book=book)
    decode = _engine(options, DECODE).bind(options.serve_argv, "decode", book)
    prefill = _engine(options.prefill, PREFILL).bind(
        options.prefill.serve_argv, "prefill", book, options.hold_seconds
    )
    split = (options.prefill_min_tokens, options.prefill_timeout)
    return ingress.bind(decode, options.max_request_bytes, prefill, *split, book=book)


def _book(options: RayOptions) -> Application | None:
    """The run-time adapters' book (adapters.py), where the replicas serve adapters."""
    sections = [options] if options.prefill is None else [options, options.prefill]
    if not any(_lora(section.serve_argv) for section in sections):
        return None
    book = _deployment(AdapterBook).options(
        name=BOOK, num_replicas=1, ray_actor_options={"num_cpus": 0}
    )
    return book.bind()


def _lora(serve_argv: list[str]) -> bool:
    args = parse_serve_argv(serve_argv)
    return bool(args.enable_lora or args.lora_modules)


def _engine(options: RayOptions, name: str) -> Deployment:
    """An engine deployment: kvserve replicas with kvserve's request router."""
    router: dict[str, Any] = {"request_routing_stats_period_s": options.routing_stats_period_s}
    if options.request_router != SERVE_DEFAULT:  # else Serve's default router, named by Serve
        router["request_router_class"] = ROUTER_CLASS
        router["request_router_kwargs"] = {"policy": options.policy}
    engine_options: dict[str, Any] = {
        "name": name,
        "ray_actor_options": options.ray_actor_options,
        "max_ongoing_requests": options.max_ongoing_requests,
        "request_router_config": RequestRouterConfig(**router),
    }
    if options.autoscaling_config is not None:
        engine_options["autoscaling_config"] = options.autoscaling_config
    if options.num_replicas is not None:
        engine_options["num_replicas"] = options.num_replicas
    if options.health_check_period_s is not None:
        engine_options["health_check_period_s"] = options.health_check_period_s
    return _deployment(KVServeReplica).options(**engine_options)


def _deployment(cls: type) -> Deployment:
    """`serve.deployment` of a class (its stubs know only the decorator's other form)."""
    return cast(Deployment, serve.deployment(cls))
