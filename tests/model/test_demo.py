"""The built-in demo checkpoint: deterministic, loadable by us and by transformers, races safely."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer

from kvserve.model import ModelRunner
from kvserve.model.demo import DEMO_NAME, ensure_demo_model
from tests.model.model_driver import generate


@pytest.fixture(scope="module")
def demo_dirs(tmp_path_factory) -> tuple[Path, Path]:
    a = Path(ensure_demo_model(tmp_path_factory.mktemp("a")))
    b = Path(ensure_demo_model(tmp_path_factory.mktemp("b")))
    return a, b


def test_created_deterministically(demo_dirs):
    a, b = demo_dirs
    assert a.name == b.name == DEMO_NAME
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_second_call_reuses_the_directory(demo_dirs):
    a, _ = demo_dirs
    stamp = (a / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_model(a.parent) == str(a)
    assert (a / "model.safetensors").stat().st_mtime_ns == stamp


def test_default_location_follows_xdg_cache_home(tmp_path, monkeypatch, demo_dirs):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    (tmp_path / "kvserve").mkdir()
    # Pre-seed the cache with the already built copy: only the path logic is under test.
    (tmp_path / "kvserve" / DEMO_NAME).symlink_to(demo_dirs[0])
    assert ensure_demo_model() == str(tmp_path / "kvserve" / DEMO_NAME)


def test_racing_creators_agree(tmp_path):
    with ThreadPoolExecutor(2) as pool:
        paths = list(pool.map(lambda _: ensure_demo_model(tmp_path), range(2)))
    assert paths[0] == paths[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == [DEMO_NAME]  # no temp dirs left


def test_tokenizer_loads_offline_both_ways(demo_dirs):
    path = demo_dirs[0]
    fast = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert 2000 <= fast.get_vocab_size() <= 4096
    text = "The cache is small, fast and exactly right."
    assert fast.decode(fast.encode(text).ids) == text
    auto = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    assert auto.encode(text) == fast.encode(text).ids
    chat = auto.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "<|im_start|>user" in chat


def test_loads_generates_and_matches_transformers(demo_dirs):
    path = demo_dirs[0]
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    runner = ModelRunner(path, block_size=16, num_blocks=16, num_threads=1)
    assert runner.eos_token_ids == {
        runner.tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        runner.tokenizer.convert_tokens_to_ids("<|im_end|>"),
    }
    prompt = runner.tokenizer.encode("The capital of France is")
    (ours,) = generate(runner, [prompt], 12)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    params = sum(p.numel() for p in hf.parameters())
    assert 1_000_000 < params < 10_000_000
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12)
    reference = out[0, len(prompt) :].tolist()
    assert ours == reference[: len(ours)]
    assert len(ours) == len(reference)
    assert runner.tokenizer.decode(ours)
