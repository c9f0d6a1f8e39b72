"""min_tokens=None on CUDA: each layer's threshold from the measured crossover table of its GPU (kernels/crossover).

The tables here are fabricated in tmp_path (crossover.TABLE_DIR is monkeypatched), and CPU tests pretend to be on
an sm90 GPU by monkeypatching crossover.cuda_capability, so the lookup and the layer's choice of path run in CI.
"""

import json

import pytest
import torch
from helpers import KernelSpy
from torch import nn

from hf_switchback import SwitchBackConfig, SwitchBackLinear, precision_summary
from hf_switchback.functional import AUTO_MIN_TOKENS_CUDA, switchback_mlp, token_floor, token_floor_range
from hf_switchback.kernels import crossover

HOPPER = (9, 0)
# (precision, K, N) -> crossover (None: 8-bit never paid)
FAKE = {
    ("int8", 768, 768): 8192,
    ("int8", 1024, 1024): 4096,
    ("int8", 768, 3072): 16384,
    ("int8", 3072, 768): None,
    ("int8", 48, 192): 4,
    ("int8", 192, 48): None,
    ("fp8", 768, 3072): 2048,
}


def write_table(directory, capability=HOPPER, entries=None) -> None:
    """A table in the format benchmarks/bench_linear.py --mode crossover writes (only the fields the loader reads)."""
    precisions: dict = {}
    for (precision, k, n), value in (FAKE if entries is None else entries).items():
        precisions.setdefault(precision, {})[f"{k}x{n}"] = {"K": k, "N": n, "crossover": value}
    data = {"format": crossover.FORMAT, "precisions": precisions}
    (directory / crossover.table_name(capability)).write_text(json.dumps(data))


@pytest.fixture
def table(tmp_path, monkeypatch):
    write_table(tmp_path)
    monkeypatch.setattr(crossover, "TABLE_DIR", tmp_path)
    return tmp_path


@pytest.fixture
def on_hopper(monkeypatch):
    """Every device looks like an sm90 GPU to the token floor (a constant for torch.compile, like the real one)."""

    def capability(device_type, index):
        return HOPPER

    capability._dynamo_marked_constant = True
    monkeypatch.setattr(crossover, "cuda_capability", capability)


def test_exact_shape_reads_its_own_crossover(table):
    assert crossover.min_tokens_for(HOPPER, 768, 3072, "int8") == 16384
    assert crossover.min_tokens_for(HOPPER, 768, 3072, "fp8") == 2048  # precisions are separate tables
    assert crossover.min_tokens_for(HOPPER, 1024, 1024, "int8") == 4096


def test_null_crossover_means_never_quantize(table):
    assert crossover.min_tokens_for(HOPPER, 3072, 768, "int8") == crossover.NEVER


def test_unmeasured_shape_takes_the_nearest_family_of_its_ratio_class(table):
    # d=896: K*N between 768² and 1024², nearer 1024² in log space
    assert crossover.min_tokens_for(HOPPER, 896, 896, "int8") == 4096
    # d=832 fc1 / fc2: the d=768 family of the same N/K class (fc2's is null, so never)
    assert crossover.min_tokens_for(HOPPER, 832, 3328, "int8") == 16384
    assert crossover.min_tokens_for(HOPPER, 3328, 832, "int8") == crossover.NEVER
    # a fused q/k/v (d -> 3d) rounds into the d -> 4d class
    assert crossover.min_tokens_for(HOPPER, 768, 2304, "int8") == 16384
    # fp8 has only an fc1 entry: d->d shapes have no family there
    assert crossover.min_tokens_for(HOPPER, 768, 768, "fp8") == crossover.FALLBACK_MIN_TOKENS


def test_nearest_family_tie_takes_the_larger_threshold(tmp_path, monkeypatch):
    write_table(tmp_path, entries={("int8", 512, 512): 1024, ("int8", 2048, 2048): 8192})
    monkeypatch.setattr(crossover, "TABLE_DIR", tmp_path)
    assert crossover.min_tokens_for(HOPPER, 1024, 1024, "int8") == 8192  # 4x from both


def test_far_shapes_and_other_ratios_fall_back(table):
    assert crossover.min_tokens_for(HOPPER, 64, 32, "int8") == crossover.FALLBACK_MIN_TOKENS  # too small
    assert crossover.min_tokens_for(HOPPER, 4096, 4096, "int8") == crossover.FALLBACK_MIN_TOKENS  # 16x area
    assert crossover.min_tokens_for(HOPPER, 768, 1536, "int8") == crossover.FALLBACK_MIN_TOKENS  # N/K = 2


def test_gpu_without_a_table_falls_back(table):
    assert not (table / "sm80.json").exists()
    for k, n in ((768, 768), (768, 3072), (3072, 768)):
        assert crossover.min_tokens_for((8, 0), k, n, "int8") == crossover.FALLBACK_MIN_TOKENS == 16384


