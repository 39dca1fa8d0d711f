"""`kvserve serve MODEL` (issue 30, item 6): the model positionally, as `vllm serve MODEL`
takes it; `--model` still works; both given and different is a one-line error (so is a
negative --responses-store-size)."""

from __future__ import annotations

import pytest

from kvserve.cli import build_parser, main
from kvserve.cli.serve import model_from


@pytest.mark.parametrize(
    ("argv", "model"),
    [
        (["serve", "demo:random"], "demo:random"),
        (["serve", "--model", "demo:random"], "demo:random"),
        (["serve", "demo:random", "--model", "demo:random"], "demo:random"),
        (["serve", "--port", "9", "demo:random"], "demo:random"),
        (["serve"], None),
    ],
)
def test_the_model_positionally_or_by_option(argv, model):
    assert model_from(build_parser().parse_args(argv)) == model


def test_two_different_models_are_refused_before_loading(capsys):
    assert main(["serve", "/no/such/a", "--model", "/no/such/b"]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("kvserve serve: error: the model is given twice"), line
    assert "'/no/such/a'" in line and "--model '/no/such/b'" in line


def test_a_negative_responses_store_size_is_refused_before_loading(capsys):
    assert main(["serve", "--responses-store-size", "-1"]) == 2
    assert "--responses-store-size must be >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_a_negative_responses_store_mb_is_refused_before_loading(capsys, value):
    assert main(["serve", "--responses-store-mb", value]) == 2
    assert "--responses-store-mb must be >= 0" in capsys.readouterr().err
