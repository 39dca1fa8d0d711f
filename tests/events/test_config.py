"""`KVEventsConfig`: every key's value has its type, whether it comes as JSON or from Python."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvserve.events.config import KVEventsConfig

GOOD = {
    "enable_kv_cache_events": True,
    "publisher": "zmq",
    "endpoint": "tcp://*:5557",
    "replay_endpoint": "tcp://*:5558",
    "buffer_steps": 10,
    "hwm": 10,
    "max_queue_size": 10,
    "topic": "kv",
    "int_block_hashes": False,
    "data_parallel_rank": 1,
    "bind": True,
}
WRONG = {  # per kind of field, values of another type (JSON can spell each of them)
    bool: ["yes", 1, None],
    int: ["10", 1.5, True, None],
    str: [5, True, ["tcp://*:5557"]],
    "optional str": [5, False, {"a": 1}],
    "optional bool": ["yes", 1, "null"],
}
KIND = {
    "enable_kv_cache_events": bool,
    "int_block_hashes": bool,
    "buffer_steps": int,
    "hwm": int,
    "max_queue_size": int,
    "data_parallel_rank": int,
    "endpoint": str,
    "topic": str,
    "publisher": "optional str",
    "replay_endpoint": "optional str",
    "bind": "optional bool",
}


def test_every_key_is_covered_and_good_values_pass():
    assert set(KIND) == set(GOOD) == {f.name for f in dataclasses.fields(KVEventsConfig)}
    assert dataclasses.asdict(KVEventsConfig.from_any(json.dumps(GOOD))) == GOOD


@pytest.mark.parametrize(
    ("key", "value"), [(key, value) for key, kind in KIND.items() for value in WRONG[kind]]
)
def test_a_value_of_the_wrong_type_is_a_value_error_naming_its_key(key, value):
    config = {**GOOD, key: value}
    for given in (config, json.dumps(config)):
        with pytest.raises(ValueError, match=f"kv_events_config: {key} must be"):
            KVEventsConfig.from_any(given)


@pytest.mark.parametrize("text", ["[1, 2]", '"on"', "3", "null", "true"])
def test_json_that_is_not_an_object_is_a_value_error(text):
    with pytest.raises(ValueError, match="must be a JSON object"):
        KVEventsConfig.from_any(text)