def test_a_broken_table_is_an_error_not_a_fallback(tmp_path, monkeypatch):
    monkeypatch.setattr(crossover, "TABLE_DIR", tmp_path)
    (tmp_path / "sm90.json").write_text('{"format": 1, "precisions": {"int8": {"8x8": {"K": 8}}}}')
    with pytest.raises(ValueError, match="needs K, N and crossover"):
        crossover.min_tokens_for(HOPPER, 8, 8, "int8")
    (tmp_path / "sm89.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="format=1"):
        crossover.min_tokens_for((8, 9), 8, 8, "int8")


def test_token_floor_applies_the_table_to_default_configs_on_cuda_only(table, on_hopper):
    default = SwitchBackConfig()
    assert token_floor(default, "cuda", (768, 3072)) == 16384
    assert token_floor(default.replace(precision="fp8"), "cuda", (768, 3072)) == 2048
    # a fused MLP runs 8-bit only where both of its linears pay
    assert token_floor(default, "cuda", (768, 768), (1024, 1024)) == 8192
    assert token_floor(default, "cuda", (768, 3072), (3072, 768)) == crossover.NEVER
    # explicit min_tokens overrides the table; other backends never fall back on their own
    assert token_floor(default.replace(min_tokens=0), "cuda", (3072, 768)) == 0
    assert token_floor(default.replace(min_tokens=5), "cuda", (3072, 768)) == 5
    assert token_floor(default.replace(backend="triton"), "cuda", (3072, 768)) == 0
    # memory_efficient keeps its 8-bit saved activations from the old constant on; so do callers without shapes
    assert token_floor(default.replace(memory_efficient=True), "cuda", (3072, 768)) == AUTO_MIN_TOKENS_CUDA
    assert token_floor(default, "cuda") == AUTO_MIN_TOKENS_CUDA


def test_token_floor_range_is_the_lowest_and_highest_floor(table, on_hopper):
    """The fused layer's question (blocks/layer_leaves.plan): is every linear below its floor, or every one above?"""
    default = SwitchBackConfig()
    assert token_floor_range(default, "cuda", (768, 768), (1024, 1024)) == (4096, 8192)
    assert token_floor_range(default, "cuda", (768, 3072), (3072, 768)) == (16384, crossover.NEVER)
    assert token_floor_range(default.replace(min_tokens=5), "cuda", (3072, 768)) == (5, 5)
    assert token_floor_range(default.replace(backend="triton"), "cuda", (3072, 768)) == (0, 0)
    assert token_floor_range(default.replace(memory_efficient=True), "cuda", (768, 768)) == (
        AUTO_MIN_TOKENS_CUDA,
        AUTO_MIN_TOKENS_CUDA,
    )
    for shapes in [((768, 768), (1024, 1024)), ((768, 3072), (3072, 768)), ((768, 3072),)]:
        assert token_floor_range(default, "cuda", *shapes)[1] == token_floor(default, "cuda", *shapes)


def _pair(in_f, out_f):
    """nn.Linear and a default-config SwitchBackLinear with the same weights."""
    plain, twin = nn.Linear(in_f, out_f), nn.Linear(in_f, out_f)
    twin.load_state_dict(plain.state_dict())
    return plain, SwitchBackLinear.from_linear(twin)


def test_default_layer_of_a_never_paying_shape_runs_the_16bit_matmul(table, on_hopper, monkeypatch):
    spy = KernelSpy.install(monkeypatch)
    never, pays = _pair(192, 48), _pair(48, 192)  # 192 -> 48: null crossover; 48 -> 192: from 4 rows
    x = torch.randn(3, 50, 192, requires_grad=True)
    plain, sb = never
    torch.testing.assert_close(sb(x), plain(x), rtol=0, atol=0)  # exact: F.linear ran
    sb(x).sum().backward()
    assert spy.calls == []
    plain, sb = pays
    x = torch.randn(3, 50, 48)
    assert not torch.equal(sb(x), plain(x))
    assert "scaled_matmul" in spy.names()
    # below its crossover the paying shape is exact too
    spy.calls.clear()
    torch.testing.assert_close(sb(x[0, :3]), plain(x[0, :3]), rtol=0, atol=0)
    assert spy.calls == []


def test_fused_mlp_stays_16bit_when_one_linear_never_pays(table, on_hopper, monkeypatch):
    spy = KernelSpy.install(monkeypatch)
    fc1, fc2 = nn.Linear(48, 192), nn.Linear(192, 48)
    x = torch.randn(16448, 48)  # above the fallback constant: only the table keeps it 16-bit
    out = switchback_mlp(x, fc1.weight, fc1.bias, fc2.weight, fc2.bias, "gelu", SwitchBackConfig())
    torch.testing.assert_close(out, fc2(nn.functional.gelu(fc1(x))), rtol=0, atol=0)
    assert spy.calls == []


def test_table_threshold_is_a_compile_time_constant(table, on_hopper):
    import torch._dynamo as dynamo

    plain, sb = _pair(192, 48)
    x = torch.randn(16448, 192)
    explanation = dynamo.explain(sb)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(sb, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), plain(x), rtol=0, atol=0)


