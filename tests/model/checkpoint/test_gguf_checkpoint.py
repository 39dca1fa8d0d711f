"""A GGUF checkpoint wherever a checkpoint path goes: LLM, --model, a directory, the tiers' key.

The demo checkpoint (a Qwen3 with a byte-level BPE tokenizer and a chat
template) is written as a Q4_K_M-like GGUF file with its tokenizer in the
metadata, so the whole path of a real GGUF model runs: text in, chat
template, end-of-turn token, text out.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as T

from kvserve import LLM, SamplingParams
from kvserve.cli import main
from kvserve.model.checkpoint.tokenizer import load_tokenizer
from kvserve.model.demo import CHAT_TEMPLATE, ensure_demo_model
from kvserve.model.memory.kv_io import weights_digest
from tests.model.gguf_files import greedy, reference_model, tokenizer_metadata, write_gguf

QUESTION = [{"role": "user", "content": "Tell me about the river."}]


def q4_k_m(name: str) -> T:
    """llama.cpp's Q4_K_M mix, simplified: Q6_K for attn_v and ffn_down, Q4_K elsewhere."""
    return T.Q6_K if ".attn_v." in name or ".ffn_down." in name else T.Q4_K


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """(the GGUF file, transformers on its dequantized weights, the demo's HF directory)."""
    hf_dir = Path(ensure_demo_model(tmp_path_factory.mktemp("demo")))
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    path = tmp_path_factory.mktemp("gguf") / "demo-Q4_K_M.gguf"
    metadata = tokenizer_metadata(
        hf_dir / "tokenizer.json", "<|endoftext|>", "<|im_end|>", CHAT_TEMPLATE
    )
    state = write_gguf(model.eval(), path, q4_k_m, extra=metadata)
    return path, reference_model(model, state), hf_dir


def make_llm(path: Path) -> LLM:
    return LLM(str(path), block_size=4, num_kv_blocks=128, num_threads=1)


def test_text_in_text_out_with_the_files_tokenizer_and_chat_template(demo):
    path, oracle, hf_dir = demo
    llm = make_llm(path)
    tokenizer = llm.get_tokenizer()
    assert tokenizer.chat_template == CHAT_TEMPLATE
    reference = transformers.AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    text = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    ids = reference(text).input_ids
    assert tokenizer(text).input_ids == ids
    eos = {reference.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")}
    assert llm.engine.runner.eos_token_ids == eos  # eos and end-of-turn from the metadata
    (out,) = llm.generate([text], SamplingParams(temperature=0, max_tokens=12))
    expected = greedy(oracle, ids, 12)
    assert list(out.outputs[0].token_ids) == expected
    assert out.outputs[0].text == reference.decode(expected, skip_special_tokens=True)


def test_a_directory_holding_one_gguf_file_loads(demo, tmp_path):
    path, oracle, _ = demo
    folder = tmp_path / "folder"
    folder.mkdir()
    shutil.copy(path, folder / "renamed.gguf")
    llm = make_llm(folder)
    prompt = [5, 17, 300, 42, 7]
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert list(out.outputs[0].token_ids) == greedy_ignoring_eos(oracle, prompt, 8)
    # One file, one identity: the digest keys the offload tiers, whatever the path or name.
    assert weights_digest(folder) == weights_digest(path) == weights_digest(folder / "renamed.gguf")


def greedy_ignoring_eos(model, prompt: list[int], new: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=new, min_new_tokens=new
        )
    return out[0, len(prompt) :].tolist()


def test_other_weights_have_another_digest(demo, tmp_path):
    path, oracle, _ = demo
    other = tmp_path / "other.gguf"
    write_gguf(oracle, other, T.Q8_0)
    assert weights_digest(other) != weights_digest(path)


def test_tokenizer_files_next_to_the_file_win(demo, tmp_path):
    path, _, hf_dir = demo
    shutil.copy(path, tmp_path / "model.gguf")
    assert load_tokenizer(tmp_path / "model.gguf").chat_template == CHAT_TEMPLATE  # metadata
    # tokenizer_config.json alone: the file's tokenizer, the folder's chat template.
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ 'from the folder' }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_tokenizer(tmp_path / "model.gguf").chat_template == "{{ 'from the folder' }}"
    # tokenizer.json: the folder's tokenizer altogether.
    (tmp_path / "tokenizer.json").write_text(
        (hf_dir / "tokenizer.json").read_text().replace('"<|im_end|>"', '"<|im_stop|>"')
    )
    tokenizer = load_tokenizer(tmp_path / "model.gguf")
    assert "<|im_stop|>" in tokenizer.get_vocab() and "<|im_end|>" not in tokenizer.get_vocab()


def test_command_line_takes_a_gguf_file(demo, capsys):
    path, _, _ = demo
    assert main(["kv-metadata", "--model", str(path), "--block-size", "4"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert [g["kind"] for g in printed["groups"]] == ["full_attention"]
    argv = ["generate", "--model", str(path), "--prompt", "The river", "--max-tokens", "3"]
    assert main([*argv, "--no-progress", "--num-threads", "1", "--num-kv-blocks", "64"]) == 0
    assert "The river" in capsys.readouterr().out


def test_offload_tiers_are_keyed_by_the_file(demo):
    """The tiers' fingerprint hashes the .gguf file: a prefix dropped from the pool comes back."""
    path, oracle, _ = demo
    llm = LLM(str(path), block_size=4, num_kv_blocks=64, num_threads=1, offload="cpu:16MiB")
    prompt = list(range(20, 45))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = llm.generate([prompt], params)[0].outputs[0].token_ids
    assert llm.reset_prefix_cache()
    second = llm.generate([prompt], params)[0].outputs[0].token_ids
    llm.shutdown()
    assert llm.stats()["external_hit_tokens"] > 0
    assert list(first) == list(second) == greedy_ignoring_eos(oracle, prompt, 6)
