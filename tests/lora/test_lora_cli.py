"""`kvserve generate --lora NAME=DIR`: every prompt with the adapter, peft's text; a bad
option (of generate's --lora, of serve's --lora-modules) is one line, exit 2."""

from __future__ import annotations

import pytest
import transformers

from tests.cli._cli import SMALL, kvserve, one_line_error
from tests.lora.conftest import make_adapter

PROMPT = [3, 17, 29, 41, 5]


class _Base:
    """The demo checkpoint (it has a tokenizer: the CLI prints text) as make_adapter's base."""

    def __init__(self, path: str) -> None:
        self.hf_model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()


@pytest.mark.slow
def test_generate_with_an_adapter_prints_peft_s_text(demo_path, tmp_path):
    adapter = make_adapter(_Base(demo_path), tmp_path / "demo-lora", seed=5)
    tokenizer = transformers.AutoTokenizer.from_pretrained(demo_path)
    proc = kvserve(
        "generate", "--model", demo_path, *SMALL, "--max-tokens", "5", "--ignore-eos",
        "--prompt-token-ids", str(PROMPT), "--lora", f"tuned={adapter.path}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert f"LoRA adapter: tuned ({adapter.path})" in proc.stdout
    completion = proc.stdout.split("prompt: ")[1].splitlines()[1].strip()
    text = tokenizer.decode(adapter.reference(PROMPT, 5))
    assert completion.startswith(repr(text)), (completion, text)


def test_bad_lora_options_are_one_line(checkpoints, tmp_path):
    ck = checkpoints["llama"]
    quiet = ("--log-level", "warning")  # stderr: the error alone
    common = ("generate", "--model", ck.path, *SMALL, *quiet, "--prompt-token-ids", str(PROMPT))
    one_line_error(kvserve(*common, "--lora", "no-equals-sign"), "--lora", "NAME=DIR")
    one_line_error(kvserve(*common, "--lora", f"x={tmp_path / 'none'}"), "not a directory")


@pytest.mark.slow
def test_bad_lora_modules_are_one_line_before_the_engine_is_built(demo_path, tmp_path):
    serve = ("serve", "--model", demo_path, "--port", "0", "--log-level", "warning")
    one_line_error(kvserve(*serve, "--lora-modules", "no-equals"), "--lora-modules", "NAME=DIR")
    missing = f"gone={tmp_path / 'none'}"
    one_line_error(
        kvserve(*serve, "--lora-modules", missing), "--lora-modules", "'gone'", "not a directory"
    )
    one_line_error(kvserve(*serve, "--lora-modules", '{"name": "j"}'), "--lora-modules", "path")
    adapter = make_adapter(_Base(demo_path), tmp_path / "ok", seed=1)
    twice = (f"x={adapter.path}", f"x={adapter.path}")
    one_line_error(kvserve(*serve, "--lora-modules", *twice), "'x'", "twice")
    big = make_adapter(_Base(demo_path), tmp_path / "big", seed=2, rank=32)
    one_line_error(kvserve(*serve, "--lora-modules", f"big={big.path}"), "'big'", "max_lora_rank")
