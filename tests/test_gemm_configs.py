"""kernels/gemm_configs: the measured tile table that lets the 8-bit GEMM skip autotuning.

CPU tests: the shipped table loads, agrees with the measurement it was written from, names only configs of the
kernel's own list, and the lookup buckets M the way the autotuner's key does; a broken table is an error naming
the file and the fix. The launch itself (a table shape runs without the autotuner) is a GPU test in
test_kernels_triton.py.
"""

import json

import pytest
from helpers import HAS_TRITON, REPO, load_script

from hf_switchback.kernels import gemm_configs
from hf_switchback.kernels.gemm_configs import TABLE_DIR, load_table, m_bucket, measured_tile

SM90 = (9, 0)
MEASUREMENT = REPO / "docs/figures/compile_warmup/h100/gemm_configs_3b69f50.json"


def _next_power_of_two(m: int) -> int:
    power = 1
    while power < m:
        power *= 2
    return power


def test_m_bucket_is_the_next_power_of_two():
    for m in [*range(1, 2100), 4928, 19712, 50432, 65536, 65537, 98688]:
        assert m_bucket(m) == _next_power_of_two(m), m


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_m_bucket_matches_the_autotuners_key():
    import triton

    for m in [1, 2, 3, 1023, 1024, 1025, 4928, 32768, 32769, 98688]:
        assert m_bucket(m) == triton.next_power_of_2(m)


def test_shipped_sm90_table_is_the_measurement_it_was_written_from():
    bench = load_script("benchmarks/bench_linear.py")
    payload = json.loads(MEASUREMENT.read_text())
    expected = bench.tile_table(payload["rows"], [bench.tile_of(c) for c in payload["configs"]])
    shipped = json.loads((TABLE_DIR / "sm90.json").read_text())
    assert shipped["entries"] == expected
    assert len(load_table(TABLE_DIR / "sm90.json")) == len(expected) == 30  # every (N, K, M bucket) measured
    # the point of the table: each pick within 3% of the fastest config at every shape it was timed at
    assert max(e["worst_ratio"] for e in shipped["entries"]) <= 1.03


@pytest.mark.skipif(
    not HAS_TRITON, reason="needs triton (the kernel's config list lives in kernels/matmul.py)"
)
def test_every_table_tile_is_a_config_of_the_kernels_list():
    from hf_switchback.kernels import matmul

    tiles = set(load_table(TABLE_DIR / "sm90.json").values())
    assert tiles <= set(matmul._TILE_SHAPES)
    # and the list the measurement timed is that list, in that order (tile_table indexes it)
    payload = json.loads(MEASUREMENT.read_text())
    bench = load_script("benchmarks/bench_linear.py")
    assert [bench.tile_of(c) for c in payload["configs"]] == list(matmul._TILE_SHAPES)


def test_lookup_serves_a_whole_m_bucket_and_nothing_unmeasured():
    # ViT-B/16 b256 fc2 grad-input: (50432 tokens, N 768, K 3072), M bucket 65536
    tile = measured_tile(SM90, "int8", "bfloat16", 50432, 768, 3072)
    assert tile is not None and len(tile) == 5
    for m in (32769, 40000, 65536):  # other batch sizes of the same bucket: the same kernel
        assert measured_tile(SM90, "int8", "bfloat16", m, 768, 3072) == tile
    assert measured_tile(SM90, "int8", "bfloat16", 65537, 768, 3072) is None  # bucket 131072: not measured
    assert measured_tile(SM90, "int8", "bfloat16", 50432, 768, 3000) is None  # unmeasured K
    assert measured_tile(SM90, "float8_e4m3fn", "bfloat16", 50432, 768, 3072) is None  # fp8 not measured
    assert measured_tile(SM90, "int8", "float32", 50432, 768, 3072) is None
    assert measured_tile((8, 0), "int8", "bfloat16", 50432, 768, 3072) is None  # no Ampere table
    assert measured_tile(SM90, "int8", "bfloat16", 0, 768, 3072) is None


def _write(tmp_path, entries, **header):
    table = {"format": gemm_configs.FORMAT, "entries": entries, **header}
    (tmp_path / "sm90.json").write_text(json.dumps(table))
    load_table.cache_clear()  # a new file at a path the cache may have seen
    return tmp_path


ENTRY = {"a": "int8", "out": "bfloat16", "n": 64, "k": 128, "m_bucket": 2048, "tile": [64, 128, 128, 4, 4]}


def test_a_table_of_ones_own_is_read_from_its_folder(tmp_path):
    folder = _write(tmp_path, [ENTRY])
    assert measured_tile(SM90, "int8", "bfloat16", 1500, 64, 128, table_dir=folder) == (64, 128, 128, 4, 4)
    assert measured_tile((8, 9), "int8", "bfloat16", 1500, 64, 128, table_dir=folder) is None  # no sm89.json


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "is unreadable"),
        (json.dumps({"format": 99, "entries": []}), "format=1"),
        (json.dumps({"format": 1, "entries": [{**ENTRY, "tile": [64, 128, 128, 4]}]}), "tile must be"),
        (json.dumps({"format": 1, "entries": [{**ENTRY, "tile": [64, 128, 128, 4, True]}]}), "tile must be"),
        (json.dumps({"format": 1, "entries": [{**ENTRY, "m_bucket": 3000}]}), "power of two"),
        (json.dumps({"format": 1, "entries": [{"a": "int8"}]}), "needs a, out, n, k, m_bucket and tile"),
    ],
    ids=["json", "format", "short-tile", "bool-tile", "bucket", "fields"],
)
def test_a_broken_table_is_an_error_naming_file_and_fix(tmp_path, content, message):
    (tmp_path / "sm90.json").write_text(content)
    load_table.cache_clear()
    with pytest.raises(ValueError, match=message) as err:
        measured_tile(SM90, "int8", "bfloat16", 1500, 64, 128, table_dir=tmp_path)
    assert str(tmp_path / "sm90.json") in str(err.value)
    assert "bench_linear.py" in str(err.value) or "entry 0" in str(err.value)
