"""The shell examples of the README and of docs/*.md run as written.

Every ```bash block of those pages but the README's first (the setup commands, which
tests/structure/test_promises.py checks against CI) runs in bash, with `kvserve` from
this environment, in a fresh directory that is also its $HOME. A block that cannot run
here (a server, a watcher, a placeholder path, a file from the network) has the comment
`<!-- not run: <why> -->` on the line before it: it is only checked for bash syntax.

The runnable blocks start together (one process each, one thread per process) and each
test waits for its own, so the whole costs about as long as the longest block.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = re.compile(r"<!--\s*not run:(.*?)-->")
TIMEOUT = 300


@dataclass(frozen=True)
class Example:
    page: Path
    line: int
    """Where the block starts in its page (1-based, the ```bash line)."""
    code: str
    not_run: str | None
    """The reason given in its `<!-- not run: ... -->` comment, if any."""

    @property
    def name(self) -> str:
        return f"{self.page.stem}-line{self.line}"


def page_examples(page: Path) -> list[Example]:
    text = page.read_text()
    examples = []
    for match in re.finditer(r"^```bash\n(.*?)^```$", text, re.S | re.M):
        line = text.count("\n", 0, match.start()) + 1
        previous = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = NOT_RUN.fullmatch(previous.strip())
        reason = mark.group(1).strip() if mark else None
        examples.append(Example(page, line, match.group(1), reason))
    return examples


EXAMPLES = [e for page in PAGES for e in page_examples(page)]
SETUP, SHOWN = EXAMPLES[0], EXAMPLES[1:]
RUNNABLE = [e for e in SHOWN if e.not_run is None]


def test_the_first_block_is_the_setup_and_every_marker_is_before_a_block():
    assert SETUP.page == README and "pip install" in SETUP.code and SETUP.not_run is None
    for page in PAGES:
        # Each marker on a line of its own (one quoted in prose does not count) marks a block.
        lines = page.read_text().splitlines()
        marks = [line for line in lines if NOT_RUN.fullmatch(line.strip())]
        assert len(marks) == sum(e.not_run is not None for e in EXAMPLES if e.page == page), page
    assert RUNNABLE, "the README and docs show no command that runs"


@pytest.mark.parametrize("example", SHOWN, ids=lambda e: e.name)
def test_every_block_is_bash_and_one_not_run_says_why(example):
    check = subprocess.run(["bash", "-n", "-c", example.code], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    if example.not_run is not None:
        # A reason a reader can act on: a few words, not a bare marker.
        assert len(example.not_run.split()) >= 3, f"{example.name}: {example.not_run!r}"


@dataclass
class Run:
    process: subprocess.Popen
    home: Path

    def wait(self) -> tuple[str, str]:
        try:
            self.process.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise
        return (self.home / "stdout").read_text(), (self.home / "stderr").read_text()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[Example, Run]:
    """Every runnable block, started at once; each in its own $HOME."""
    started = {}
    bin_dir = str(Path(sys.executable).parent)  # where this environment's `kvserve` is
    for example in RUNNABLE:
        home = tmp_path_factory.mktemp(example.name)
        env = {
            **os.environ,
            "HOME": str(home),
            "XDG_CACHE_HOME": str(home / ".cache"),
            "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1",
        }
        with open(home / "stdout", "w") as out, open(home / "stderr", "w") as err:
            process = subprocess.Popen(
                ["bash", "-euo", "pipefail", "-c", example.code],
                cwd=home,
                env=env,
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
            )
        started[example] = Run(process, home)
    yield started
    for run in started.values():
        if run.process.poll() is None:
            run.process.kill()


@pytest.mark.slow
@pytest.mark.parametrize("example", RUNNABLE, ids=lambda e: e.name)
def test_the_example_runs_as_written(example, runs):
    out, err = runs[example].wait()
    assert runs[example].process.returncode == 0, f"{example.name}:\n{out}\n{err}"
    assert "Traceback" not in err and "error:" not in err, err
    assert out.strip(), "it printed nothing"


@pytest.mark.slow
def test_the_offload_example_loads_on_its_second_run_what_its_page_says(runs):
    [example] = [e for e in RUNNABLE if "--offload disk:" in e.code]
    claimed = re.search(r"`offload: (\d+) tokens loaded from the tiers`", example.page.read_text())
    assert claimed, f"{example.page.name} says what the second run loads"
    out, _ = runs[example].wait()
    first, second = re.findall(r"^offload: (\d+) tokens loaded from the tiers", out, re.M)
    assert int(first) == 0  # a fresh $HOME: nothing to load yet
    assert int(second) == int(claimed.group(1)) > 0, out
