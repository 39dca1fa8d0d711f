"""The application builder's arguments, and the README's Serve config file, without a cluster:
what `serve run kvserve.ray:app ...` and `serve deploy config.yaml` would deploy."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from kvserve.ray import app
from kvserve.ray.options import ray_options
from kvserve.ray.replica import transfer_role

pytest.importorskip("ray")
README = Path(__file__).resolve().parents[2] / "README.md"
SEVERAL = README.parent / "docs" / "several-engines.md"


def deployments(application):
    """(ingress, engine) deployments of a built application."""
    ingress = application._bound_deployment
    return ingress, ingress.init_args[0]._bound_deployment


def test_the_readme_config_file_validates_and_builds():
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve.schema import ServeDeploySchema

    block = re.search(r"```yaml\n(applications:.*?)```", README.read_text(), re.S)
    assert block is not None
    config = ServeDeploySchema.model_validate(yaml.safe_load(block.group(1)))
    (entry,) = config.applications
    assert entry.import_path == "kvserve.ray:app"
    built = call_user_app_builder_with_args_if_necessary(app, entry.args)
    _, engine = deployments(built)
    assert engine.num_replicas == 4
    assert engine.ray_actor_options == {"num_cpus": 4, "num_gpus": 1}
    router = engine._deployment_config.request_router_config
    assert router.request_router_class == "kvserve.ray.router:KVServeRequestRouter"
    assert "--max-num-seqs=64" in engine.init_args[0]
    assert "--gpu-memory-utilization=0.85" in engine.init_args[0]


def test_every_engine_option_by_name_and_deployment_options_pass_through():
    autoscaling = {"min_replicas": 1, "max_replicas": 3}
    built = app(
        {
            "model": "demo:random",
            "autoscaling_config": autoscaling,
            "ray_actor_options": '{"num_cpus": 2}',
            "enable_prefix_caching": "false",
            "kv_cache_memory": "64MiB",
            "request_router": "serve-default",
            "health_check_period_s": "2.5",
        }
    )
    _, engine = deployments(built)
    argv = engine.init_args[0]
    assert "--no-prefix-caching" in argv and "--kv-cache-memory=64MiB" in argv
    assert engine.ray_actor_options == {"num_cpus": 2}
    assert engine._deployment_config.autoscaling_config.max_replicas == 3
    assert engine._deployment_config.health_check_period_s == 2.5
    router = engine._deployment_config.request_router_config
    assert "PowerOfTwoChoices" in router.request_router_class  # Serve's default, unnamed


@pytest.mark.parametrize(
    ("args", "named"),
    [
        ({"max_num_seqs": "many"}, "--max-num-seqs"),
        ({"port": 9000}, "port"),
        ({"no_such_option": 1}, "no_such_option"),
        ({"enable_prefix_caching": "maybe"}, "enable_prefix_caching"),
        ({"num_replicas": 2, "autoscaling_config": {"max_replicas": 2}}, "autoscaling_config"),
        ({"policy": "random"}, "policy"),
        ({"ray_actor_options": "{num_cpus"}, "ray_actor_options"),
        ({"health_check_period_s": "0"}, "health_check_period_s"),
    ],
)
def test_a_bad_argument_is_a_value_error_naming_it(args, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        ray_options(args)


def test_lora_modules_reach_the_replica_as_serve_reads_them(tmp_path):
    """A list of adapters (a Serve config's YAML list) becomes `--lora-modules A B`, which a
    replica reads as `kvserve serve` does: each adapter checked, --enable-lora turned on."""
    from kvserve.cli.engine_options import engine_args_from
    from kvserve.ray.options import parse_serve_argv
    from kvserve.serve.build import lora_options

    adapter = tmp_path / "a"
    adapter.mkdir()
    config = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    modules = [f"sql={adapter}", {"name": "chat", "path": str(adapter)}]
    built = app({"model": "demo:random", "lora_modules": modules})
    _, engine = deployments(built)
    argv = engine.init_args[0]
    args = parse_serve_argv(argv)
    engine_args = engine_args_from(args)
    lora_options(args, engine_args)
    assert [m.name for m in args.lora_modules] == ["sql", "chat"]
    assert engine_args.enable_lora
    # Checked where the replica runs (the paths are the replica's node's), not by the builder.
    bad = parse_serve_argv(["--lora-modules", f"x={tmp_path / 'none'}"])
    with pytest.raises(ValueError, match="lora-modules"):
        lora_options(bad, engine_args_from(bad))


def test_the_split_config_file_of_the_docs_validates_and_builds():
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve.schema import ServeDeploySchema

    block = re.search(r"```yaml\n(applications:\n  - name: kvserve-split.*?)```",
                      SEVERAL.read_text(), re.S)  # fmt: skip
    assert block is not None
    config = ServeDeploySchema.model_validate(yaml.safe_load(block.group(1)))
    (entry,) = config.applications
    built = call_user_app_builder_with_args_if_necessary(app, entry.args)
    _, decode = deployments(built)
    prefill = built._bound_deployment.init_args[2]._bound_deployment
    assert (prefill.num_replicas, decode.num_replicas) == (1, 2)
    assert "--offload=cpu:4GiB" in prefill.init_args[0]
    assert prefill.ray_actor_options == {"num_cpus": 4, "num_gpus": 1}


def test_prefill_and_decode_sections_build_two_engine_deployments():
    """`prefill`/`decode` (a Serve config's mappings, or JSON on `serve run`'s command line)
    over the common arguments: each its own deployment and role, the split's threshold."""
    built = app({"model": "demo:random", "max_num_seqs": 8, "prefill_min_tokens": "64",
                 "prefill_timeout": "2.5", "hold_seconds": 90,
                 "prefill": '{"num_replicas": 2, "offload": "cpu:64MiB"}',
                 "decode": {"num_replicas": 3, "max_num_seqs": 16}})  # fmt: skip
    _, _, prefill_app, min_tokens, timeout = built._bound_deployment.init_args
    assert (min_tokens, timeout) == (64, 2.5)
    _, decode = deployments(built)
    prefill = prefill_app._bound_deployment
    assert (decode.name, prefill.name) == ("kvserve-decode", "kvserve-prefill")
    assert (decode.num_replicas, prefill.num_replicas) == (3, 2)
    decode_argv, role, book = decode.init_args
    assert role == "decode" and "--max-num-seqs=16" in decode_argv
    prefill_argv, role, book, hold_seconds = prefill.init_args
    assert role == "prefill" and "--max-num-seqs=8" in prefill_argv
    assert hold_seconds == 90
    assert json.loads(transfer_role(role, "10.0.0.7", hold_seconds)) == {
        "kv_role": "kv_producer", "kv_ip": "10.0.0.7", "kv_port": 0,
        "kv_connector_extra_config": {"hold_seconds": 90},
    }  # fmt: skip
    assert "--offload=cpu:64MiB" in prefill_argv
    assert book is None  # no LoRA: no adapter book


def test_with_lora_one_adapter_book_is_bound_to_the_engines_and_the_ingress():
    """The run-time adapters' book (kvserve.ray.adapters): one replica, no CPU, the same
    one handed to every engine deployment and to the ingress."""
    built = app({"model": "demo:random", "enable_lora": True,
                 "prefill": {"num_replicas": 1, "offload": "cpu:64MiB"},
                 "decode": {"num_replicas": 2}})  # fmt: skip
    ingress, decode = deployments(built)
    prefill = ingress.init_args[2]._bound_deployment
    book = ingress.init_kwargs["book"]
    assert decode.init_args[2] is book and prefill.init_args[2] is book
    assert book._bound_deployment.name == "kvserve-adapters"
    assert book._bound_deployment.num_replicas == 1
    assert book._bound_deployment.ray_actor_options["num_cpus"] == 0


@pytest.mark.parametrize(
    ("args", "named"),
    [
        ({"decode": {}}, "decode without prefill"),
        ({"prefill": {"offload": "cpu:64MiB"}}, "prefill without decode"),
        ({"prefill": {}, "decode": {}}, "offload cpu:SIZE"),
        ({"prefill": {"offload": "disk:/tmp/x:1GiB"}, "decode": {}}, "offload cpu:SIZE"),
        ({"prefill": {"offload": "cpu:64MiB", "block_size": 32}, "decode": {}}, "block_size"),
        ({"prefill": {"offload": "cpu:64MiB"}, "decode": {"kv_transfer_config": "{}"}},
         "kv_transfer_config"),
        ({"prefill": {"offload": "cpu:64MiB", "ingress_replicas": 2}, "decode": {}},
         "prefill.ingress_replicas"),
        ({"prefill": {"offload": "cpu:64MiB"}, "decode": {}, "request_router": "serve-default"},
         "serve-default"),
        ({"prefill": "[1]", "decode": {}}, "prefill must be a mapping"),
        ({"prefill_min_tokens": 8}, "only with prefill and decode"),
        ({"prefill": {"offload": "cpu:64MiB"}, "decode": {}, "prefill_min_tokens": -1},
         "prefill_min_tokens"),
        ({"prefill_timeout": 5}, "prefill_timeout: only with prefill and decode"),
        ({"prefill": {"offload": "cpu:64MiB"}, "decode": {}, "prefill_timeout": 0},
         "prefill_timeout must be in (0, 3600]"),
        ({"prefill": {"offload": "cpu:64MiB"}, "decode": {}, "prefill_timeout": "soon"},
         "prefill_timeout must be a number"),
        ({"prefill": {"offload": "cpu:64MiB"}, "decode": {}, "hold_seconds": -1},
         "hold_seconds must be a number from 0 to 3600"),
        ({"prefill": {"offload": "cpu:64MiB", "hold_seconds": 5}, "decode": {}},
         "prefill.hold_seconds: an argument of the whole application"),
    ],
)  # fmt: skip
def test_a_wrong_split_is_refused_when_built(args, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        app({"model": "demo:random", **args})
