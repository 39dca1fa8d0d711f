"""The served adapters' table (serve/http/adapters.py) and `--lora-modules`' two forms,
without a server: names are unique (the base's too), bounded, and each load a new id."""

from __future__ import annotations

import pytest

from kvserve.lora.modules import AdapterModule, parse_lora_module
from kvserve.lora.registry import AdapterRegistry
from kvserve.lora.request import LoRARequest
from kvserve.serve.http.adapters import MAX_SERVED_ADAPTERS, ServedAdapters


def test_both_forms_of_lora_modules():
    assert parse_lora_module("sql=/a/b=c") == AdapterModule("sql", "/a/b=c")
    text = '{"name": "chat", "path": "/x", "base_model_name": "base"}'
    assert parse_lora_module(text) == AdapterModule("chat", "/x", "base")
    for bad, words in [
        ("no-equals", "NAME=DIR"),
        ("=dir", "NAME=DIR"),
        ("name=", "NAME=DIR"),
        ('{"name": "x"', "not JSON"),
        ('{"name": "x"}', "path"),
        ('{"name": "x", "path": "/p", "rank": 4}', "unknown keys"),
        ('{"name": "x", "path": "/p", "base_model_name": 3}', "base_model_name"),
    ]:
        with pytest.raises(ValueError, match=words):
            parse_lora_module(bad)


def test_names_are_unique_and_each_load_gets_a_new_id():
    table = ServedAdapters("base")
    first = table.reserve("a", "/a")
    with pytest.raises(ValueError, match="already served"):
        table.reserve("a", "/other")  # its load still runs
    with pytest.raises(ValueError, match="already served"):
        table.reserve("base", "/a")
    table.add(first, "lora-sha256:1")
    assert table.get("a") is not None and table.get("a").parent == "base"
    assert table.metadata() == [{"name": "a", "identity": "lora-sha256:1", "path": "/a"}]
    table.remove("a")
    again = table.reserve("a", "/a")
    assert again.lora_int_id != first.lora_int_id
    table.release("a")  # its load failed: the name is free
    assert table.names() == [] and table.reserve("a", "/a").lora_name == "a"


def test_at_most_so_many_adapters_are_served():
    table = ServedAdapters("base")
    for i in range(MAX_SERVED_ADAPTERS):
        table.add(table.reserve(f"a{i}", "/p"), "id")
    with pytest.raises(ValueError, match="unload one"):
        table.reserve("one-more", "/p")


def test_the_registry_forgets_an_unloaded_name(tmp_path):
    registry = AdapterRegistry(16, check=lambda adapter: None)
    (tmp_path / "adapter_config.json").write_text('{"r": 2, "target_modules": ["q_proj"]}')
    (tmp_path / "adapter_model.safetensors").write_bytes(b"weights")
    registry.resolve(LoRARequest("x", 1, str(tmp_path)))
    registry.resolve(LoRARequest("y", 2, str(tmp_path)))
    registry.forget("x")
    assert [key[0] for key in registry._known] == ["y"]