def test_a_fused_layer_reads_its_floors_as_one_constant_under_dynamo(tmp_path, monkeypatch, on_hopper):
    """The default config on a GPU with a table: the fused encoder layer asks the table for its six linears'
    floors in one constant call while Dynamo traces (no graph break), and below them all runs the stock layer's
    calls (blocks/layer_16bit.py), as the eager layer does."""
    import torch._dynamo as dynamo
    from helpers import tiny_pair_model

    from hf_switchback import apply_switchback
    from hf_switchback.blocks import layer_16bit

    write_table(tmp_path, entries={("int8", 64, 64): 64, ("int8", 64, 128): 512, ("int8", 128, 64): None})
    monkeypatch.setattr(crossover, "TABLE_DIR", tmp_path)
    asked = []
    answer = crossover.min_tokens_range

    def counted(*args):
        asked.append(args)
        return answer(*args)

    counted._dynamo_marked_constant = True
    monkeypatch.setattr(crossover, "min_tokens_range", counted)
    stock_calls = []
    stock_forward = layer_16bit.forward
    monkeypatch.setattr(layer_16bit, "forward", lambda *args: stock_calls.append(1) or stock_forward(*args))
    layer = apply_switchback(tiny_pair_model("clip"), SwitchBackConfig()).vision_model.encoder.layers[0]
    h = torch.randn(2, 16, 64)  # 32 rows: below the lowest floor, 64
    want = layer(h, None)
    assert asked[-1] == (HOPPER, ((64, 64),) * 4 + ((64, 128), (128, 64)), "int8", False)
    dynamo.reset()
    got = torch.compile(layer, backend="eager", fullgraph=True)(h, None)
    assert asked[-1][-1] is True  # traced: the thresholds measured under torch.compile
    assert len(stock_calls) == 2 and torch.equal(got, want)


def test_compiled_thresholds_apply_while_dynamo_traces(tmp_path, monkeypatch, on_hopper):
    """A table with `crossover_compiled` (bench_linear.py measures the layer eager and compiled): eager calls read
    `crossover`, a call traced by torch.compile reads `crossover_compiled`; an entry without it uses `crossover`."""
    import torch._dynamo as dynamo

    data = {
        "format": crossover.FORMAT,
        "precisions": {
            "int8": {
                "192x48": {"K": 192, "N": 48, "crossover": None, "crossover_compiled": 64},
                "48x192": {"K": 48, "N": 192, "crossover": 64},
            }
        },
    }
    (tmp_path / crossover.table_name(HOPPER)).write_text(json.dumps(data))
    monkeypatch.setattr(crossover, "TABLE_DIR", tmp_path)
    assert crossover.min_tokens_for(HOPPER, 192, 48, "int8") == crossover.NEVER
    assert crossover.min_tokens_for(HOPPER, 192, 48, "int8", compiled=True) == 64
    assert crossover.min_tokens_for(HOPPER, 48, 192, "int8", compiled=True) == 64
    assert token_floor(SwitchBackConfig(), "cuda", (192, 48)) == crossover.NEVER

    spy = KernelSpy.install(monkeypatch)
    plain, sb = _pair(192, 48)
    x = torch.randn(128, 192)
    torch.testing.assert_close(sb(x), plain(x), rtol=0, atol=0)  # eager: never pays, exact 16-bit
    assert spy.calls == []
    dynamo.reset()
    compiled = torch.compile(sb, backend="eager", fullgraph=True)
    out = compiled(x)
    assert "scaled_matmul" in spy.names()  # traced: from 64 rows, the 8-bit path
    assert not torch.equal(out, plain(x))
    torch.testing.assert_close(out, plain(x), rtol=0.1, atol=0.05)

    # what a layer runs is reported for both: its repr and the model's summary
    assert "runs=16-bit (int8 never pays here) (under torch.compile: 16-bit below 64 tokens)" in repr(sb)
    summary = precision_summary(nn.Sequential(sb), "cpu")
    assert "1 always fall back to 16-bit" in summary
    assert (
        "under torch.compile: 0 of 1 swapped layers run int8 at any token count; 1 run int8 from 64"
        in summary
    )
    assert "under torch.compile" not in repr(_pair(48, 192)[1])  # one threshold for both: said once


