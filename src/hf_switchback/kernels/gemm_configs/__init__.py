"""Measured tile configs of the portable 8-bit GEMM: which config to launch at a shape, so that no autotuning runs.

Autotuning compiles every candidate config and benchmarks it at each new (M bucket, N, K): seconds of a compiled
run's first step per GEMM shape (BENCHMARKS.md, compile warm-up). Where a table measured on this GPU already
names the fastest config for the shape, kernels/matmul.py launches it directly; everywhere else (another GPU,
shape, dtype or operand layout) the autotuner runs as before, with its result kept in Triton's on-disk cache
(eager) or Inductor's (compiled; carried to other machines by compile_cache.save_compile_artifacts).

Tables are this folder's `sm<major><minor>.json`, written by
`benchmarks/bench_linear.py --mode gemm_configs --write_table` from its per-shape timings of every config: for each (operand dtype, output dtype, N, K, M bucket) measured,
the config with the smallest worst ratio to the fastest one over the timed shapes of that key. M is bucketed to
the next power of two (as the autotuner's key is): one config serves every token count of a bucket, so a run
whose batch or sequence length varies still launches one kernel specialization per (N, K) and bucket. The
timings are of K-major operands (a (M, K) and b (N, K) contiguous), the layout SwitchBack passes; other strides
are not looked up.

This module is a leaf: it imports nothing from the package but kernels/shipped_tables.py, and never triton.
"""

from __future__ import annotations

import functools
from pathlib import Path

from ..shipped_tables import read_table

TABLE_DIR = Path(__file__).resolve().parent
FORMAT = 1
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), the order of kernels/matmul.py's _TILE_SHAPES
Tile = tuple[int, int, int, int, int]


def table_name(capability: tuple[int, int]) -> str:
    """File name of the table for a compute capability, e.g. (9, 0) -> "sm90.json"."""
    return f"sm{capability[0]}{capability[1]}.json"


def m_bucket(m: int) -> int:
    """The M bucket of a GEMM with m rows: the next power of two (triton.next_power_of_2), m >= 1."""
    return 1 << (m - 1).bit_length()


def _tile(value, where: str) -> Tile:
    if (
        not isinstance(value, list)
        or len(value) != 5
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        raise ValueError(
            f"{where}: tile must be [BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages], got {value!r}"
        )
    return tuple(value)


@functools.cache
def load_table(path: Path) -> dict[tuple[str, str, int, int, int], Tile] | None:
    """{(operand dtype, output dtype, N, K, M bucket): tile} of a table file, or None when it is absent.

    A file that exists but is not a table is an error: a shipped table must never be silently ignored.
    """
    writer = "benchmarks/bench_linear.py --mode gemm_configs --write_table"
    data = read_table(path, "GEMM config table", FORMAT, "entries", list, writer)
    if data is None:
        return None
    table = {}
    for i, entry in enumerate(data["entries"]):
        where = f"GEMM config table {path}, entry {i}"
        try:
            key = (
                str(entry["a"]),
                str(entry["out"]),
                int(entry["n"]),
                int(entry["k"]),
                int(entry["m_bucket"]),
            )
            tile = _tile(entry["tile"], where)
        except (KeyError, TypeError) as err:
            raise ValueError(f"{where}: needs a, out, n, k, m_bucket and tile ({err!r})") from err
        if key[4] != m_bucket(key[4]):
            raise ValueError(f"{where}: m_bucket must be a power of two, got {key[4]}")
        table[key] = tile
    return table


def measured_tile(
    capability: tuple[int, int],
    a_dtype: str,
    out_dtype: str,
    m: int,
    n: int,
    k: int,
    table_dir: Path = TABLE_DIR,
) -> Tile | None:
    """The measured config for an (m, k) x (n, k) GEMM of K-major `a_dtype` operands ("int8", "float8_e4m3fn")
    writing `out_dtype` ("bfloat16") on a GPU of `capability`, or None where nothing was measured (autotune)."""
    table = load_table(table_dir / table_name(tuple(capability)))
    if table is None or m < 1:
        return None
    return table.get((a_dtype, out_dtype, n, k, m_bucket(m)))
