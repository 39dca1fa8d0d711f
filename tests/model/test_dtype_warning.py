"""float16 on the CPU is many times slower than bfloat16: the runner says so, once
(bfloat16's own warning, on a CPU without native bfloat16: tests/model/test_cpu_features.py)."""

from __future__ import annotations

import logging

from kvserve.model import ModelRunner


def test_float16_on_the_cpu_warns_and_suggests_bfloat16(checkpoints, caplog, monkeypatch):
    monkeypatch.setenv("KVSERVE_CPU_FEATURES", "avx2 avx512f avx512_bf16")  # bfloat16 native
    path = checkpoints["qwen3"].path
    options = dict(block_size=4, num_blocks=8, device="cpu", num_threads=1)
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        for dtype in ("float32", "bfloat16", "auto"):
            ModelRunner(path, dtype=dtype, **options)
        assert caplog.records == []
        ModelRunner(path, dtype="float16", **options)
    [record] = caplog.records
    assert record.levelno == logging.WARNING and record.name == "kvserve.model.runner"
    message = record.getMessage()
    assert "float16" in message and "use bfloat16" in message and "\n" not in message
