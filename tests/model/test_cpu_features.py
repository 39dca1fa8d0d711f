"""The CPU's features (issue 43): /proc/cpuinfo read right, the override, and what `dtype`
and the quantized modes compute in with and without native bfloat16."""

from __future__ import annotations

import logging

import pytest
import torch

from kvserve.model import ModelRunner
from kvserve.model.cpu_kernels.cpu_features import (
    ENV,
    CpuFeatures,
    detect,
    parse_cpuinfo,
    parse_override,
)
from kvserve.model.device import (
    PACKED_DTYPE_WHY,
    cpu_bfloat16_warning,
    cpu_dtype_reason,
    cpu_float16_warning,
    resolve_dtype,
)
from kvserve.model.quant.quant_linear import PackedLinear

COMMON = "fpu vme de pse tsc msr pae mce cx8 sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c"
EPYC_ROME = (
    "processor\t: 0\nvendor_id\t: AuthenticAMD\n"
    "model name\t: AMD EPYC 7B12 64-Core Processor\n"
    f"flags\t\t: {COMMON} bmi1 avx2 smep bmi2 rdseed adx clflushopt sha_ni\n\n"
    "processor\t: 1\nmodel name\t: AMD EPYC 7B12 64-Core Processor\nflags\t\t: avx2\n"
)
SAPPHIRE_RAPIDS = (
    "model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz\n"
    f"flags\t\t: {COMMON} avx2 avx512f avx512dq avx512cd avx512bw avx512vl avx_vnni "
    "avx512_bf16 avx512vbmi avx512_vnni avx512_fp16 amx_bf16 amx_tile amx_int8\n"
)
ZEN4 = (
    "model name\t: AMD EPYC 9B14 96-Core Processor\n"
    f"flags\t\t: {COMMON} avx2 avx512f avx512dq avx512_bf16 avx512vbmi avx512_vnni\n"
)
GRAVITON3 = "processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd sve bf16 i8mm\n"


def features(flags: str) -> CpuFeatures:
    return CpuFeatures("Test CPU", parse_override(flags), "test")


AVX2, NATIVE = features("avx2"), features("avx2 avx512f avx512_bf16 amx")


@pytest.mark.parametrize(
    ("text", "model", "names", "native"),
    [
        (EPYC_ROME, "AMD EPYC 7B12 64-Core Processor", "avx2", False),
        (
            SAPPHIRE_RAPIDS,
            "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz",
            "avx2 avx512f avx512_bf16 amx avx512_vnni avx_vnni",
            True,
        ),
        (ZEN4, "AMD EPYC 9B14 96-Core Processor", "avx2 avx512f avx512_bf16 avx512_vnni", True),
        (GRAVITON3, "", "bf16", True),
    ],
    ids=["epyc-rome-avx2", "sapphire-rapids-amx", "zen4-avx512bf16", "graviton3"],
)
def test_cpuinfo_flags_are_parsed(text, model, names, native):
    found_model, flags = parse_cpuinfo(text)
    cpu = CpuFeatures(found_model, flags, "/proc/cpuinfo")
    assert (found_model, cpu.names(), cpu.native_bf16) == (model, names, native)


def test_the_override_replaces_the_flags_and_is_named(monkeypatch):
    monkeypatch.setenv(ENV, "avx2")
    cpu = detect()
    assert cpu.flags == {"avx2"} and not cpu.native_bf16
    assert cpu.describe().endswith("(avx2: no native bfloat16, KVSERVE_CPU_FEATURES=avx2)")
    monkeypatch.setenv(ENV, "avx2, avx512f,AMX")
    assert detect().names() == "avx2 avx512f amx" and detect().native_bf16
    monkeypatch.setenv(ENV, "none")
    assert detect().names() == "none"
    monkeypatch.delenv(ENV)
    assert not detect().source.startswith(ENV)


def test_an_unknown_override_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(ENV, "avx2 avx512bf16")
    with pytest.raises(ValueError, match=r"unknown feature\(s\) avx512bf16; use any of avx2"):
        detect()


