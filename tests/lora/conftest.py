"""Random PEFT adapters over the suite's tiny checkpoints, saved by peft itself, and
their oracle: peft's `PeftModel.generate` (greedy)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path

import peft
import pytest
import torch

from kvserve.model.demo import ensure_demo_model
from tests.conftest import Checkpoint

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class Adapter:
    """A saved adapter and its oracle."""

    def __init__(self, path: Path, model: peft.PeftModel) -> None:
        self.path = str(path)
        self.model = model
        self._reference: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def reference(self, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt), max_new_tokens)
        if key not in self._reference:
            with torch.no_grad():
                out = self.model.generate(
                    input_ids=torch.tensor([list(prompt)]),
                    do_sample=False,
                    max_new_tokens=max_new_tokens,
                    pad_token_id=0,
                )
            self._reference[key] = out[0, len(prompt) :].tolist()
        return self._reference[key]


def make_adapter(
    ck: Checkpoint,
    path: Path,
    seed: int,
    targets: Sequence[str] = tuple(ALL_TARGETS),
    rank: int = 4,
    alpha: float = 8,
    use_rslora: bool = False,
    parameters: Sequence[str] | None = None,
) -> Adapter:
    """PEFT's LoRA over a copy of `ck`'s model, every lora_A and lora_B random (PEFT starts
    lora_B at zero: an adapter that changes nothing would test nothing), saved at `path`.
    `parameters`: PEFT's target_parameters (an MoE's fused expert weights)."""
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(targets) or None,
        target_parameters=None if parameters is None else list(parameters),
        use_rslora=use_rslora,
        lora_dropout=0.0,
    )
    model = peft.get_peft_model(copy.deepcopy(ck.hf_model), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    model.eval()
    model.save_pretrained(str(path))
    return Adapter(path, model)


def two_adapters(ck: Checkpoint, root: Path) -> dict[str, Adapter]:
    """Every projection (rank 4), and attention only with rsLoRA (rank 8)."""
    return {
        "all": make_adapter(ck, root / "all", seed=1),
        "attn": make_adapter(
            ck,
            root / "attn",
            seed=2,
            targets=["q_proj", "v_proj", "o_proj"],
            rank=8,
            use_rslora=True,
        ),
    }


@pytest.fixture(scope="module")
def llama_adapters(checkpoints, tmp_path_factory) -> dict[str, Adapter]:
    return two_adapters(checkpoints["llama"], tmp_path_factory.mktemp("llama-adapters"))


@pytest.fixture(scope="session")
def demo_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The demo checkpoint (random weights, a real tokenizer): the CLI prints its text."""
    return ensure_demo_model(tmp_path_factory.mktemp("demo"))
