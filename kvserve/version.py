"""kvserve's version, in one place: the command line (`--version`) and the server
(`/version`) both read it here, so neither imports the other for it."""

from __future__ import annotations

__version__ = "0.1.0"
"""The source tree's version (pyproject.toml's)."""


def version() -> str:
    """The installed distribution's version; the source tree's when it is not installed."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("kvserve")
    except PackageNotFoundError:
        return __version__
