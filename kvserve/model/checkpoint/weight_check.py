"""The one check every checkpoint format makes before a tensor is read: names and shapes.

The model is built on the meta device first, so its state dict says what
must be loaded; comparing the checkpoint's names and shapes against it
catches a wrong config or a foreign file before any memory is spent, with
one message that lists every problem at once.
"""

from __future__ import annotations

from kvserve.model.checkpoint.errors import ModelLoadError


def check_weights(
    expected: dict[str, tuple[int, ...]],
    found: dict[str, tuple[int, ...]],
    unexpected: list[str],
) -> None:
    """Raise a ModelLoadError naming missing, unexpected and wrongly shaped tensors, if any.

    `found` maps the checkpoint's tensors (under the model's names) to their
    shapes; `unexpected` names those the model has no place for.
    """
    missing = sorted(set(expected) - set(found))
    wrong_shapes = [
        f"{name}: checkpoint {shape}, model {expected[name]}"
        for name, shape in found.items()
        if name in expected and shape != expected[name]
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors: {short_list(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {short_list(sorted(unexpected))}")
    if wrong_shapes:
        problems.append(f"wrong shapes: {short_list(wrong_shapes)}")
    if problems:
        raise ModelLoadError(f"weights do not match the model config: {'; '.join(problems)}")


def short_list(items: list[str], limit: int = 8) -> str:
    """The first `limit` items and how many more: error messages stay one readable line."""
    more = f" ... and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more
