"""`kvserve generate` as a user runs it: a real process, real checkpoints."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from kvserve.cli.generate import DEMO_QUESTIONS, DEMO_SYSTEM


def run(args, tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "generate", "--no-progress", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_demo_model_by_name(tmp_path):
    proc = run(["--model", "demo:random", "--max-tokens", "5"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "RANDOM" in out and "demo" in out
    assert out.count("prompt: ") == 4
    assert "requests: 4" in out and "tok/s" in out and "prefix cache:" in out
    # The demo prompts share a system prompt: the summary shows hits.
    hits = int(out.split("prefix cache: ")[1].split()[0])
    assert hits > 0
    # Token-exact with transformers on the same (demo) checkpoint, through the tokenizer.
    demo = tmp_path / "cache" / "kvserve" / "demo-qwen3-v1"
    tokenizer = transformers.AutoTokenizer.from_pretrained(demo, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(demo, local_files_only=True)
    # The demo tokenizer has a chat template: the default questions are asked as a chat.
    conversation = [
        {"role": "system", "content": DEMO_SYSTEM.strip()},
        {"role": "user", "content": DEMO_QUESTIONS[0]},
    ]
    text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        ref = model.generate(ids, do_sample=False, max_new_tokens=5, pad_token_id=0)
    expected = tokenizer.decode(ref[0, ids.shape[1] :], skip_special_tokens=True)
    # Printed as each finishes: find the first question's completion by its prompt.
    first = out.split(f"prompt: {DEMO_QUESTIONS[0]!r}")[1].splitlines()[1].strip()
    assert ast.literal_eval(first.rsplit("  (", 1)[0]) == expected


def test_model_without_tokenizer_needs_token_ids(tmp_path, checkpoints):
    ck = checkpoints["qwen3"]
    proc = run(["--model", ck.path, "--prompt", "hello", "--max-tokens", "3"], tmp_path)
    # The tiny test checkpoints carry no tokenizer: a text prompt is a clear error.
    assert proc.returncode == 2
    assert "no tokenizer" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_options_are_clear_errors(tmp_path):
    proc = run(["--model", str(tmp_path / "missing"), "--max-tokens", "2"], tmp_path)
    assert proc.returncode == 2
    assert "missing" in proc.stderr and "Traceback" not in proc.stderr
    proc = run(["--temperature", "-1"], tmp_path)
    assert proc.returncode == 2 and "temperature" in proc.stderr


def test_cli_help_lists_every_subcommand():
    out = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "--help"], capture_output=True, text=True
    ).stdout
    assert "generate" in out and "simulate" in out


def _generate_matches_transformers(model, tmp_path, name):
    """`kvserve generate --model DIR` on `model` saved with the demo tokenizer: same text."""
    from kvserve.model.demo import ensure_demo_model

    demo = ensure_demo_model(cache_dir=tmp_path / "demo")
    path = tmp_path / name
    model.save_pretrained(path)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        (path / file).write_bytes((Path(demo) / file).read_bytes())
    text = "The capital of France is Paris, and the capital of Italy is"
    proc = run(["--model", str(path), "--prompt", text, "--max-tokens", "6"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = model.generate(ids, do_sample=False, max_new_tokens=6, pad_token_id=0)
    expected = tokenizer.decode(ref[0, ids.shape[1] :], skip_special_tokens=True)
    first = proc.stdout.split("prompt: ")[1].splitlines()[1].strip()
    assert ast.literal_eval(first.rsplit("  (", 1)[0]) == expected


@pytest.mark.slow
def test_generate_with_a_gemma3_checkpoint(tmp_path):
    """`kvserve generate --model DIR` on a Gemma 3 checkpoint (sliding-window groups)."""
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=2048,  # the demo tokenizer's
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        sliding_window=7,
        max_position_embeddings=512,
        attn_implementation="eager",
    )
    _generate_matches_transformers(transformers.Gemma3ForCausalLM(config).eval(), tmp_path, "g3")


@pytest.mark.slow
def test_generate_with_a_bamba_checkpoint(tmp_path):
    """`kvserve generate --model DIR` on a Mamba2 hybrid (state groups, inflated blocks)."""
    torch.manual_seed(0)
    config = transformers.BambaConfig(
        vocab_size=2048,  # the demo tokenizer's
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        attn_layer_indices=[2],
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_d_state=16,
        mamba_n_groups=1,
        mamba_chunk_size=8,
        max_position_embeddings=512,
    )
    _generate_matches_transformers(transformers.BambaForCausalLM(config).eval(), tmp_path, "bamba")


def test_kv_metadata_describes_the_engines_groups(gemma3_checkpoint, tmp_path):
    import json

    from kvserve import LLM
    from kvserve.kvcache.event_metadata import kv_events_metadata

    proc = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "kv-metadata", "--model", gemma3_checkpoint.path,
         "--block-size", "4", "--hash-seed", "7"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    printed = json.loads(proc.stdout)
    kinds = [g["kind"] for g in printed["groups"]]
    assert kinds.count("full_attention") == 1 and kinds.count("sliding_window") == 5
    assert {g["sliding_window"] for g in printed["groups"] if g["kind"] == "sliding_window"} == {7}
    assert printed["hash_seed"] == 7 and printed["hash_block_size"] == 4
    # The same as the metadata of a real engine on that checkpoint.
    llm = LLM(gemma3_checkpoint.path, block_size=4, num_kv_blocks=64, hash_seed=7, num_threads=1)
    assert json.loads(json.dumps(kv_events_metadata(llm.engine.manager))) == printed


@pytest.mark.slow
def test_quantized_engines_from_the_command_line(tmp_path):
    proc = run(["--model", "demo:random", "--quantization", "int4", "--max-tokens", "4"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "requests: 4" in proc.stdout
    # gguf keeps a GGUF file's blocks: the demo checkpoint is a Hugging Face directory.
    proc = run(["--model", "demo:random", "--quantization", "gguf", "--max-tokens", "4"], tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "quantization 'gguf' keeps a GGUF file's own blocks" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
