"""The engine options of the command line are `EngineArgs`, generated from the dataclass."""

from __future__ import annotations

import argparse
import dataclasses
import typing

import pytest

from kvserve.cli import build_parser, engine_options, main
from kvserve.cli.engine_options import add_engine_options, dest_of, engine_args_from
from kvserve.engine.engine_args import EngineArgs
from kvserve.kvcache.hashing import HASH_FUNCTIONS

FIELDS = dataclasses.fields(EngineArgs)
HINTS = typing.get_type_hints(EngineArgs)


def subparser(name: str) -> argparse.ArgumentParser:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def engine_actions() -> dict[str, argparse.Action]:
    """`generate`'s engine group, by destination."""
    group = next(g for g in subparser("generate")._action_groups if g.title.startswith("engine"))
    return {action.dest: action for action in group._group_actions}


def parse_engine_args(*argv: str) -> EngineArgs:
    return engine_args_from(subparser("generate").parse_args(list(argv)))


def test_generate_has_one_option_per_engine_field_and_no_other():
    # A new EngineArgs field gets its option (or, with a type the generator cannot turn
    # into one, every command fails to build): this set is the fields, nothing less or more.
    assert set(engine_actions()) == {dest_of(f.name) for f in FIELDS}
    assert set(engine_options._SPECIAL) <= {f.name for f in FIELDS}  # no stale special case


def test_names_defaults_and_help_come_from_the_dataclass():
    actions = engine_actions()
    for field in FIELDS:
        action = actions[dest_of(field.name)]
        dashed = field.name.replace("_", "-")
        assert any(flag.endswith(dashed) for flag in action.option_strings), field.name
        assert action.default == field.default, field.name
        assert field.metadata["help"] in action.help, field.name
    assert actions["block_size"].option_strings == ["--block-size"]
    assert parse_engine_args() == EngineArgs()


def test_types_come_from_the_dataclass():
    actions = engine_actions()
    for field in FIELDS:
        hint = HINTS[field.name]
        base = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
        action = actions[dest_of(field.name)]
        if base is bool:
            assert action.nargs == 0 and action.const is (not field.default), field.name
            continue
        # Values EngineArgs checks get one it accepts (3 is no device, nor a JSON object).
        sample = {"device": "cpu", "kv_events_config": "{}", "gpu_memory_utilization": "0.5",
                  "speculative_config": "{}",
                  "kv_transfer_config": '{"kv_role": "kv_producer"}'}  # fmt: skip
        sample = sample.get(field.name, "3")
        sample = action.choices[-1] if action.choices else sample
        value = getattr(parse_engine_args(action.option_strings[0], sample), field.name)
        assert isinstance(value, str if base is typing.Any else base), field.name


def test_every_existing_generate_flag_parses_as_before():
    events = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}'
    args = parse_engine_args(
        "--block-size", "8", "--num-kv-blocks", "100", "--kv-cache-memory", "2GiB",
        "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--max-model-len", "128",
        "--no-prefix-caching", "--dtype", "float32", "--device", "cpu",
        "--offload", "cpu:1GiB", "--kv-events-config", events,
    )  # fmt: skip
    assert args == EngineArgs(
        block_size=8, num_kv_blocks=100, kv_cache_memory=2 * 2**30, max_num_seqs=4,
        max_num_batched_tokens=64, max_model_len=128, enable_prefix_caching=False,
        dtype="float32", device="cpu", offload="cpu:1GiB", kv_events_config=events,
    )  # fmt: skip


def test_new_options_and_vllm_spellings():
    args = parse_engine_args(
        "--no-enable-prefix-caching", "--hash", "xxh3_128", "--hash-seed", "7",
        "--engine-seed", "5", "--num-threads", "2", "--seed", "9",
    )  # fmt: skip
    assert not args.enable_prefix_caching and args.hash_fn == "xxh3_128"
    assert (args.hash_seed, args.seed, args.num_threads) == (7, 5, 2)
    assert parse_engine_args("--hash-fn", "xxh3_128").hash_fn == "xxh3_128"
    assert parse_engine_args("--attention-backend", "flex").attention_backend == "flex"
    # --seed stays the per-request sampling seed, apart from the engine's.
    assert subparser("generate").parse_args(["--seed", "9"]).seed == 9