@pytest.mark.parametrize("cpu", [AVX2, NATIVE], ids=["avx2", "native"])
def test_auto_is_float32_on_every_cpu(cpu):
    cpu_device = torch.device("cpu")
    assert resolve_dtype("auto", cpu_device) == torch.float32
    assert resolve_dtype("bfloat16", cpu_device) == torch.bfloat16  # asked: it runs
    line = cpu_dtype_reason("auto", torch.float32, cpu, "none")
    assert line.startswith(f"CPU: Test CPU ({cpu.names()}: ")
    fastest = "the fastest without native bfloat16" if cpu is AVX2 else "bfloat16 runs faster"
    assert "dtype float32 (auto" in line and fastest in line and "\n" not in line
    assert line.endswith("; matmuls packed for oneDNN (--exact: transformers' bits))")
    exact = cpu_dtype_reason("auto", torch.float32, cpu, "none", exact=True)
    assert exact.endswith("; exact: transformers' matmuls)")
    dense = cpu_dtype_reason("bfloat16", torch.bfloat16, cpu, "none", panels=True)
    assert dense.endswith("; matmuls on kvserve's AVX-512 BF16 kernel (--exact: "
                          "transformers' bits))")  # fmt: skip
    dense = cpu_dtype_reason("auto", torch.float32, cpu, "none", panels=True)
    assert dense.endswith("; matmuls on kvserve's float32 kernel (--exact: transformers' bits))")
    assert "kernel" not in cpu_dtype_reason("bfloat16", torch.bfloat16, cpu, "none")


def test_explicit_bfloat16_warns_only_without_native_bfloat16_and_float16_advises_by_cpu():
    assert cpu_bfloat16_warning(NATIVE) == ""
    warning = cpu_bfloat16_warning(AVX2)
    assert "(avx2: no native bfloat16)" in warning and "--dtype float32" in warning
    assert "about 2.5x faster" in warning and "\n" not in warning
    assert "use bfloat16" in cpu_float16_warning(NATIVE)
    assert cpu_float16_warning(AVX2).endswith("(avx2: no native bfloat16)): use float32")
    line = cpu_dtype_reason("bfloat16", torch.bfloat16, AVX2, "none")
    assert "dtype bfloat16 (as asked; float32 is about 2.5x faster here)" in line


def start(path, monkeypatch, caplog, flags: str, **options) -> ModelRunner:
    """A runner built as if on a CPU with `flags`; caplog holds what it logged."""
    monkeypatch.setenv(ENV, flags)
    with caplog.at_level(logging.INFO, logger="kvserve"):
        return ModelRunner(path, block_size=4, num_blocks=8, device="cpu", num_threads=1, **options)


def dtype_line(caplog) -> str:
    [line] = [r.getMessage() for r in caplog.records if "; dtype " in r.getMessage()]
    return line


@pytest.mark.parametrize("flags", ["avx2", "avx2 avx512f avx512_bf16 amx"])
def test_the_start_up_line_names_the_cpu_its_features_and_the_dtype(
    checkpoints, monkeypatch, caplog, flags
):
    runner = start(checkpoints["qwen3"].path, monkeypatch, caplog, flags)
    assert runner.dtype == torch.float32
    line = dtype_line(caplog)
    names = "avx2 avx512f avx512_bf16 amx: native" if "amx" in flags else "avx2: no native"
    assert line.startswith("CPU: ") and f"{names} bfloat16, {ENV}={flags})" in line
    assert "dtype float32 (auto" in line and "exact: transformers' matmuls" in line  # the suite's
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_explicit_bfloat16_on_an_avx2_cpu_runs_and_warns_once(checkpoints, monkeypatch, caplog):
    runner = start(checkpoints["qwen3"].path, monkeypatch, caplog, "avx2", dtype="bfloat16")
    assert runner.dtype == torch.bfloat16
    [record] = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert record.levelno == logging.WARNING and record.name == "kvserve.model.runner"
    message = record.getMessage()
    assert "(avx2: no native bfloat16, KVSERVE_CPU_FEATURES=avx2)" in message
    assert "--dtype float32" in message and "about 2.5x faster" in message


@pytest.mark.parametrize("flags", ["avx2", "avx2 avx512f avx512_bf16 amx"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_packed_layers_run_in_the_engines_dtype_on_every_cpu(
    checkpoints, monkeypatch, caplog, flags, mode
):
    """The packed kernel reads float32 as it is (int8 activations, no bfloat16 needed): auto
    keeps a float32 model without native bfloat16, packed layers and all, and the log says
    what they compute."""
    runner = start(checkpoints["llama"].path, monkeypatch, caplog, flags, quantization=mode)
    assert runner.dtype == torch.float32
    assert runner.model is not None
    packed = [m for m in runner.model.modules() if isinstance(m, PackedLinear)]
    assert packed
    x = torch.randn(2, packed[0].in_features)
    assert packed[0](x).dtype == torch.float32
    assert dtype_line(caplog).endswith(f"; {PACKED_DTYPE_WHY}")
