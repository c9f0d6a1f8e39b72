"""Measured token crossovers: from how many rows (tokens) a SwitchBack linear beats bf16 `nn.Linear`, per GPU.

What `SwitchBackConfig(min_tokens=None)` (the default) uses for CUDA tensors under backend="auto": a linear
(K = in_features, N = out_features) runs its 8-bit path only from the measured crossover of its shape on the
current GPU, so a layer whose 8-bit path does not pay at its call's token count stays 16-bit.

The tables are this folder's `sm<major><minor>.json` (e.g. sm90.json for Hopper), written by
`benchmarks/bench_linear.py --mode crossover --write_table` on that GPU. The unit it measures is a stack of
encoder layers of width d (transformers' CLIPEncoderLayer, MLP 4d), because that is where the 8-bit path pays
or not: the LayerNorms and the activation write the next linear's 8-bit input, so a lone linear (which
quantizes its own input) is slower than the same linear inside a layer (a table's `step` field says what it
measured). Per precision ("int8", "fp8") and (K, N) of each of the layer's linears: the times of one forward +
backward of the bf16 and the SwitchBack stack (library defaults) over a grid of token counts, eager and with
each layer under torch.compile, and two thresholds, `crossover` (eager) and `crossover_compiled`: the smallest
grid M from which SwitchBack was at least the table's `margin` faster at that M and every larger one, or null
(never paid on the grid: the layer stays 16-bit at every M). A table without `crossover_compiled` uses
`crossover` for both. Between grid points the crossover is conservative.
One table per precision serves every config of that precision (row-wise weight scale, grad_precision="int8",
other KernelOptions): kept simple, at the cost of a crossover measured for the defaults only.

A layer's threshold, `min_tokens_for(capability, k, n, precision, compiled)`:
1. exact (K, N) in the table;
2. else the nearest measured family: same N/K ratio class (log2(N/K) rounded: 0 for q/k/v/out_proj d->d, 2 for
   fc1 d->4d, -2 for fc2 4d->d) and the closest K*N in log space, within a factor of 4 (NEAREST_MAX_LOG2_AREA);
   on a tie the larger threshold;
3. else (no table for this GPU, no family close enough) FALLBACK_MIN_TOKENS, one constant for every shape
   (from the MLP block at d=1280 on the H100, BENCHMARKS.md, MLP block).
Table lookups are cached, and both entry points are torch.compile constants (evaluated once while tracing).

This module is a leaf: it imports nothing from the package but kernels/shipped_tables.py, and never triton.
"""

from __future__ import annotations

import functools
import math
import sys
from pathlib import Path

import torch

from ..shipped_tables import read_table

TABLE_DIR = Path(__file__).resolve().parent
FORMAT = 1
FALLBACK_MIN_TOKENS = 16384
# A threshold no call reaches: the layer always runs the 16-bit matmul (a null crossover).
NEVER = sys.maxsize
# How far (in log2 of K*N) the nearest family may be: 2.0 = within a factor of 4 of the layer's K*N.
NEAREST_MAX_LOG2_AREA = 2.0


def table_name(capability: tuple[int, int]) -> str:
    """File name of the table for a compute capability, e.g. (9, 0) -> "sm90.json"."""
    return f"sm{capability[0]}{capability[1]}.json"


def cuda_capability(device_type: str, index: int | None) -> tuple[int, int] | None:
    """(major, minor) of the CUDA device (None index: the current one), or None when not a CUDA device."""
    if device_type != "cuda":
        return None
    # get_device_properties, not get_device_capability: torch.compile constant-folds the former.
    props = torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index)
    return props.major, props.minor


def _crossover(value, where: str) -> int:
    if value is None:
        return NEVER
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{where}: crossover must be null or an int >= 0, got {value!r}")
    return value


@functools.cache
def load_table(path: Path, compiled: bool = False) -> dict[tuple[str, int, int], int] | None:
    """{(precision, K, N): threshold} of a table file (NEVER for a null crossover), or None when it is absent;
    `compiled`: the thresholds measured under torch.compile (`crossover_compiled`, else `crossover`).

    A file that exists but is not a table is an error: a shipped table must never be silently ignored.
    """
    writer = "benchmarks/bench_linear.py --mode crossover --write_table"
    data = read_table(path, "crossover table", FORMAT, "precisions", dict, writer)
    if data is None:
        return None
    table: dict[tuple[str, int, int], int] = {}
    for precision, shapes in data["precisions"].items():
        for name, entry in shapes.items():
            where = f"crossover table {path}, {precision} {name}"
            try:
                k, n = int(entry["K"]), int(entry["N"])
                key = "crossover_compiled" if compiled and "crossover_compiled" in entry else "crossover"
                table[(precision, k, n)] = _crossover(entry[key], f"{where} {key}")
            except (KeyError, TypeError) as err:
                raise ValueError(f"{where}: needs K, N and crossover ({err!r})") from err
    return table


def lookup(table: dict[tuple[str, int, int], int], precision: str, k: int, n: int) -> int | None:
    """The threshold for a (K, N) layer from a loaded table: exact, else the nearest family, else None."""
    exact = table.get((precision, k, n))
    if exact is not None:
        return exact
    ratio_class = round(math.log2(n / k))
    area = math.log2(k * n)
    best = None
    for (prec, kc, nc), threshold in table.items():
        if prec != precision or round(math.log2(nc / kc)) != ratio_class:
            continue
        distance = abs(math.log2(kc * nc) - area)
        if distance <= NEAREST_MAX_LOG2_AREA and (best is None or (distance, -threshold) < best[:2]):
            best = (distance, -threshold, threshold)
    return None if best is None else best[2]


@functools.cache
def _min_tokens(
    capability: tuple[int, int], k: int, n: int, precision: str, table_dir: Path, compiled: bool
) -> int:
    if k <= 0 or n <= 0:
        return FALLBACK_MIN_TOKENS
    table = load_table(table_dir / table_name(capability), compiled)
    found = None if table is None else lookup(table, precision, k, n)
    return FALLBACK_MIN_TOKENS if found is None else found


def min_tokens_for(
    capability: tuple[int, int], k: int, n: int, precision: str, compiled: bool = False
) -> int:
    """Rows from which a (K -> N) SwitchBack linear of `precision` runs 8-bit on a GPU of `capability`
    (NEVER: it always runs the 16-bit matmul); `compiled`: the threshold measured under torch.compile. See the
    module docstring for how the table is searched."""
    return _min_tokens(tuple(capability), k, n, precision, TABLE_DIR, bool(compiled))


def min_tokens_range(
    capability: tuple[int, int], shapes: tuple[tuple[int, int], ...], precision: str, compiled: bool = False
) -> tuple[int, int]:
    """(lowest, highest) of min_tokens_for over the (K, N) `shapes`: one call where a caller asks for several
    linears (an encoder layer's six), so that Dynamo makes one constant call of it, not one per shape."""
    floors = [min_tokens_for(capability, k, n, precision, compiled) for k, n in shapes]
    return min(floors), max(floors)


# What torch.compiler.assume_constant_result does, without importing torch._dynamo (which imports triton):
# Dynamo calls these once while tracing and keeps the answer as a constant, so the file reads and caches
# never reach the graph (they would be graph breaks).
cuda_capability._dynamo_marked_constant = True
min_tokens_for._dynamo_marked_constant = True
min_tokens_range._dynamo_marked_constant = True


__all__ = [
    "FALLBACK_MIN_TOKENS",
    "NEVER",
    "TABLE_DIR",
    "cuda_capability",
    "load_table",
    "lookup",
    "min_tokens_for",
    "min_tokens_range",
    "table_name",
]
