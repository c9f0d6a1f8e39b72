"""Reading the measured per-GPU JSON tables the package ships (kernels/crossover, kernels/gemm_configs).

A table that is absent means "not measured on this GPU"; one that exists but cannot be read is an error naming
the file and the benchmark that writes it: a shipped table must never be silently ignored.
This module is a leaf: it imports nothing from the package, and never triton.
"""

from __future__ import annotations

import json
from pathlib import Path


def read_table(path: Path, what: str, fmt: int, body: str, body_type: type, writer: str) -> dict | None:
    """The JSON object in `path`, or None when there is no such file. `what` names the table in errors ("GEMM
    config table"); it must hold "format": `fmt` and a `body` of `body_type` (list or dict); `writer` is the
    command that regenerates it."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise ValueError(f"{what} {path} is unreadable ({err}); regenerate it with {writer}") from err
    if not isinstance(data, dict) or data.get("format") != fmt or not isinstance(data.get(body), body_type):
        kind = "list" if body_type is list else "object"
        raise ValueError(
            f"{what} {path}: expected a JSON object with format={fmt} and a '{body}' {kind}; regenerate it "
            f"with {writer}"
        )
    return data
