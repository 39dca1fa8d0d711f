"""`--lora-modules` entries: `NAME=DIR`, or vLLM's JSON form, read without torch (the serve
command reads them; `--data-parallel-size` hands them on to every rank)."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class AdapterModule:
    """One `--lora-modules` entry: `NAME=DIR`, or vLLM's JSON form."""

    name: str
    path: str
    base_model_name: str | None = None

    def to_json(self) -> str:
        """vLLM's JSON form (a name with `=` stays whole)."""
        fields = {"name": self.name, "path": self.path}
        if self.base_model_name is not None:
            fields["base_model_name"] = self.base_model_name
        return json.dumps(fields)


def parse_lora_module(text: str) -> AdapterModule:
    """`NAME=DIR` or `{"name": ..., "path": ..., "base_model_name": ...}` (ValueError: why)."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--lora-modules: {text!r} is not JSON ({exc})") from None
        extra = sorted(set(value) - {"name", "path", "base_model_name"})
        if extra:
            raise ValueError(f"--lora-modules: {text!r} has unknown keys {extra}")
        name, path, base = value.get("name"), value.get("path"), value.get("base_model_name")
        if not (isinstance(name, str) and name and isinstance(path, str) and path):
            raise ValueError(f"--lora-modules: {text!r} needs a non-empty name and path")
        if base is not None and not isinstance(base, str):
            raise ValueError(f"--lora-modules: {text!r}: base_model_name must be a string")
        return AdapterModule(name, path, base)
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f'--lora-modules must be NAME=DIR or {{"name": ..., "path": ...}}, '
                         f"got {text!r}")  # fmt: skip
    return AdapterModule(name, path)