@pytest.mark.parametrize(
    "argv",
    [
        ["--block-size", "0"],
        ["--max-num-seqs", "-1"],
        ["--kv-cache-memory", "0"],
        ["--kv-cache-memory", "lots"],
        ["--dtype", "float8"],
        ["--hash", "md5"],
        ["--engine-seed", "x"],
        ["--attention-backend", "fast"],
    ],
)
def test_bad_values_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        subparser("generate").parse_args(argv)
    assert exit_info.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_generate_hands_the_engine_args_to_llm(monkeypatch, capsys):
    import kvserve.llm
    from kvserve.default_model import ResolvedModel

    seen = {}

    class FakeLLM:
        def __init__(self, model, **kwargs):
            seen.update(kwargs, model=model)
            self.model = ResolvedModel(model, model)

        def get_tokenizer(self):
            return object()  # text prompts are allowed

        def generate(self, prompts, params, use_tqdm, on_finished, lora_request=None):
            seen["sampling_seed"] = params.seed
            raise ValueError("stop here")

        def shutdown(self):
            seen["shut down"] = True

    monkeypatch.setattr(kvserve.llm, "LLM", FakeLLM)
    argv = ["generate", "--model", "m", "--prompt", "p", "--block-size", "4", "--seed", "3"]
    assert main([*argv, "--engine-seed", "11", "--no-prefix-caching", "--no-progress"]) == 2
    assert "stop here" in capsys.readouterr().err
    expected = dataclasses.asdict(EngineArgs(block_size=4, seed=11, enable_prefix_caching=False))
    assert seen == {**expected, "model": "m", "sampling_seed": 3, "shut down": True}


def test_a_subset_serves_commands_that_need_only_some_fields():
    parser = argparse.ArgumentParser()
    add_engine_options(parser, only=("block_size", "hash_fn"))
    assert vars(parser.parse_args(["--hash", "xxh3_128"])) == {
        "block_size": 16,
        "hash_fn": "xxh3_128",
    }


def test_a_field_the_generator_cannot_type_is_an_error(monkeypatch):
    @dataclasses.dataclass(kw_only=True)
    class Extended:
        block_size: int = dataclasses.field(default=16, metadata={"help": "tokens"})
        anything: typing.Any = dataclasses.field(default=None, metadata={"help": "?"})
        unhelped: int = 0

    monkeypatch.setattr(engine_options, "EngineArgs", Extended)
    with pytest.raises(TypeError, match="anything"):
        add_engine_options(argparse.ArgumentParser())
    with pytest.raises(TypeError, match="unhelped"):
        add_engine_options(argparse.ArgumentParser(), only=("unhelped",))


def test_engine_argv_gives_the_same_engine_args_again():
    # `serve --data-parallel-size` hands its engine options to its children this way.
    given = parse_engine_args(
        "--block-size", "4", "--no-prefix-caching", "--kv-cache-memory", "2MiB",
        "--hash", sorted(HASH_FUNCTIONS)[-1], "--engine-seed", "7",
        "--kv-events-config", '{"enable_kv_cache_events": true}',
    )  # fmt: skip
    argv = engine_options.engine_argv(given)
    assert len(argv) == 6
    assert parse_engine_args(*argv) == given
    assert engine_options.engine_argv(EngineArgs()) == []


def test_quantization_choices_are_the_model_rooms():
    from kvserve.model.quant.quantize import (
        QUANTIZATIONS,  # torch: imported here, not at parse time
    )

    action = engine_actions()["quantization"]
    assert tuple(action.choices) == QUANTIZATIONS and action.default == "none"
    assert parse_engine_args("--quantization", "int4").quantization == "int4"
