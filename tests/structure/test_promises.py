"""The repository's promises about its own setup: README, CI and the default model agree."""

from __future__ import annotations

import re

from _imports import ROOT

from kvserve.default_model import INSTALL_DEFAULT


def readme_commands() -> list[str]:
    """The command lines of the README's first shell block (comments left out)."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, re.S)
    assert block, "the README starts with a bash block"
    return [line for line in block.group(1).splitlines() if line and not line.startswith("#")]


def test_ci_runs_exactly_the_readmes_test_command():
    main_job, tests = readme_commands()
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci == tests
    assert main_job.endswith("kvserve generate") and tests.endswith("python -m pytest")


def test_both_commands_install_the_default_model_the_code_names():
    pinned = INSTALL_DEFAULT.removeprefix("pip install ")
    for command in readme_commands():
        assert f".venv/bin/pip install -q {pinned}" in command, command


def test_the_main_job_installs_the_runtime_only_and_the_tests_the_dev_extra():
    main_job, tests = readme_commands()
    assert ".venv/bin/pip install -q -c constraints.txt -e . &&" in main_job
    assert "[dev]" not in main_job
    assert ".venv/bin/pip install -q -c constraints.txt -e '.[dev]' &&" in tests
