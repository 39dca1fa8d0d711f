"""Every architecture kvserve runs, as a tiny checkpoint saved once (tests/_shared.py).

The suite's own checkpoints (tests/conftest.py, tests/model/dense_archs.py,
tests/model/moe_checkpoints.py): one dense family of each kind, the hybrids
(Gemma 3 with five sliding groups and one full, three groups, Bamba's Mamba2
state) and the mixtures of experts.
"""

from __future__ import annotations

from pathlib import Path

from tests.conftest import ARCHS, HYBRID_ARCHS, build_checkpoint
from tests.model.dense_archs import DENSE_ARCHS
from tests.model.moe_checkpoints import MOE_ARCHS, saved_moe_checkpoint

FUZZ_ARCHS = [*ARCHS, *HYBRID_ARCHS, *DENSE_ARCHS, *MOE_ARCHS]


def fuzz_checkpoints(root: Path, archs: list[str] | None = None) -> dict[str, str]:
    """arch -> path of its checkpoint under `root` (built there unless already saved)."""
    paths = {}
    for arch in archs or FUZZ_ARCHS:
        path = root / f"checkpoint-{arch}"
        if arch in MOE_ARCHS:
            saved_moe_checkpoint(arch, path)
        else:
            build_checkpoint(arch, path)
        paths[arch] = str(path)
    return paths