@pytest.mark.gpu
def test_real_gpu_reads_the_table_of_its_capability(tmp_path, monkeypatch):
    major, minor = torch.cuda.get_device_capability()
    write_table(tmp_path, (major, minor), {("int8", 256, 128): None, ("int8", 128, 256): 64})
    monkeypatch.setattr(crossover, "TABLE_DIR", tmp_path)
    lin = nn.Linear(256, 128).to("cuda", torch.bfloat16)
    sb = SwitchBackLinear.from_linear(nn.Linear(256, 128).to("cuda", torch.bfloat16))
    sb.load_state_dict(lin.state_dict())
    x = torch.randn(AUTO_MIN_TOKENS_CUDA * 2, 256, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(sb(x), lin(x))  # never pays: 16-bit even far above the fallback constant
    assert token_floor(SwitchBackConfig(), x.device, (128, 256)) == 64


def test_the_wheel_carries_the_tables(tmp_path):
    """`pip install .` (not -e) must ship the JSON tables: setuptools leaves non-Python files out of a wheel
    unless pyproject.toml's package-data names them. Builds a wheel of a copy of the tree with a table added."""
    import shutil
    import subprocess
    import sys
    import zipfile

    from helpers import REPO

    pytest.importorskip("setuptools")
    shutil.copytree(
        REPO / "src", tmp_path / "src", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__")
    )
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, tmp_path / name)
    write_table(tmp_path / "src/hf_switchback/kernels/crossover")
    build = "from setuptools import build_meta; print(build_meta.build_wheel('dist'))"
    proc = subprocess.run(
        [sys.executable, "-c", build], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    wheel = tmp_path / "dist" / proc.stdout.strip().splitlines()[-1]
    assert "hf_switchback/kernels/crossover/sm90.json" in zipfile.ZipFile(wheel).namelist()


def test_the_shipped_hopper_table_is_complete_and_its_crossovers_follow_its_own_timings():
    """sm90.json is a measured table (benchmarks/bench_linear.py --mode crossover on an H100): complete, for sm90, every CLIP
    family of d = 512..1280 in both precisions, and each crossover is the smallest token count from which the
    recorded speed-up (bf16 ms / SwitchBack ms) is at least the margin at that count and every larger one
    (recomputed here from the timings), which is what the default config then reads."""
    path = crossover.TABLE_DIR / "sm90.json"
    data = json.loads(path.read_text())
    assert data["complete"] and data["capability"] == "sm90" and data["format"] == crossover.FORMAT
    margin, tokens = data["margin"], sorted(data["tokens"])
    for precision in ("int8", "fp8"):
        entries = data["precisions"][precision]
        for d in (512, 768, 1024, 1280):
            for k, n in ((d, d), (d, 4 * d), (4 * d, d)):
                entry = entries[f"{k}x{n}"]
                for compiled, suffix in ((False, ""), (True, "_compiled")):  # eager, then each layer compiled
                    bf16, switchback = entry[f"bf16{suffix}_ms"], entry[f"switchback{suffix}_ms"]
                    speedup = {m: bf16[str(m)] / switchback[str(m)] for m in tokens}
                    paying = [
                        m for i, m in enumerate(tokens) if all(speedup[t] >= margin for t in tokens[i:])
                    ]
                    crossover_m = entry[f"crossover{suffix}"]
                    assert crossover_m == (paying[0] if paying else None), (precision, k, n, compiled)
                    expected = crossover.NEVER if crossover_m is None else crossover_m
                    assert crossover.min_tokens_for(HOPPER, k, n, precision, compiled) == expected


def test_the_hopper_default_runs_8bit_where_the_model_rows_gained():
    """What README's default row says, read from the shipped table under torch.compile: ViT-H/14's vision
    linears (width 1,280) 8-bit from batch 128 (32,896 tokens) but not at batch 64 (16,448), ViT-L/14's (1,024)
    at batch 256 (65,792), widths 768 (ViT-B/16, SigLIP B/16) and 512 (text towers) never."""
    vit_h = ((1280, 1280), (1280, 5120), (5120, 1280))
    vit_l = ((1024, 1024), (1024, 4096), (4096, 1024))
    narrow = ((768, 768), (768, 3072), (3072, 768), (512, 512), (512, 2048), (2048, 512))
    for precision in ("int8", "fp8"):
        for shapes, pays_at, not_at in ((vit_h, 128 * 257, 64 * 257), (vit_l, 256 * 257, 128 * 257)):
            for k, n in shapes:
                floor = crossover.min_tokens_for(HOPPER, k, n, precision, True)
                assert not_at < floor <= pays_at, (precision, k, n, floor)
        for k, n in narrow:
            assert crossover.min_tokens_for(HOPPER, k, n, precision, True) == crossover.NEVER
