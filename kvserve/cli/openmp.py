"""Intel's OpenMP runtime under the command line's engines, where it is installed.

torch's CPU build runs its parallel regions on GNU OpenMP (libgomp). Intel's
runtime (libiomp5, from the `intel-openmp` package: `pip install
'kvserve[iomp]'`) serves the same GOMP entry points, and its barriers hold up
when another busy thread shares the cores: in `kvserve serve` (the event loop
beside the engine's threads) the default model's streamed inter-token
latency at 2 threads drops from 57 to 37.5 ms at 8 streams, from 37.6 to
27.5 at one, the same tokens (benchmarks/README.md, "cpu_vs_vllm"). vLLM's
CPU documentation recommends it too.

A process picks its OpenMP runtime when the dynamic loader first resolves the
GOMP symbols, before any Python runs that could choose; the only switch is
LD_PRELOAD at exec time. So `kvserve` re-executes itself once, before torch is
imported, with the library preloaded. `KVSERVE_OPENMP` decides: unset or
`auto` preloads libiomp5 when it lies in this environment's `lib/`; `gnu`
keeps torch's own runtime; a path preloads that library. A program that
embeds kvserve as a library sets LD_PRELOAD itself (docs/generating.md).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

ENV = "KVSERVE_OPENMP"
PRELOADED = "KVSERVE_OPENMP_PRELOADED"
"""Set in the re-executed process: the library it preloaded (the log line reads it)."""
INTEL = "libiomp5.so"


def chosen_library(env: dict[str, str], prefix: str = sys.prefix) -> Path | None:
    """The library to preload, or None: GNU's runtime, asked for or the only one here."""
    choice = env.get(ENV, "auto").strip()
    if choice == "gnu":
        return None
    if choice in ("", "auto"):
        found = Path(prefix) / "lib" / INTEL
        return found if found.is_file() else None
    path = Path(choice).expanduser()
    if not path.is_file():
        raise ValueError(f"{ENV}={choice!r}: no such library (use auto, gnu or a file's path)")
    return path


MAINS = (Path(__file__).parent / "__main__.py", Path(__file__).parent.parent / "__main__.py")
"""`python -m kvserve.cli` and `python -m kvserve`: what sys.argv[0] is when run that way."""


def launched_as_kvserve(argv0: str) -> bool:
    """Whether this process is the `kvserve` command itself (its script, `python -m kvserve`
    or `python -m kvserve.cli`): only then is re-running it the same program. A program
    that calls kvserve.cli.main() from its own code (a wrapper, a test that patches the
    engine first) would lose what it set up, so it keeps its runtime."""
    path = Path(argv0)
    return path.name == "kvserve" or path.resolve() in {m.resolve() for m in MAINS}


def reexec_with_openmp(argv: list[str]) -> None:
    """Replace this process by `python -m kvserve argv` with the chosen OpenMP library
    preloaded; return when none is chosen, torch is already loaded (too late to choose),
    another program runs the command line, or this is the re-executed process (which
    says what it preloaded)."""
    if PRELOADED in os.environ:
        logger.debug("OpenMP: %s preloaded (%s)", os.environ[PRELOADED], ENV)
        return
    library = chosen_library(dict(os.environ))
    if library is None or "torch" in sys.modules or not launched_as_kvserve(sys.argv[0]):
        return
    preload = os.environ.get("LD_PRELOAD", "")
    env = {
        **os.environ,
        "LD_PRELOAD": f"{library}:{preload}" if preload else str(library),
        PRELOADED: str(library),
    }
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "kvserve", *argv], env)
