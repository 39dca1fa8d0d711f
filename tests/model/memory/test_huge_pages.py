"""A CPU model's weights on transparent huge pages (kvserve/model/memory/huge_pages.py):
what moves, what stays, that the kernel backs them with 2 MiB pages, and that a loaded
model computes the same on them."""

from __future__ import annotations

import gc
import mmap
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from kvserve import LLM, SamplingParams
from kvserve.model.cpu_malloc import give_back_freed_memory, keep_freed_memory
from kvserve.model.memory import huge_pages
from kvserve.model.memory.huge_pages import (
    PAGE,
    move_weights_to_huge_pages,
    transparent_huge_pages,
)

MiB = 1 << 20
pytestmark = pytest.mark.skipif(not huge_pages.available(), reason="no MADV_HUGEPAGE here")


class Weights(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Parameter(torch.randn(MiB), requires_grad=False)  # 4 MiB
        self.register_buffer("codes", torch.randint(0, 255, (3 * MiB,), dtype=torch.uint8))
        self.register_buffer("small", torch.randn(256))
        whole = torch.randn(2 * MiB)
        self.register_buffer("view", whole[MiB:])  # part of a larger storage


def test_big_weights_move_with_their_values_and_the_rest_stays() -> None:
    model = Weights()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    stays = {name: model.get_buffer(name).data_ptr() for name in ("small", "view")}
    moved = move_weights_to_huge_pages(model)
    assert moved == 4 * MiB + 3 * MiB
    assert model.big.data_ptr() % PAGE == 0 and model.get_buffer("codes").data_ptr() % PAGE == 0
    assert isinstance(model.big, nn.Parameter) and not model.big.requires_grad
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert {name: model.get_buffer(name).data_ptr() for name in stays} == stays


def test_a_tied_parameter_moves_once_and_stays_one_object() -> None:
    first, second = nn.Linear(1024, 1024, bias=False), nn.Linear(1024, 1024, bias=False)
    second.weight = first.weight
    model = nn.Sequential(first, second)
    assert move_weights_to_huge_pages(model) == 4 * MiB
    assert first.weight is second.weight and first.weight.data_ptr() % PAGE == 0


def test_off_with_the_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(huge_pages.ENV, "0")
    model = Weights()
    where = model.big.data_ptr()
    assert move_weights_to_huge_pages(model) == 0 and model.big.data_ptr() == where


def anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(
    transparent_huge_pages() == "never", reason="transparent huge pages are off here"
)
def test_the_kernel_backs_moved_weights_with_huge_pages() -> None:
    model = Weights()
    assert anon_huge_kib(model.big.data_ptr()) == 0 or transparent_huge_pages() == "always"
    move_weights_to_huge_pages(model)
    assert anon_huge_kib(model.big.data_ptr()) >= 2048


def test_a_loaded_model_on_huge_pages_generates_the_same(
    checkpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiny checkpoint's tensors are far below 2 MiB: the threshold is lowered so they move."""
    path = checkpoints["llama"].path
    params = SamplingParams(temperature=0, max_tokens=8)
    prompt = [[1, 5, 9, 2, 7]]
    monkeypatch.setenv(huge_pages.ENV, "0")
    plain = LLM(path, num_threads=1).generate(prompt, params, use_tqdm=False)
    monkeypatch.setenv(huge_pages.ENV, "1")
    monkeypatch.setattr(huge_pages, "HUGE", 4096)
    llm = LLM(path, num_threads=1)
    weights = [t for t in llm.engine.runner.model.state_dict().values() if t.nbytes >= 4096]
    assert weights and all(t.data_ptr() % PAGE == 0 for t in weights)
    moved = llm.generate(prompt, params, use_tqdm=False)
    assert moved[0].outputs[0].token_ids == plain[0].outputs[0].token_ids


@pytest.mark.parametrize("refused", ["mapping", "advice"])
def test_a_refused_mapping_or_advice_leaves_the_weights_where_they_are(
    monkeypatch: pytest.MonkeyPatch, refused: str
) -> None:
    real = mmap.mmap

    class Refusing(real):  # type: ignore[misc, valid-type]
        def __new__(cls, *args, **kwargs):
            if refused == "mapping":
                raise OSError(12, "Cannot allocate memory")
            return real.__new__(cls, *args, **kwargs)

        def madvise(self, *args):
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(mmap, "mmap", Refusing)
    model = Weights()
    where = model.big.data_ptr()
    assert move_weights_to_huge_pages(model) == 0 and model.big.data_ptr() == where


def resident_anon_kib() -> int:
    status = Path("/proc/self/status").read_text()
    found = re.search(r"^RssAnon:\s+(\d+) kB", status, re.M)
    return int(found.group(1)) if found else 0


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="no /proc here")
def test_the_old_copies_go_back_to_the_kernel() -> None:
    """Tensors under glibc's raised mmap threshold live in its heap, which the raised trim
    threshold keeps mapped when they are freed: the move hands them back, so the weights
    are resident once, not twice."""
    keep_freed_memory()  # as every CPU engine does
    model = nn.Module()
    for i in range(64):  # 256 MiB in blocks of 4 MiB, each under the 32 MiB threshold
        model.register_buffer(f"w{i}", torch.ones(MiB))
    before = resident_anon_kib()
    assert move_weights_to_huge_pages(model, give_back_freed_memory) == 256 * MiB
    gc.collect()
    grown_mib = (resident_anon_kib() - before) / 1024
    assert grown_mib < 64, f"resident memory grew by {grown_mib:.0f} MiB moving 256 MiB"
