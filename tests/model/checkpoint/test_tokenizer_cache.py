"""A GGUF file's tokenizer is converted once, then loaded from the cache, and behaves the same.

The file is the demo checkpoint written as GGUF with its byte-level BPE
tokenizer and chat template in the metadata (as test_gguf_checkpoint's);
each test has its own cache root ($XDG_CACHE_HOME).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader

from kvserve.model.checkpoint import tokenizer_cache
from kvserve.model.checkpoint.gguf_file import open_gguf
from kvserve.model.checkpoint.tokenizer import load_tokenizer
from kvserve.model.demo import CHAT_TEMPLATE, ensure_demo_model
from tests.model.gguf_files import tokenizer_metadata, write_gguf

TEXTS = ["hello", " the river  runs\n\tdown", "<|im_start|>user\nhi<|im_end|>", "", "日本 🙂 é"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why? <|im_end|>"}]


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    hf_dir = Path(ensure_demo_model(tmp_path_factory.mktemp("demo")))
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    path = tmp_path_factory.mktemp("gguf") / "demo-Q8_0.gguf"
    metadata = tokenizer_metadata(
        hf_dir / "tokenizer.json", "<|endoftext|>", "<|im_end|>", CHAT_TEMPLATE
    )
    write_gguf(model.eval(), path, lambda name: T.Q8_0, extra=metadata)
    return path


@pytest.fixture
def cache_root(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "kvserve" / "tokenizers"


def converted(path: Path):
    """What transformers builds from the file, without the cache."""
    return transformers.AutoTokenizer.from_pretrained(
        str(path.parent), gguf_file=path.name, local_files_only=True
    )


def assert_same_behaviour(tokenizer, reference) -> None:
    assert type(tokenizer) is type(reference)
    assert tokenizer.get_vocab() == reference.get_vocab()
    assert tokenizer.special_tokens_map == reference.special_tokens_map
    assert tokenizer.all_special_ids == reference.all_special_ids
    assert tokenizer.chat_template == reference.chat_template == CHAT_TEMPLATE
    for text in TEXTS:
        for special in (True, False):
            ids = reference(text, add_special_tokens=special).input_ids
            assert tokenizer(text, add_special_tokens=special).input_ids == ids, text
            for skip in (True, False):
                assert tokenizer.decode(ids, skip_special_tokens=skip) == reference.decode(
                    ids, skip_special_tokens=skip
                )
    rendered = reference.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False) == (
        rendered
    )


def test_the_second_load_comes_from_the_cache_and_behaves_the_same(gguf_file, cache_root):
    first = load_tokenizer(gguf_file)
    [saved] = cache_root.iterdir()
    assert saved == tokenizer_cache.tokenizer_dir(gguf_file)
    second = load_tokenizer(gguf_file)
    assert Path(second.name_or_path) == saved  # loaded from the saved directory
    assert Path(first.name_or_path) != saved  # converted from the file
    reference = converted(gguf_file)
    assert_same_behaviour(first, reference)
    assert_same_behaviour(second, reference)


def test_a_changed_file_is_converted_again(gguf_file, cache_root):
    load_tokenizer(gguf_file)
    stat = gguf_file.stat()
    os.utime(gguf_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    try:
        tokenizer = load_tokenizer(gguf_file)
        assert Path(tokenizer.name_or_path) != tokenizer_cache.tokenizer_dir(gguf_file)
        assert len(list(cache_root.iterdir())) == 2
    finally:
        os.utime(gguf_file, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_a_damaged_saved_tokenizer_is_converted_again(gguf_file, cache_root, caplog):
    load_tokenizer(gguf_file)
    saved = tokenizer_cache.tokenizer_dir(gguf_file)
    (saved / "tokenizer.json").write_text("{ not json")
    with caplog.at_level(logging.WARNING):
        tokenizer = load_tokenizer(gguf_file)
    assert "converting demo-Q8_0.gguf's tokenizer again" in caplog.text
    assert_same_behaviour(tokenizer, converted(gguf_file))
    assert Path(load_tokenizer(gguf_file).name_or_path) == saved  # saved again, whole


def test_a_cache_that_cannot_be_written_costs_only_the_conversion(gguf_file, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # mkdir under a file fails
    assert_same_behaviour(load_tokenizer(gguf_file), converted(gguf_file))


def test_the_newest_tokenizers_are_kept_by_count_and_bytes(gguf_file, cache_root, monkeypatch):
    monkeypatch.setattr(tokenizer_cache, "KEPT", 2)
    cache_root.mkdir(parents=True)
    for age, name in enumerate(["old", "older", "oldest"]):
        (cache_root / name).mkdir()
        os.utime(cache_root / name, (1_000_000 - age, 1_000_000 - age))
    load_tokenizer(gguf_file)
    newest = tokenizer_cache.tokenizer_dir(gguf_file)
    assert sorted(p.name for p in cache_root.iterdir()) == sorted(["old", newest.name])
    size = sum(f.stat().st_size for f in newest.rglob("*") if f.is_file())
    (cache_root / "old" / "big").write_bytes(b"x" * 1000)
    os.utime(cache_root / "old", (1_000_000, 1_000_000))  # still the older one
    monkeypatch.setattr(tokenizer_cache, "KEPT_BYTES", size + 999)  # the newest, not both
    tokenizer_cache.prune(cache_root)
    assert [p.name for p in cache_root.iterdir()] == [newest.name]
    monkeypatch.setattr(tokenizer_cache, "KEPT_BYTES", 1)  # the newest is always kept
    tokenizer_cache.prune(cache_root)
    assert [p.name for p in cache_root.iterdir()] == [newest.name]


def test_the_mapped_reader_reads_what_gguf_pys_reader_reads(gguf_file):
    ours, reference = open_gguf(gguf_file), GGUFReader(gguf_file)
    assert list(ours.fields) == list(reference.fields)
    for key, theirs in reference.fields.items():
        mine = ours.fields[key]
        assert (mine.offset, mine.types, mine.data) == (theirs.offset, theirs.types, theirs.data)
        assert len(mine.parts) == len(theirs.parts)
        for a, b in zip(mine.parts, theirs.parts, strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b)
        assert mine.contents() == theirs.contents()
    assert ours.data_offset == reference.data_offset
    for a, b in zip(ours.tensors, reference.tensors, strict=True):
        assert (a.name, a.tensor_type, a.data_offset) == (b.name, b.tensor_type, b.data_offset)
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data)
        assert np.shares_memory(a.data, ours.data)  # a view of the mapping, not a copy
