"""LLM.chat and the default model's resolution, on the demo checkpoint (it has a ChatML
template and random weights: what matters is which tokens the engine is given)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import transformers

from kvserve import LLM, SamplingParams
from kvserve.default_model import DEMO_MODEL, INSTALL_DEFAULT, default_model_path, resolve_model
from kvserve.model.demo import ensure_demo_model

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SYSTEM = {"role": "system", "content": "You answer briefly."}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return ensure_demo_model(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module")
def llm(demo):
    return LLM(demo, block_size=4, num_kv_blocks=256, num_threads=1)


def reference_ids(demo, conversation):
    tokenizer = transformers.AutoTokenizer.from_pretrained(demo, local_files_only=True)
    text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    return text, tokenizer.encode(text, add_special_tokens=False)


def test_chat_renders_the_checkpoints_template_and_generates_as_generate_would(llm, demo):
    conversation = [SYSTEM, {"role": "user", "content": "Name a colour."}]
    text, ids = reference_ids(demo, conversation)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    (chat,) = llm.chat(conversation, GREEDY, use_tqdm=False)
    (plain,) = llm.generate([ids], GREEDY, use_tqdm=False)
    assert chat.prompt == text and chat.prompt_token_ids == ids
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids


def test_several_conversations_share_their_system_prompt(llm, demo):
    questions = ["What is two plus two?", "Name a river.", "What is two plus two?"]
    conversations = [[SYSTEM, {"role": "user", "content": q}] for q in questions]
    outputs = llm.chat(conversations, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == [
        reference_ids(demo, c)[1] for c in conversations
    ]
    assert outputs[0].outputs[0].token_ids == outputs[2].outputs[0].token_ids
    assert outputs[2].num_cached_tokens > 0  # the shared system prompt (and more) hit


def test_an_explicit_template_and_a_checkpoint_without_one(llm, checkpoints):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    (out,) = llm.chat([{"role": "user", "content": "hi"}], GREEDY, False, template)
    assert out.prompt == "[user] hi\n"
    bare = LLM(checkpoints["qwen3"].path, block_size=4, num_kv_blocks=32, num_threads=1)
    with pytest.raises(ValueError, match="no tokenizer"):
        bare.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "non-empty"),
        ([{"role": "user"}], "message 0: needs a string 'content'"),
        ([[{"role": "user", "content": "a"}], []], "conversation 1 is empty"),
        ("hello", "non-empty list"),
    ],
)
def test_bad_conversations_are_one_line_errors(llm, messages, match):
    with pytest.raises(ValueError, match=match):
        llm.chat(messages, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_default_model_missing_names_the_install_command():
    with pytest.raises(ValueError, match="not installed") as err:
        default_model_path("kvserve_no_such_package")
    assert INSTALL_DEFAULT in str(err.value) and DEMO_MODEL in str(err.value)
    assert "\n" not in str(err.value)


def test_demo_model_is_named_not_a_silent_default(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    resolved = resolve_model(DEMO_MODEL)
    assert resolved.random_weights and resolved.path.startswith(str(tmp_path))
    assert resolve_model("some/dir").path == "some/dir"


@pytest.mark.slow
def test_generate_chat_cli(tmp_path, demo):
    base = [sys.executable, "-m", "kvserve.cli", "generate", "--no-progress", "--model", demo]
    args = ["--chat", "--system", "Be brief.", "--prompt", "Hi?", "--max-tokens", "3"]
    proc = subprocess.run([*base, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "prompt: 'Hi?'" in proc.stdout and "Model: " in proc.stdout
    proc = subprocess.run(
        [*base, "--system", "x", "--prompt", "Hi?"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2 and "--system needs --chat" in proc.stderr
    assert "Traceback" not in proc.stderr
