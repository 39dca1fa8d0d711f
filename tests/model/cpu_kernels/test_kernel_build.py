"""Building a kernel: cached on disk by what went into it, clear reasons when it cannot,
and the engine's switch."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from kvserve.model.cpu_kernels import attention, layer_ops
from kvserve.model.cpu_kernels.attention import SOURCE
from kvserve.model.cpu_kernels.build import CFLAGS_ENV, build
from kvserve.model.cpu_kernels.switch import CpuKernels, enable_cpu_kernels
from tests.model.cpu_kernels.conftest import PORTABLE


def test_the_library_is_built_once_and_then_found_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_KERNEL_CACHE", str(tmp_path))
    first = build(SOURCE)
    if first.path is None:
        pytest.skip(f"no kernel here: {first.reason}")
    assert first.seconds > 0 and first.path.parent == tmp_path
    again = build(SOURCE)
    assert (again.path, again.seconds) == (first.path, 0.0)
    other = build(SOURCE, ("-DKVSERVE_TEST_VARIANT",))  # other flags: another library
    assert other.path is not None and other.path != first.path
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.path.name, other.path.name])


def test_without_a_working_compiler_it_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    missing = build(SOURCE)
    assert missing.path is None and "no C compiler" in missing.reason
    broken = tmp_path / "broken-cc"
    broken.write_text("#!/bin/sh\necho 'cc: fatal error: out of licences' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    failed = build(SOURCE)
    assert failed.path is None and "out of licences" in failed.reason
    assert not list(tmp_path.glob("*.so"))


def forget_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """As a fresh process: nothing built or loaded yet."""
    for module, loaded in ((attention, "_kernel"), (layer_ops, "_ops")):
        monkeypatch.setattr(module, loaded, None)
        monkeypatch.setattr(module, "_built", None)


def test_the_switch_and_the_load_log_words(tmp_path, monkeypatch):
    forget_kernels(monkeypatch)
    monkeypatch.setenv("KVSERVE_CPU_KERNELS", "0")
    assert enable_cpu_kernels(torch.float32, exact=True) == CpuKernels()  # torch's ops
    assert enable_cpu_kernels(torch.float16, exact=False) == CpuKernels()
    off = enable_cpu_kernels(torch.bfloat16, exact=False)
    assert off == CpuKernels(", torch's ops only (KVSERVE_CPU_KERNELS=0)")
    assert attention.kernel() is None and layer_ops.ops() is None
    forget_kernels(monkeypatch)
    monkeypatch.delenv("KVSERVE_CPU_KERNELS")
    monkeypatch.setenv("KVSERVE_KERNEL_CACHE", str(tmp_path))
    words = enable_cpu_kernels(torch.bfloat16, exact=False).words
    if attention.kernel() is None or layer_ops.ops() is None:
        pytest.skip(f"no kernels here: {words}")
    assert words.startswith(", C kernels for decode attention and the layers' small ops (built")
    forget_kernels(monkeypatch)
    cached = enable_cpu_kernels(torch.float32, exact=False)  # float32's steps take them too
    assert cached.float32 and cached.words.endswith("small ops (cached)")
    assert not enable_cpu_kernels(torch.bfloat16, exact=True).float32  # exact is float32's


@pytest.mark.slow
def test_a_bfloat16_engine_decodes_through_the_kernel(monkeypatch, caplog, tmp_path):
    """The default model in bfloat16 says so in its load log and every decode step's
    attention calls the kernel (30 layers, one group)."""
    from kvserve import LLM, SamplingParams
    from kvserve.default_model import default_model_path

    monkeypatch.setenv("KVSERVE_KERNEL_CACHE", str(tmp_path))
    forget_kernels(monkeypatch)
    with caplog.at_level(logging.INFO, logger="kvserve.model.runner"):
        llm = LLM(str(default_model_path()), dtype="bfloat16", num_threads=1)
    paged = attention.kernel()
    if paged is None:
        pytest.skip("no kernel here")
    assert "C kernels for decode attention and the layers' small ops (built in" in caplog.text
    calls = []
    real = paged._decode[torch.bfloat16]

    def counted(*args):
        calls.append(args[6])  # the batch
        return real(*args)

    monkeypatch.setitem(paged._decode, torch.bfloat16, counted)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate(["The capital of France is", "One, two, three,"], params)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    assert calls == [2] * 30 * 3  # three decode steps of both rows, every layer


LOAD_AND_DIVIDE = """
import sys
from kvserve.model.cpu_kernels.switch import enable_cpu_kernels
import torch
words = enable_cpu_kernels(torch.bfloat16, exact=False).words
tiny = float(sys.argv[1])
half = torch.tensor([tiny], dtype=torch.float32) * 0.5
print("kernels" in words, tiny / 2 > 0, bool(half[0] > 0), words)
"""


def test_loading_the_kernels_keeps_the_process_subnormals(tmp_path):
    """A library linked with -ffast-math sets flush-to-zero for the whole process when it
    loads; float32 (the exact mode) and Python's own floats must keep their subnormals."""
    import subprocess
    import sys

    env = {**os.environ, "KVSERVE_KERNEL_CACHE": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", LOAD_AND_DIVIDE, "1e-38"],
        capture_output=True, text=True, env=env, timeout=120, check=True,
    )  # fmt: skip
    loaded, python_keeps, torch_keeps = done.stdout.split()[:3]
    if loaded != "True":
        pytest.skip(f"no kernels here: {done.stdout}")
    assert (python_keeps, torch_keeps) == ("True", "True"), done.stdout


@pytest.mark.slow
@pytest.mark.skipif(not PORTABLE, reason="-mno-avx512f is an x86 flag")
def test_extra_compile_flags_build_the_kernels_as_for_an_older_cpu(tmp_path, monkeypatch):
    """KVSERVE_KERNEL_CFLAGS=-mno-avx512f: another library (its own cache key), as an
    AVX2-only CPU builds it: the float32 prefill on 8-lane vectors, no bfloat16 prefill
    (it needs AVX-512 BF16); without AVX2 and FMA too, no prefill kernel at all."""
    monkeypatch.setenv("KVSERVE_KERNEL_CACHE", str(tmp_path))
    forget_kernels(monkeypatch)
    native = attention.enable()
    forget_kernels(monkeypatch)
    monkeypatch.setenv(CFLAGS_ENV, "-mno-avx512f")
    capped = attention.enable()
    paged = attention.kernel()
    if native.path is None or capped.path is None or paged is None:
        pytest.skip(f"no kernels here: {native.reason or capped.reason}")
    assert capped.path != native.path and len(list(tmp_path.glob("attention-*.so"))) == 2
    assert paged.prefill_dtypes == frozenset({torch.float32})
    forget_kernels(monkeypatch)
    monkeypatch.setenv(CFLAGS_ENV, "-mno-avx512f -mno-avx2 -mno-fma")
    plain = attention.enable()
    assert plain.path is not None and len(list(tmp_path.glob("attention-*.so"))) == 3
    assert attention.kernel().prefill_dtypes == frozenset()
