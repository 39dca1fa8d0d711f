"""Every architecture kvserve runs, as a tiny checkpoint saved once (tests/_shared.py).

The suite's own checkpoints (tests/conftest.py, tests/model/dense_archs.py,
tests/model/moe_checkpoints.py): one dense family of each kind, the hybrids
(Gemma 3 with five sliding groups and one full, three groups, Bamba's Mamba2
state) and the mixtures of experts. Packed weights (int4, int8) only when asked for by
name (QUANTIZED_ARCHS), with a wider tie (differential.py's TIE_PACKED).
"""

from __future__ import annotations

from pathlib import Path

from tests.conftest import ARCHS, HYBRID_ARCHS, build_checkpoint
from tests.model.dense_archs import DENSE_ARCHS
from tests.model.moe_checkpoints import MOE_ARCHS, saved_moe_checkpoint

FUZZ_ARCHS = [*ARCHS, *HYBRID_ARCHS, *DENSE_ARCHS, *MOE_ARCHS]
QUANTIZED_ARCHS = {"llama-int4": ("llama", "int4"), "qwen2-int8": ("qwen2", "int8")}
"""A fuzzed name -> (the checkpoint, the engine's `quantization`); not in FUZZ_ARCHS (the
suite's campaigns): a packed layer is batch-invariant only below its first threshold
(the kernel's AMX tile_rows where the CPU has AMX, else kvserve.model.quant.quant_linear's
DENSE_ROWS: from there it multiplies bfloat16 or float activations, not int8 ones), and
its int8 activations turn another float32 order's last bits (a chunk,
a cached prefix) into logprob moves of up to ~0.1 on the tiny checkpoints, so a busy run
and a lone one differ by more than rounding without a cache fault. `benchmarks/fuzz.py
--archs llama-int4,qwen2-int8` runs them."""


BFLOAT16_ARCHS = [arch for arch in FUZZ_ARCHS if arch not in MOE_ARCHS]
"""What a bfloat16 campaign fuzzes unless given names: no mixture of experts. A bfloat16
router's probabilities tie exactly (its logits have 8 bits of mantissa), and a busy
run's other rounding then picks the other expert at some earlier position (seen: Mixtral,
layer 1, experts [2, 5] against the lone run's [0, 5] at a margin of 0), so a token many
positions later differs by far more than any tie, with no cache fault. Float32 routers
do not tie, and the float32 campaigns fuzz them all."""


def quantization(arch: str) -> str:
    """The `quantization` its engines load with ("none" but for QUANTIZED_ARCHS)."""
    return QUANTIZED_ARCHS[arch][1] if arch in QUANTIZED_ARCHS else "none"


def fuzz_checkpoints(root: Path, archs: list[str] | None = None) -> dict[str, str]:
    """arch -> path of its checkpoint under `root` (built there unless already saved)."""
    paths = {}
    for arch in archs or FUZZ_ARCHS:
        saved = QUANTIZED_ARCHS[arch][0] if arch in QUANTIZED_ARCHS else arch
        path = root / f"checkpoint-{saved}"
        if saved in MOE_ARCHS:
            saved_moe_checkpoint(saved, path)
        else:
            build_checkpoint(saved, path)
        paths[arch] = str(path)
    return paths
