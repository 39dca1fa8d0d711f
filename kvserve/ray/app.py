"""`app`: the Ray Serve application builder (`serve run kvserve.ray:app model=... num_replicas=2`,
or `import_path: kvserve.ray:app` in a Serve config file).

Two deployments: `kvserve-engine`, the replicas (each one engine; replica.py), with the
kvserve request router (router.py) in its `request_router_config`, its `ray_actor_options`
and `autoscaling_config` as given; and `kvserve-ingress` in front (ingress.py), the route
Serve's proxy sends to, which holds the handle the router chooses for.
"""

from __future__ import annotations

from typing import Any, cast

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Deployment

from kvserve.ray.ingress import KVServeIngress
from kvserve.ray.options import SERVE_DEFAULT, RayOptions, ray_options
from kvserve.ray.replica import KVServeReplica

ENGINE = "kvserve-engine"
INGRESS = "kvserve-ingress"
ROUTER_CLASS = "kvserve.ray.router:KVServeRequestRouter"


def app(args: dict[str, Any]) -> Application:
    """The application for these arguments (ray_options: what each one means)."""
    return build_app(ray_options(args))


def build_app(options: RayOptions) -> Application:
    router: dict[str, Any] = {"request_routing_stats_period_s": options.routing_stats_period_s}
    if options.request_router != SERVE_DEFAULT:  # else Serve's default router, named by Serve
        router["request_router_class"] = ROUTER_CLASS
        router["request_router_kwargs"] = {"policy": options.policy}
    engine_options: dict[str, Any] = {
        "name": ENGINE,
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
    engine = _deployment(KVServeReplica).options(**engine_options)
    ingress = _deployment(KVServeIngress).options(
        name=INGRESS,
        num_replicas=options.ingress_replicas,
        ray_actor_options=options.ingress_ray_actor_options,
        max_ongoing_requests=max(options.max_ongoing_requests * 4, 256),
    )
    return ingress.bind(engine.bind(options.serve_argv), options.max_request_bytes)


def _deployment(cls: type) -> Deployment:
    """`serve.deployment` of a class (its stubs know only the decorator's other form)."""
    return cast(Deployment, serve.deployment(cls))
