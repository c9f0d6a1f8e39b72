"""The benchmark scripts run end to end on the CPU (tiny models), so a broken script fails CI, not a GPU run."""

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import helpers
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


# the scripts a user runs (common.py, step_profile.py, host_waits.py and compile_stages.py are their helpers)
SCRIPTS = sorted(
    p.name
    for p in [*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "benchmarks").glob("*.sh")]
    if p.name not in ("common.py", "step_profile.py", "host_waits.py", "compile_stages.py")
)


def load_script(name: str):
    return helpers.load_script(f"benchmarks/{name}.py")


def run_script(args: list[str], timeout: int = 120, **env_vars: str) -> str:
    """Run benchmarks/X.py with this Python (X.sh with bash, $PYTHON set to this Python) from the repository."""
    env = {"PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.update(PATH="/usr/bin:/bin", PYTHON=sys.executable, **env_vars)
    runner = ["bash"] if args[0].endswith(".sh") else [sys.executable]
    proc = subprocess.run(
        [*runner, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_benchmark_script_answers_help(script):
    assert "usage:" in run_script([f"benchmarks/{script}", "--help"], timeout=60)


@pytest.mark.slow
def test_multi_gpu_sh_cpu_smoke_same_loss_phase(tmp_path):
    """SMOKE=1 (tiny, gloo) of the same-loss phase: 1 process x 2B and 2 processes x B launched through
    accelerate, summarized by multi_gpu_summary.py; the same samples per step give the same losses."""
    out, work = tmp_path / "out", tmp_path / "work"
    run_script(
        ["benchmarks/multi_gpu.sh"], timeout=300, SMOKE="1", PHASES="same", OUT=str(out), WORK=str(work)
    )
    same = json.loads((out / "summary.json").read_text())["same_loss"]
    assert same["steps_compared"] == 4 and same["max_abs_diff_step1"] < 1e-5
    assert same["max_abs_diff_all"] < 1e-2  # later steps: float32 reductions in another order, then updates
    assert "START same_loss_2gpu" in (out / "multi_gpu.log").read_text()


def test_multi_gpu_summary_reads_a_work_folder(tmp_path):
    """A finished run and a failed one (no results): both listed in summary.json, no model to load."""
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "ddp2").mkdir(parents=True)
    (work / "ddp2" / "all_results.json").write_text(json.dumps({"train_loss": 2.5, "num_processes": 2}))
    (work / "runs.tsv").write_text("ddp2\t0\t31\nzero3\t1\t5\n")
    run_script(["benchmarks/multi_gpu_summary.py", str(work), str(out)])
    runs = json.loads((out / "summary.json").read_text())["runs"]
    assert runs["ddp2"]["train_loss"] == 2.5 and runs["ddp2"]["seconds"] == 31
    assert runs["zero3"]["rc"] == "1" and "train_loss" not in runs["zero3"]
    assert (out / "summary.md").stat().st_size > 0


@pytest.mark.slow
def test_bench_train_cpu_smoke(tmp_path):
    out = tmp_path / "rows.json"
    variants = ["bf16", "int8", "int8-lora"]
    flags = ["--device", "cpu", "--tiny", "--models", "vit-b-16", "--variants", *variants]
    stdout = run_script(
        ["benchmarks/bench_train.py", *flags, "--steps", "1", "--warmup", "0", "--json", str(out)]
    )
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == variants
    for row in rows:
        assert "error" not in row, row
        assert row["ms_per_step"] > 0 and math.isfinite(row["loss"]) and row["batch"] == 8
    lines = stdout.splitlines()
    assert any(line.startswith("vit-b-16") and " int8 " in line and "x" in line for line in lines)


def test_bench_train_time_budget_skips_and_keeps_rows(tmp_path, monkeypatch):
    bench = load_script("bench_train")
    out = tmp_path / "rows.json"
    argv = ["bench_train.py", "--device", "cpu", "--tiny", "--models", "vit-b-16", "vit-l-14"]
    argv += ["--variants", "bf16", "int8+compile", "--time_budget_s", "1e-9", "--json", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 4 and all(r["status"] == "skipped" for r in rows)
    # a failing row is recorded with its error and the next row still runs
    args = bench.argparse.Namespace(device="cpu", tiny=True, batch=None, compile="model")
    with pytest.raises(ValueError, match="unknown variant"):
        bench.run_row("vit-b-16", "int4", args)


def test_bench_train_processes_interleave_rows_and_report_each_rows_median(tmp_path, monkeypatch, capsys):
    """--processes 3: each row runs in 3 processes of its own, every row once before any runs again, each child
    with one model and one variant and the other flags as given; each row reports its median process."""
    bench = load_script("bench_train")
    calls, step_ms = [], {"bf16": [30.0, 10.0, 20.0], "int8": [5.0, 50.0, 40.0]}

    written = []  # the --json file's rows as each child starts: a killed run keeps the finished processes

    def fake_process(argv, json_path, env=None, timeout=None):
        variant = argv[argv.index("--variants") + 1]
        rows_so_far = json.loads(out.read_text())["rows"] if out.exists() else []
        written.append([(r["variant"], r["processes"]) for r in rows_so_far])
        calls.append(argv)
        ms = step_ms[variant][sum(variant in c for c in calls) - 1]
        return dict(
            model="vit-b-16",
            variant=variant,
            batch=8,
            ms_per_step=ms,
            samples_per_s=8e3 / ms,
            peak_mem_gib=None,
            first_step_s=1.0,
        )

    monkeypatch.setattr(bench.common, "row_in_process", fake_process)
    out = tmp_path / "rows.json"
    argv = ["bench_train.py", "--device", "cpu", "--tiny", "--models", "vit-b-16"]
    argv += ["--variants", "bf16", "int8", "--processes", "3", "--steps", "2", "--json", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    assert [c[c.index("--variants") + 1] for c in calls] == ["bf16", "int8"] * 3  # interleaved
    for child in calls:
        assert "--processes" not in child and child.count("--json") == 1 and child.count("--models") == 1
        assert child[child.index("--steps") + 1] == "2" and "--tiny" in child and str(out) not in child
        assert child[child.index("--models") + 1 :][:2] == ["vit-b-16", "--variants"]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["variant"], r["ms_per_step"], r["processes"]) for r in rows] == [
        ("bf16", 20.0, 3),
        ("int8", 40.0, 3),
    ]
    assert rows[1]["ms_per_step_processes"] == [5.0, 50.0, 40.0]
    assert "vit-b-16 int8: ms/step per process 5.0 / 50.0 / 40.0" in capsys.readouterr().out
    assert written[:3] == [[], [("bf16", 1)], [("bf16", 1), ("int8", 1)]]
    assert written[-1] == [("bf16", 3), ("int8", 2)]


def test_bench_train_processes_median_row_and_refusals(monkeypatch, capsys):
    bench = load_script("bench_train")
    failed = dict(model="m", variant="v", status="error", error="exit 1")
    assert bench.median_row([failed, failed]) == failed  # nothing measured: the failure says why
    both = bench.median_row([failed, dict(failed, status="ok", ms_per_step=3.0), dict(ms_per_step=1.0)])
    assert (
        both["ms_per_step"] == 1.0 and both["ms_per_step_processes"] == [3.0, 1.0] and both["processes"] == 3
    )
    for extra, message in (
        (["--processes", "0"], "at least 1"),
        (["--processes", "2", "--profile", "d"], "drop"),
    ):
        monkeypatch.setattr(sys, "argv", ["bench_train.py", "--device", "cpu", "--tiny", *extra])
        with pytest.raises(SystemExit):
            bench.main()
        assert message in capsys.readouterr().err


def test_common_gpu_clocks_reads_the_medians_of_nvidia_smi_samples(tmp_path, monkeypatch):
    """A stand-in nvidia-smi on PATH prints samples until stopped: the block's medians, and the query asks for
    the given GPU; disabled or without nvidia-smi nothing is sampled."""
    common = load_script("common")
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        '#!/bin/sh\necho "$@" > "$(dirname "$0")/argv"\n'
        'printf "1755, 690.5\\n1935, 689.0\\n[N/A], 12\\n1800, 700.0\\n"\nexec sleep 30\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    with common.gpu_clocks(True, gpu="3", interval_ms=50) as clocks:
        time.sleep(0.5)  # the stand-in has printed its samples
    assert clocks == dict(sm_clock_mhz=1800.0, power_w=690.5, clock_samples=3)
    argv = (tmp_path / "argv").read_text().split()
    assert argv[:2] == ["-i", "3"] and "--query-gpu=clocks.sm,power.draw" in argv and "-lms=50" in argv
    with common.gpu_clocks(False) as off:
        pass
    assert off == {}
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with common.gpu_clocks(True, gpu="0") as missing:
        pass
    assert missing == {}


def test_common_without_flags_drops_options_and_their_values():
    common = load_script("common")
    argv = ["--models", "a", "b", "--tiny", "--json=x.json", "--steps", "3", "--variants", "bf16", "int8"]
    kept = common.without_flags(argv, {"--models", "--variants", "--json"})
    assert kept == ["--tiny", "--steps", "3"]


def test_bench_train_refuses_per_layer_cuda_graphs_with_checkpointing(monkeypatch, capsys):
    bench = load_script("bench_train")
    argv = [
        "bench_train.py",
        "--device",
        "cpu",
        "--tiny",
        "--variants",
        "bf16+ckpt+compile",
        "--compile",
        "layers",
    ]
    argv += ["--compile_mode", "reduce-overhead"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_info:
        bench.main()
    assert exit_info.value.code == 2
    assert "+ckpt rows needs --compile model" in capsys.readouterr().err


def test_bench_train_profile_prints_the_grouped_table_and_writes_json(tmp_path, monkeypatch, capsys):
    """--profile on the CPU (CPU ops stand in for kernels): the family table is printed and saved as JSON."""
    bench = load_script("bench_train")
    argv = ["bench_train.py", "--device", "cpu", "--tiny", "--models", "vit-b-16", "--variants", "bf16@4"]
    argv += ["--steps", "1", "--warmup", "0", "--profile", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    out = capsys.readouterr().out
    assert "GPU ms/step" in out and "16-bit GEMM" in out and "norm + elemen" in out
    saved = json.loads((tmp_path / "vit-b-16_bf16_b4.json").read_text())
    assert set(saved["ms"]) == set(bench.step_profile.FAMILIES)
    assert saved["ms"]["16-bit GEMM"]["forward"] > 0  # aten::mm / addmm stand in for the GEMM kernels
    assert saved["gpu_ms_per_step"] == pytest.approx(sum(sum(v.values()) for v in saved["ms"].values()))
    assert saved["top_kernels"][0]["ms"] > 0 and saved["free_step"]["busy_ms"] > 0


def test_host_waits_splits_the_gaps_the_host_caused_from_the_rest():
    """A gap whose next kernel started right after its launch returned is the host's, charged to the host ops
    around that launch; a gap before a kernel launched long before is the GPU side's."""
    waits = load_script("host_waits")

    def op(name, ts, dur, cat="cpu_op", tid=1, **args):
        return dict(ph="X", name=name, ts=ts, dur=dur, cat=cat, tid=tid, args=args)

    trace = dict(
        traceEvents=[
            op("step", 0, 1000, cat="user_annotation"),
            op("fast_op", 0, 20),
            op("cudaLaunchKernel", 5, 5, cat="cuda_runtime", correlation=1),
            op("slow_op", 30, 400),
            op("python_work", 40, 300),
            op("cudaLaunchKernel", 420, 5, cat="cuda_runtime", correlation=2),
            op("cudaLaunchKernel", 426, 5, cat="cuda_runtime", correlation=3),
            op("k1", 10, 100, cat="kernel", tid=7, correlation=1),  # ends at 110
            op("k2", 440, 50, cat="kernel", tid=7, correlation=2),  # 330 us gap: launched at 425, late
            op("k3", 800, 50, cat="kernel", tid=7, correlation=3),  # 310 us gap: launched at 431, not late
        ]
    )
    found = waits.host_waits(trace)
    assert found["host_late_ms"] == pytest.approx(0.33) and found["gpu_side_ms"] == pytest.approx(0.31)
    assert found["host_late_by_launching_op"] == [dict(op="step > slow_op", ms=pytest.approx(0.33), gaps=1)]
    gap = found["largest_host_gaps"][0]
    assert (gap["before"], gap["after"], gap["launched_in"]) == ("k1", "k2", ["step", "slow_op"])
    assert gap["host_ms_between_launches"] == pytest.approx(0.415)
    assert [o["op"] for o in gap["longest_host_ops_between"]] == ["slow_op", "python_work"]
    assert waits.host_waits(trace, after_us=900) == {}


@pytest.mark.gpu
def test_step_profile_counts_the_synchronizing_calls_of_a_block():
    """torch's sync debug mode inside the block: a .item() is one call the host waits on; launches alone none;
    the mode's own prototype notice is not counted."""
    prof = load_script("step_profile")
    x = torch.ones(1024, device="cuda")
    with prof._synchronizing_calls("cuda") as found:
        (x * 2).sum().item()
    assert int(found[-1].split()[0]) >= 1 and prof.SYNCHRONIZING_CALL in found[0]
    with prof._synchronizing_calls("cuda") as none:
        x.mul_(2)
    assert none == ["0 calls"]
    with prof._synchronizing_calls("cpu") as cpu:
        x.sum().item()
    assert cpu == []


def test_bench_train_models_come_from_configs():
    bench = load_script("bench_train")
    config = bench.clip_config("vit-h-14")
    assert (config.vision_config.hidden_size, config.vision_config.num_hidden_layers) == (1280, 32)
    assert (config.vision_config.patch_size, config.vision_config.image_size) == (14, 224)
    assert (config.text_config.hidden_size, config.text_config.num_hidden_layers, config.projection_dim) == (
        1024,
        24,
        1024,
    )


def test_bench_train_siglip_row_builds_a_switchback_siglip_model():
    from transformers import SiglipModel

    from hf_switchback import switchback_modules

    bench = load_script("bench_train")
    full = bench.clip_config("siglip-b-16")
    assert full.model_type == "siglip" and full.vision_config.patch_size == 16
    assert (full.vision_config.hidden_size, full.text_config.max_position_embeddings) == (768, 64)
    model = bench.build_model(bench.clip_config("siglip-b-16", tiny=True), "int8", False, "layers", "cpu")
    assert isinstance(model, SiglipModel) and len(switchback_modules(model)) == 2 * 2 * 6
    ids, pixels = torch.randint(4, 64, (2, 64)), torch.randn(2, 3, 32, 32)
    assert torch.isfinite(model(input_ids=ids, pixel_values=pixels, return_loss=True).loss)


def test_bench_memory_cpu_smoke_and_variant_grammar(tmp_path, monkeypatch, capsys):
    """Eager rows of bench_memory.py on a tiny model, in process (compile rows cost minutes on the CI CPUs)."""
    bench = load_script("bench_memory")
    assert bench.parse_variant("bf16+budget0.5+compile") == ("bf16", False, 0.5, True, None)
    assert bench.parse_variant("int8-memeff-fused+ckpt") == ("int8-memeff-fused", True, None, False, None)
    # SwitchBack with selective recompute on top, and a row's own batch
    assert bench.parse_variant("int8-memeff-unfused+budget0.8+compile@128") == (
        "int8-memeff-unfused",
        False,
        0.8,
        True,
        128,
    )
    assert bench.parse_variant("torchao-float8-rowwise+compile").base == "torchao-float8-rowwise"
    for bad in ("bf16+budget0.5", "bf16+budget2+compile", "int4", "bf16+fast", "bf16@0", "bf16@x", "bf16@-8"):
        with pytest.raises(ValueError):
            bench.parse_variant(bad)
    out = tmp_path / "mem.json"
    argv = ["bench_memory.py", "--device", "cpu", "--tiny", "--models", "vit-b-16", "--steps", "1"]
    argv += ["--warmup", "0", "--variants", "bf16+ckpt", "int8-memeff-fused@4", "--json", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    rows = json.loads(out.read_text())["rows"]
    assert [(r["variant"], r["batch"]) for r in rows] == [("bf16+ckpt", 8), ("int8-memeff-fused@4", 4)]
    for row in rows:
        assert "error" not in row, row
        assert row["samples_per_s"] > 0 and math.isfinite(row["loss"])
    # the checkpointed row is compared with itself (the only bf16 row that recomputes)
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("vit-b-16") and "bf16+ckpt" in line and "1.00x" in line for line in lines)


def test_bench_memory_torchao_row_is_skipped_with_its_reason_where_torchao_is_missing(monkeypatch):
    bench = load_script("bench_memory")
    util = bench.bench_train.importlib.util
    real_find_spec = util.find_spec
    monkeypatch.setattr(util, "find_spec", lambda name: None if name == "torchao" else real_find_spec(name))
    args = bench.argparse.Namespace(device="cpu", tiny=True)
    row = bench.attempt("vit-b-16", "torchao-float8-rowwise+compile", 8, args)
    assert row["status"] == "skipped" and "torchao is not installed" in row["error"]


def test_bench_memory_time_budget_skips_runs_that_would_overrun():
    bench = load_script("bench_memory")
    clock = bench.common.Clock(100.0)
    assert clock.allows("vit-h-14")  # nothing known yet
    clock.start -= 60  # 60 s used
    clock.record("vit-h-14", 50.0)  # a ViT-H run took 50 s: another would end at 110 s
    assert not clock.allows("vit-h-14") and clock.allows("vit-b-16")
    row = bench.attempt("vit-h-14", "bf16+compile", 8, bench.argparse.Namespace(device="cpu"), clock)
    assert row["status"] == "skipped" and row["error"].startswith("time budget")
    assert bench.common.Clock(None).allows("vit-h-14")


def test_bench_memory_profile_sees_checkpoint_recompute(tmp_path, monkeypatch):
    """--profile on the CPU (CPU ops stand in for kernels): without checkpointing backward runs exactly 2 GEMMs
    per forward GEMM; full checkpointing re-runs each encoder layer's forward in backward, 6 more GEMMs per layer
    (q, k, v, out_proj, fc1, fc2)."""
    bench = load_script("bench_memory")
    out = tmp_path / "mem.json"
    argv = ["bench_memory.py", "--device", "cpu", "--tiny", "--models", "vit-b-16", "--steps", "1"]
    argv += ["--warmup", "0", "--variants", "bf16", "bf16+ckpt", "int8-memeff@4", "--profile", str(tmp_path)]
    argv += ["--profile_variants", "bf16", "bf16+ckpt"]  # not the int8 row
    monkeypatch.setattr(sys, "argv", [*argv, "--json", str(out)])
    bench.main()
    rows = json.loads(out.read_text())["rows"]
    assert "profile" not in rows[2] and "ms_per_step" in rows[2]
    plain, ckpt = (rows[i]["profile"]["calls_per_step"]["16-bit GEMM"] for i in (0, 1))
    layers = 2 * bench.bench_train.TINY_TOWER["num_hidden_layers"]  # both towers
    assert plain["backward"] == 2 * plain["forward"] > 0
    assert ckpt["backward"] == 2 * ckpt["forward"] + 6 * layers
    saved = json.loads(Path(rows[1]["profile"]["report"]).read_text())
    assert saved["calls_per_step"]["16-bit GEMM"] == rows[1]["profile"]["calls_per_step"]["16-bit GEMM"]


def test_step_profile_families_and_phases():
    prof = load_script("step_profile")
    K = prof.Kernel
    cublas_fp8 = "nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_TNT"  # named like a bf16 one: known by its op
    assert prof.family(cublas_fp8, frozenset({cublas_fp8})) == prof.GEMM_8BIT
    assert prof.family(cublas_fp8) == prof.GEMM_16BIT
    assert prof.family("_scaled_mm_tma_kernel") == prof.GEMM_8BIT
    assert prof.family("_rowwise_colsum_kernel") == prof.QUANT
    assert prof.family("triton_red_fused__to_copy_abs_amax_clamp_div_0") == prof.QUANT
    assert prof.family("triton_poi_fused_add_mul_sigmoid_1") == prof.ELEMENTWISE
    # eager, not Inductor: not a quantize
    assert prof.family("void at::native::clamp_min_kernel") == prof.ELEMENTWISE
    assert prof.family("multi_tensor_apply_kernel<FusedAdamMathFunctor>") == prof.OPTIMIZER
    F, B = prof.FORWARD, prof.BACKWARD
    # two steps: 2 forward GEMMs (3 and 1 ms), 5 backward GEMMs and a split-K helper (a 16-bit GEMM kernel too),
    # flash attention
    kernels = [K("gemm_a", F, 3.0), K("gemm_b", F, 1.0)] + [K("gemm_c", B, 1.0)] * 5
    kernels += [
        K("splitKreduce_kernel", B, 0.5),
        K("flash_fwd_kernel", F, 2.0),
        K("flash_bwd_kernel", B, 2.0),
    ]
    summary = prof.summarize(kernels * 2, steps=2)
    assert summary["calls_per_step"][prof.GEMM_16BIT] == {F: 2, B: 6, prof.OUTSIDE: 0}
    assert summary["ms"][prof.GEMM_16BIT][B] == 5.5 and summary["ms"][prof.ATTENTION] == {
        F: 2,
        B: 2,
        prof.OUTSIDE: 0,
    }
    assert summary["gpu_ms_per_step"] == 13.5
    assert prof.phase_of(5.0, [(0.0, 4.0, F), (4.5, 9.0, B)]) == B
    assert prof.phase_of(4.2, [(0.0, 4.0, F), (4.5, 9.0, B)]) == prof.OUTSIDE


def test_step_profile_idle_time_of_a_free_running_step():
    """Busy = union of kernel intervals (overlaps counted once), idle = span - busy, gaps placed and sized."""
    prof = load_script("step_profile")
    K, F = prof.Kernel, prof.FORWARD
    # us: a [0, 100), b [50, 150) overlaps a, gap 150-400 (250 us), c [400, 420), gap 420-425 (5 us), d [425, 1425)
    kernels = [K("d", F, 1.0, 425.0), K("a", F, 0.1, 0.0), K("b", F, 0.1, 50.0), K("c", F, 0.02, 400.0)]
    idle = prof.idle_time(kernels)
    assert idle["span_ms"] == pytest.approx(1.425)
    assert idle["busy_ms"] == pytest.approx(0.15 + 0.02 + 1.0)
    assert idle["idle_ms"] == pytest.approx(0.255)
    assert idle["idle_by_gap_size"]["0.1-1 ms"] == dict(gaps=1, ms=pytest.approx(0.25))
    assert idle["idle_by_gap_size"]["< 10 us"] == dict(gaps=1, ms=pytest.approx(0.005))
    largest = idle["largest_gaps"][0]
    assert (largest["before"], largest["after"]) == ("b", "c")
    assert largest["ms"] == pytest.approx(0.25) and largest["at_ms"] == pytest.approx(0.15)
    assert prof.idle_time([]) == {}
    top = prof.top_kernels(kernels * 2, steps=2)
    assert [t["name"] for t in top[:2]] == ["d", "a"] and top[0]["calls"] == 1 and top[0]["ms"] == 1.0


def test_step_profile_groups_kernels_as_the_profile_table_does():
    """The seven groups of the profile table (bench_train.py / bench_memory.py --profile), by kernel name."""
    prof = load_script("step_profile")
    assert prof.FAMILIES == (
        "16-bit GEMM", "8-bit GEMM", "quantize/cast", "attention", "norm + elementwise", "optimizer", "other"
    )  # fmt: skip
    families = {
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "16-bit GEMM",
        "nvjet_sm90_tst_192x192_64x3_1x2_h_bz_coopB_NNN": "16-bit GEMM",
        "_scaled_mm_kernel": "8-bit GEMM",
        "sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n": "8-bit GEMM",
        "_quantize_rowwise_kernel": "quantize/cast",
        "_rowwise_colsum_kernel": "quantize/cast",
        "triton_per_fused__to_copy_abs_amax_clamp_sum_0": "quantize/cast",
        "triton_poi_fused__to_copy_3": "quantize/cast",
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>": "quantize/cast",
        "pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>": "attention",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop": "attention",
        "triton_red_fused_native_layer_norm_0": "norm + elementwise",
        "triton_poi_fused__to_copy_add_gelu_2": "norm + elementwise",
        "void at::native::vectorized_layer_norm_kernel<float>": "norm + elementwise",
        "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>": "norm + elementwise",
        "multi_tensor_apply_kernel<FusedAdamMathFunctor>": "optimizer",
        "Memcpy DtoD (Device -> Device)": "other",
        "void at::native::vectorized_elementwise_kernel<4, FillFunctor>": "other",
    }
    assert {name: prof.family(name) for name in families} == families


def test_bench_memory_max_batch_estimate():
    bench = load_script("bench_memory")
    row = dict(fixed_gib=10.0, peak_mib_per_sample=512.0)
    assert bench.estimate_max_batch(row, 30 * 2**30) == 40  # (30 - 10) GiB / 0.5 GiB per sample
    assert bench.estimate_max_batch(dict(fixed_gib=10.0, peak_mib_per_sample=0.0), 30 * 2**30) is None


def test_bench_linear_rows_are_named_by_the_config_their_model_runs():
    """Every eager SwitchBack row's block runs the config its name says, on the 8-bit path (the token floor
    pinned), with the default kernel options."""
    from hf_switchback import KernelOptions
    from hf_switchback.functional import AUTO_MIN_TOKENS_CUDA
    from hf_switchback.modules import SwitchBackLinear

    bench = load_script("bench_linear")
    names = []
    for name, make, compiled in bench.variants(False):
        layers = [m for m in make(bench.build_case("block", 32)).modules() if isinstance(m, SwitchBackLinear)]
        assert not compiled and len(layers) == (0 if name == "bf16 nn.Linear" else 2), name
        for layer in layers:
            cfg = layer.switchback_config
            assert name == f"switchback {cfg.variant}" and cfg.min_tokens == AUTO_MIN_TOKENS_CUDA
            assert cfg.kernel_options == KernelOptions()
        names.append(name)
    assert len(set(names)) == 9  # bf16 and int8 / fp8 x tensor / row x memory_efficient


def test_bench_train_ab_flags_become_kernel_options():
    from hf_switchback import KernelOptions

    bench = load_script("bench_train")
    args = argparse.Namespace(opaque_gemm_under_compile=True, tma=True)
    assert bench.kernel_options(args) == KernelOptions(trace_gemm=False, use_tma=True)
    assert bench.kernel_options(argparse.Namespace(tma=True)) == KernelOptions(use_tma=True)
    assert bench.kernel_options(argparse.Namespace()) == KernelOptions()


def test_bench_train_variant_kernel_changes_apply_on_top_of_the_process_options():
    from hf_switchback import KernelOptions

    bench = load_script("bench_train")
    cfg = bench.switchback_config("int8-memeff-inductor-act", KernelOptions(use_tma=True), min_tokens=0)
    assert cfg.memory_efficient and cfg.min_tokens == 0
    assert cfg.kernel_options == KernelOptions(use_tma=True, triton_act_quantize=False)
    assert bench.switchback_config("int8-memeff").kernel_options == KernelOptions()
    # rows are composed of tokens: each one's fields, in any order, checked by SwitchBackConfig
    cfg = bench.switchback_config("fp8-memeff-unfused-wgrad8")
    assert (cfg.precision, cfg.memory_efficient, cfg.fuse_mlp, cfg.wgrad_precision) == (
        "fp8",
        True,
        False,
        "fp8",
    )
    assert bench.switchback_config("int8-row-memeff").weight_scaling == "row"
    assert bench.switchback_config("int8-attn").target_modules == bench.ATTENTION
    for token in bench.TOKENS:  # every token builds a valid config
        bench.switchback_config(f"int8-{token}")
    for bad in ("int8-", "int8-fast", "int4-memeff", "int8-memeffx", "bf16-memeff"):
        assert not bench.is_base(bad), bad
    assert all(bench.is_base(b) for b in ("int8-default", "fp8-lora", "torchao-float8-rowwise", "bf16-lora"))


def test_bench_memory_fit_search_finds_the_largest_batch(monkeypatch):
    """--fit search bisects from the estimate, out-of-memory rows caught; a fake run (fits up to batch 300)
    stands in for the GPU."""
    bench = load_script("bench_memory")
    tried = []

    def fake_attempt(name, spec, batch, args, clock=None):
        tried.append(batch)
        if batch > 300:
            return dict(model=name, variant=spec, batch=batch, status="oom", error="out of memory")
        return dict(model=name, variant=spec, batch=batch, ms_per_step=1.0, samples_per_s=float(batch))

    monkeypatch.setattr(bench, "attempt", fake_attempt)
    first = dict(batch=192, samples_per_s=192.0, ms_per_step=1.0, fixed_gib=15.0, peak_mib_per_sample=200.0)
    cap = int((15.0 + 340 * 200.0 / 1024) * 2**30)  # the estimate says 340: too optimistic, 300 fits
    args = bench.argparse.Namespace(fit="search", fit_tries=8)
    found = bench.fit("vit-h-14", "int8-memeff+compile", first, args, cap)
    assert found["max_batch_est"] == 340 and found["max_batch"] == 296  # the largest multiple of 8 <= 300
    assert tried[0] == 336 and found["oom_at"] == 304  # the estimate first; bracketed to one step of 8
    assert any(r["status"] == "oom" for r in found["fit_runs"])
    # an estimate that errs low: the search climbs above it, up to 1.25x
    tried.clear()
    low = dict(first, peak_mib_per_sample=200.0 * 340 / 272)  # estimate 272
    found = bench.fit("vit-h-14", "bf16+compile", low, args, cap)
    assert tried[0] == 272 and found["max_batch"] == 296 and found["oom_at"] == 304
    # --fit_variants: rows not listed only estimate (mode="estimate"), no runs
    tried.clear()
    assert "max_batch" not in bench.fit("vit-h-14", "bf16+compile", first, args, cap, mode="estimate")
    assert tried == []


def test_bench_crossover_cpu_smoke_writes_a_table_the_loader_reads(tmp_path, capsys):
    """bench_linear.py --mode crossover --device cpu --tiny in process, split over two commands (--resume): every
    shape family and precision gets times and a crossover, and its JSON is a table that kernels/crossover loads
    (the format the GPU run ships)."""
    from hf_switchback.kernels import crossover

    bench = load_script("bench_linear")
    out = tmp_path / "sm90.json"
    first = bench.main(
        ["--mode", "crossover", "--device", "cpu", "--tiny", "--dims", "16", "--out", str(out)]
    )
    # --resume keeps the widths the file holds and measures the others (a run split over several commands)
    args = ["--mode", "crossover", "--device", "cpu", "--tiny", "--dims", "16", "32", "--out", str(out)]
    result = bench.main([*args, "--resume"])
    for precision, entries in first["precisions"].items():
        for name, entry in entries.items():
            assert result["precisions"][precision][name] == entry  # not measured again
    printed = capsys.readouterr().out
    assert "d=16: measured in" in printed and "crossover" in printed
    data = json.loads(out.read_text())
    assert data == result and data["complete"] and data["format"] == crossover.FORMAT
    assert set(data["precisions"]) == {"int8", "fp8"}
    for precision, entries in data["precisions"].items():
        shapes = {(k, n): d for d in (16, 32) for k, n, _ in bench.layer_shapes(d)}
        assert {(e["K"], e["N"]) for e in entries.values()} == set(shapes)
        for entry in entries.values():
            assert entry["layer"] == shapes[(entry["K"], entry["N"])]  # each linear gets its layer's figures
            for key in ("", "_compiled"):
                assert set(entry[f"speedup{key}"]) == {"8", "16", "32"}
                assert all(t > 0 for t in entry[f"bf16{key}_ms"].values())
                assert all(t > 0 for t in entry[f"switchback{key}_ms"].values())
            for compiled, key in ((False, "crossover"), (True, "crossover_compiled")):
                want = crossover.NEVER if entry[key] is None else entry[key]
                assert crossover.load_table(out, compiled)[(precision, entry["K"], entry["N"])] == want
    with pytest.raises(SystemExit):  # another grid in the same file
        bench.main([*args, "--resume", "--tokens", "8", "16"])
    with pytest.raises(SystemExit):  # --resume needs the file it continues
        bench.main(["--mode", "crossover", "--device", "cpu", "--tiny", "--resume"])
    with pytest.raises(SystemExit):  # a table must be measured on the GPU it is for
        bench.main(["--mode", "crossover", "--device", "cpu", "--tiny", "--write_table", str(tmp_path)])


def test_bench_linear_kernel_timings_are_refused_without_a_gpu(capsys):
    bench = load_script("bench_linear")
    for flag in ("--gemm", "--kernels", "--wgrad"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--device", "cpu", "--tiny", flag])
        assert "time CUDA kernels: they need a CUDA GPU" in capsys.readouterr().err


def test_bench_wgrad_tiles_scale_each_128_tokens_of_a_feature():
    """The 1 x 128 operand of the wgrad GEMM timings: e4m3 q times its tile's scale gives the input back to
    e4m3's rounding (2^-4 relative), scales stored as torch's blockwise GEMM wants them (column-major)."""
    bench = load_script("bench_linear")
    x = torch.randn(6, 256) * torch.logspace(-3, 3, 256)  # tiles of very different ranges along the tokens
    q, scale = bench._tile_scaled(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (6, 2) and scale.stride() == (1, 6)
    tiles = x.reshape(6, 2, 128)
    back = q.float().reshape(6, 2, 128) * scale[..., None]
    # e4m3 rounds to 2^-4 relative, or by at most half its smallest subnormal step (2^-10) in scaled units
    assert ((back - tiles).abs() <= 2**-4 * tiles.abs() + 2**-10 * scale[..., None]).all()
    torch.testing.assert_close(scale, tiles.abs().amax(-1) / 448)


def test_bench_crossover_is_the_first_m_from_which_every_larger_m_pays():
    bench = load_script("bench_linear")
    tokens = [1024, 2048, 4096, 8192, 16384]
    assert bench.crossover_of(tokens, [0.5, 1.1, 0.99, 1.03, 1.2], 1.02) == 8192  # 2048 paid, 4096 did not
    assert bench.crossover_of(tokens, [1.05] * 5, 1.02) == 1024
    assert bench.crossover_of(tokens, [1.05, 1.05, 1.05, 1.05, 1.01], 1.02) is None  # the largest M must pay
    assert bench.layer_shapes(512) == [(512, 512, "d->d"), (512, 2048, "d->4d"), (2048, 512, "4d->d")]
    args = bench.parse_args(["--mode", "crossover", "--device", "cpu", "--tiny", "--dims", "16", "16", "32"])
    assert args.dims == [16, 32]  # a repeated width is measured once


def test_bench_memory_budget_context_in_a_fresh_process():
    """+budgetF on the first row of a process: torch._functorch.config is not an attribute of torch._functorch
    until imported (the CPU table's first budget row failed with AttributeError)."""
    code = (
        "import common, torch\n"
        "with common.recompute_budget(0.25):\n"
        "    assert torch._functorch.config.activation_memory_budget == 0.25\n"
        "assert torch._functorch.config.activation_memory_budget == 1.0\n"
    )
    env = {"PYTHONPATH": f"{ROOT / 'benchmarks'}:{ROOT / 'src'}", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_common_counts_graph_cache_outcomes_this_torch_records(tmp_path, monkeypatch):
    # A real Inductor compile on the installed torch: the counters must move (a renamed one would read zero
    # forever). Inductor builds CPU kernels with a C++ compiler.
    if not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("Inductor on the CPU needs a C++ compiler (c++ or g++ on PATH)")
    split_mod = load_script("common")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    before = split_mod.cache_counts()
    compiled = torch.compile(torch.nn.Linear(8, 8), backend="inductor")
    compiled(torch.randn(4, 8)).sum().backward()
    caches = split_mod.first_step_caches(before, split_mod.cache_counts())
    torch._dynamo.reset()
    assert set(caches) == {name for name, _, _ in split_mod.CACHE_COUNTERS}
    # a fresh cache folder: forward and backward graphs are compiled and stored, none loaded
    assert caches["fx_graph_miss"] == 2 and caches["fx_graph_hit"] == 0
    assert caches["aot_autograd_miss"] == 1 and caches["aot_autograd_hit"] == 0
    assert split_mod.first_step_caches({}, {}) == {}


def _run_warmup(tmp_path, *flags: str, timeout: int = 300) -> tuple[dict, str, Path]:
    """compile_warmup.py with `flags` on caches under tmp_path: (its JSON, its stdout, the cache root)."""
    out, cache_root = tmp_path / "warmup.json", tmp_path / "caches"
    stdout = run_script(
        ["benchmarks/compile_warmup.py", *flags, "--cache_root", str(cache_root), "--json", str(out)],
        timeout=timeout,
    )
    return json.loads(out.read_text()), stdout, cache_root


@pytest.mark.slow
def test_compile_warmup_runs_each_variant_cold_then_warm_in_its_own_caches_and_reports_medians(tmp_path):
    flags = ["--tiny", "--models", "vit-b-16", "--variants", "bf16", "int8", "--steps", "1", "--warmup", "0"]
    result, stdout, cache_root = _run_warmup(tmp_path, *flags, "--warm_passes", "2")
    rows = result["rows"]
    # each pass runs every variant before the next pass starts; every warm round on cold's caches
    assert [(r["variant"], r["pass"], r["round"]) for r in rows] == [
        ("bf16", "cold", 0),
        ("int8", "cold", 0),
        ("bf16", "warm", 0),
        ("int8", "warm", 0),
        ("bf16", "warm", 1),
        ("int8", "warm", 1),
    ]
    assert rows[0]["cache"] == rows[2]["cache"] == rows[4]["cache"] != rows[1]["cache"] == rows[3]["cache"]
    assert rows[3]["cache"] == rows[5]["cache"]
    assert {Path(r["cache"]).parent.parent for r in rows} == {cache_root}
    for row in rows:
        assert "error" not in row, row
        # eager rows compile nothing
        assert row["first_step_s"] > 0 and not any(row["first_step_caches"].values())
    lines = [line for line in stdout.splitlines() if line.startswith("vit-b-16")]
    table, medians_table, by_stage = lines[:6], lines[6:10], lines[10:]
    assert len(table) == 6 and all("x" in line for line in table)
    assert "1.00x" in table[0] and "1.00x" in table[2] and "1.00x" in table[4]  # the baseline's own rows
    # the medians over the warm processes: n = 2 per variant, the ratio of the medians
    warm_int8 = sorted(r["first_step_s"] for r in rows if r["variant"] == "int8" and r["pass"] == "warm")
    (summary,) = [m for m in result["medians"] if m["variant"] == "int8" and m["pass"] == "warm"]
    assert summary["n"] == 2 and summary["median_s"] == pytest.approx(sum(warm_int8) / 2)
    assert "median over processes" in stdout and len(medians_table) == 4
    # then the extra seconds over the baseline by compile stage: int8's cold and warm passes
    assert [line.split()[1:3] for line in by_stage] == [["int8", "cold"], ["int8", "warm"]]
    assert (cache_root / "prime").is_dir()  # the untimed first process ran, on caches of its own


@pytest.mark.slow
def test_compile_warmup_repeats_each_row_on_new_caches(tmp_path):
    flags = ["--tiny", "--variants", "bf16", "--steps", "1", "--warmup", "0", "--repeats", "2", "--no_prime"]
    result, _, cache_root = _run_warmup(tmp_path, *flags)
    rows = result["rows"]
    assert [(r["repeat"], r["pass"]) for r in rows] == [(0, "cold"), (0, "warm"), (1, "cold"), (1, "warm")]
    assert rows[0]["cache"] == rows[1]["cache"] != rows[2]["cache"] == rows[3]["cache"]
    assert not (cache_root / "prime").exists()


def test_compile_warmup_medians_are_per_pass_with_the_ratio_of_the_medians():
    load_script("common")
    warmup = load_script("compile_warmup")

    def row(variant, cache_pass, seconds):
        return dict(model="m", variant=variant, first_step_s=seconds, **{"pass": cache_pass})

    rows = [row("bf16", "warm", s) for s in (2.0, 2.2, 9.0)] + [
        row("int8", "warm", s) for s in (2.3, 2.4, 2.5)
    ]
    rows += [row("int8", "cold", 13.0), dict(model="m", variant="int8", status="error", **{"pass": "cold"})]
    summary = {(m["variant"], m["pass"]): m for m in warmup.medians(rows, "bf16")}
    assert summary["bf16", "warm"]["median_s"] == 2.2 and summary["bf16", "warm"]["spread_s"] == 7.0
    assert summary["int8", "warm"]["ratio"] == pytest.approx(2.4 / 2.2)  # an outlier moves no median
    assert summary["int8", "cold"]["n"] == 1 and summary["int8", "cold"]["ratio"] is None  # no bf16 cold row


@pytest.mark.slow
def test_compile_warmup_moved_pass_loads_the_cold_processs_artifacts_on_empty_caches(tmp_path):
    flags = ["--tiny", "--variants", "bf16+compile", "--compile", "layers", "--steps", "1", "--warmup", "0"]
    # (no warm pass: the tests above cover it)
    result, _, _ = _run_warmup(tmp_path, *flags, "--no_prime", "--moved", "--warm_passes", "0", timeout=600)
    cold, moved = result["rows"]
    assert [r["pass"] for r in (cold, moved)] == ["cold", "moved"]
    assert moved["cache"] == str(Path(cold["cache"]) / "moved")
    assert (Path(cold["cache"]) / "compile_artifacts.bin").is_file()  # what the cold process saved
    assert cold["first_step_caches"]["fx_graph_hit"] == 0 and cold["first_step_caches"]["fx_graph_miss"] > 0
    # the moved process starts on empty caches, yet finds every graph: the artifacts were loaded (the caches'
    # counts say so; its first step's seconds on a shared CPU host would not)
    assert moved["first_step_caches"]["fx_graph_miss"] == 0
    assert moved["first_step_caches"]["fx_graph_hit"] == cold["first_step_caches"]["fx_graph_miss"]


def _warmup_row(variant, repeat, first_step_s, ttir_s=0.0, **timers):
    return dict(model="vit-b-16", variant=variant, repeat=repeat, first_step_s=first_step_s,
                first_step_compile_s=timers, first_step_ttir={"calls": 1, "s": ttir_s}, **{"pass": "cold"})  # fmt: skip


def test_compile_stages_split_the_extra_seconds_by_stage_and_average_the_repeats(capsys):
    load_script("common")  # what compile_stages imports, as its scripts' folder on sys.path gives it
    stages = load_script("compile_stages")
    # nested timers (Inductor's whole compile inside AOT's dispatcher) must not be counted: only listed ones are
    rows = [
        _warmup_row("bf16", 0, 10.0, bytecode_tracing=0.5, aot_collect_metadata=0.2, create_aot_dispatcher_function=7.0),
        _warmup_row("int8", 0, 14.0, 1.0, bytecode_tracing=1.0, aot_collect_metadata=1.4, create_aot_dispatcher_function=9.0),
        _warmup_row("bf16", 1, 12.0, bytecode_tracing=0.5, aot_trace_joint_graph=0.4, **{"PyCodeCache.load_by_key_path": 3.0}),
        _warmup_row("int8", 1, 15.0, 2.0, bytecode_tracing=0.7, aot_trace_joint_graph=1.0, **{"PyCodeCache.load_by_key_path": 4.0, "async_compile.precompile": 1.0}),
        _warmup_row("int8", 2, 99.0),  # no baseline row in its repeat: left out
        dict(_warmup_row("fp8", 0, 1.0), first_step_s=None) | {"error": "x"},
    ]  # fmt: skip
    del rows[-1]["first_step_s"]  # a failed row has no first step
    (extra,) = stages.extra_by_stage(rows, "bf16")
    assert (extra["model"], extra["pass"], extra["variant"], extra["repeats"]) == (
        "vit-b-16",
        "cold",
        "int8",
        2,
    )
    # repeat 0: +4.0 total, Dynamo +0.5, AOT +1.2, rest +2.3; repeat 1: +3.0, Dynamo +0.2, AOT +0.6, kernels +1.0
    assert extra["total"] == pytest.approx(3.5)
    assert extra["Dynamo"] == pytest.approx(0.35)
    assert extra["AOT trace"] == pytest.approx(0.9)
    assert extra["kernels"] == pytest.approx(0.5)
    assert extra["TTIR"] == pytest.approx(1.5)
    assert extra["serial"] == pytest.approx(0.5)  # part of kernels: the rest unchanged
    assert extra["rest"] == pytest.approx((2.3 + 1.2) / 2)
    assert extra["guards"] == 0.0
    assert stages.stage_seconds(rows[-1]) == {}
    stages.print_extra_by_stage([extra], "bf16")
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("vit-b-16"))
    assert "+3.50" in line and "cold" in line


def test_kernel_compiles_reads_each_new_graphs_slowest_triton_compiles(monkeypatch, capsys):
    """common.kernel_compiles_since keeps only graphs compiled after its mark and torch's per-kernel record of
    them (microseconds, as torch's metrics write it); compile_stages.kernel_compiles sums and ranks them."""
    common = load_script("common")
    stages = load_script("compile_stages")
    from torch._dynamo import utils as dynamo_utils

    def metrics(compile_id, forward, kernels):
        times = None if kernels is None else json.dumps(kernels)
        return SimpleNamespace(
            compile_id=compile_id, is_forward=forward, triton_kernel_compile_times_us=times
        )

    earlier = metrics("0/0", True, [["old_kernel", 5_000_000]])
    recorded = [earlier]
    monkeypatch.setattr(dynamo_utils, "get_compilation_metrics", lambda: list(recorded))
    mark = common.compiles_so_far()
    recorded += [
        metrics("1/0", True, [["_scaled_mm_kernel", 1_070_000], ["triton_poi_fused_gelu_0", 240_000]]),
        metrics("1/0", False, [["_act_backward_rows_kernel", 930_000]]),
        metrics("1/1", True, None),  # a graph without Triton kernels (all cached, or a CPU compile)
        SimpleNamespace(compile_id="1/2", is_forward=True, triton_kernel_compile_times_us="<unknown>"),
    ]
    graphs = common.kernel_compiles_since(mark)
    assert graphs == [
        dict(
            graph="1/0",
            forward=True,
            kernels=[["_scaled_mm_kernel", 1.07], ["triton_poi_fused_gelu_0", 0.24]],
        ),
        dict(graph="1/0", forward=False, kernels=[["_act_backward_rows_kernel", 0.93]]),
    ]
    row = dict(
        model="vit-b-16", variant="int8", repeat=0, first_step_kernel_compiles=graphs, **{"pass": "cold"}
    )
    summary = stages.kernel_compiles([row, dict(row, first_step_kernel_compiles=[])], slowest=1)
    assert [(c["graph"], c["recorded"]) for c in summary] == [("1/0 fwd", 2), ("1/0 bwd", 1)]
    assert summary[0]["total_s"] == pytest.approx(1.31) and summary[0]["max_s"] == 1.07
    assert summary[0]["names"] == "_scaled_mm_kernel 1.07"  # only the slowest one asked for
    stages.print_kernel_compiles(summary)
    out = capsys.readouterr().out
    assert "1/0 fwd" in out and "_act_backward_rows_kernel 0.93" in out


def test_compile_warmup_refuses_full_size_models_on_the_cpu(monkeypatch, capsys):
    warmup = load_script("compile_warmup")
    monkeypatch.setattr(sys, "argv", ["compile_warmup.py", "--device", "cpu"])
    with pytest.raises(SystemExit):
        warmup.main()
    assert "--tiny" in capsys.readouterr().err


def test_bench_linear_cpu_smoke():
    """--device cpu --tiny: every case times bf16 and the default SwitchBack rows on the torch reference path."""
    stdout = run_script(["benchmarks/bench_linear.py", "--device", "cpu", "--tiny"])
    rows = [
        line.split(" | ")
        for line in stdout.splitlines()
        if line.startswith("| fc") or line.startswith("| block")
    ]
    timed = {(r[0].strip("| "), r[1]) for r in rows if r[2] and float(r[2]) > 0}
    for case in ("fc1", "fc2", "block"):
        label = f"{case} d=16 tokens=32"
        assert {
            (label, "bf16 nn.Linear"),
            (label, "switchback int8/tensor"),
            (label, "switchback fp8/row"),
        } <= timed
    assert any(r[3] == "1.00" for r in rows)  # bf16 is its own baseline


def test_kernel_compile_times_finds_each_kernel_module_inductor_wrote(tmp_path, capsys):
    """kernel_compile_times.py reads the kernel modules of an Inductor cache folder (one @triton.jit under
    Inductor's decorator each) and leaves the graphs' modules (which call async_compile) and other files out."""
    times = load_script("kernel_compile_times")
    kernel = (
        "import triton\nfrom torch._inductor.runtime import triton_heuristics\n\n@triton_heuristics.{}(\n)\n"
    )
    (tmp_path / "ab").mkdir()
    (tmp_path / "ab" / "cab.py").write_text(
        kernel.format("pointwise") + "@triton.jit\ndef triton_poi_add_0(x):\n"
    )
    (tmp_path / "cd.py").write_text(
        kernel.format("user_autotune") + "@triton.jit\ndef _scaled_mm_kernel(a):\n"
    )
    graph = (
        "async_compile = AsyncCompile()\n" + kernel.format("pointwise") + "@triton.jit\ndef triton_x(y):\n"
    )
    (tmp_path / "graph.py").write_text(graph)
    (tmp_path / "helper.py").write_text("@triton.jit\ndef not_inductors(x):\n")
    found = times.kernel_sources(tmp_path)
    assert found == [
        ("_scaled_mm_kernel", tmp_path / "cd.py"),
        ("triton_poi_add_0", tmp_path / "ab" / "cab.py"),
    ]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert times.main([str(empty), "--json", str(tmp_path / "rows.json")]) == 0
    assert "0 kernels" in capsys.readouterr().out
    assert json.loads((tmp_path / "rows.json").read_text())["rows"] == []
    with pytest.raises(SystemExit):
        times.main([str(tmp_path / "missing")])
    assert "is not a folder" in capsys.readouterr().err


# A kernel module as Inductor writes one for a user-defined kernel (its header, torch 2.11-2.13; an sm90 target)
_TINY_KERNEL_MODULE = """
import triton
import triton.language as tl

from torch._inductor.runtime import triton_heuristics
from torch._inductor.runtime.hints import DeviceProperties

@triton_heuristics.user_autotune(
    configs=[{'num_warps': 1, 'num_stages': 1}],
    inductor_meta={'grid_type': 'FixedGrid', 'fixed_grid': ['_grid_0', '_grid_1', '_grid_2'],
        'extra_launcher_args': ['_grid_0', '_grid_1', '_grid_2'], 'kernel_name': '_double_kernel_0'},
    triton_meta={'signature': {'x_ptr': '*fp32', 'n': 'i32', 'BLOCK': 'constexpr'},
        'device': DeviceProperties(type='cuda', index=0, multi_processor_count=132, cc=90, major=9,
            regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, max_threads_per_block=1024,
            warp_size=32),
        'constants': {'BLOCK': 64}, 'configs': [{(0,): [['tt.divisibility', 16]]}]},
    filename=__file__,
    custom_kernel=True,
)
@triton.jit
def _double_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offsets, 2 * tl.load(x_ptr + offsets, mask=offsets < n), mask=offsets < n)
"""


def test_kernel_compile_times_compiles_a_kernel_module_for_its_target_without_a_gpu(tmp_path, monkeypatch):
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton without its CUDA backend")
    times = load_script("kernel_compile_times")
    (tmp_path / "cab.py").write_text(_TINY_KERNEL_MODULE)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    rows = times.compile_all(times.kernel_sources(tmp_path), no_gpu=True)
    assert [(r["kernel"], r["configs"]) for r in rows] == [("_double_kernel", 1)]
    assert 0 < rows[0]["s"] < 60
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")  # its own cache was temporary
    assert not (tmp_path / "mine").exists()


def test_launch_shapes_times_each_launch_of_the_layernorm_kernel_on_the_interpreter(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "launches.json"
    args = ["benchmarks/launch_shapes.py", "--device", "cpu", "--shapes", "4x64", "--launches", "1x1", "2x2"]
    run_script([*args, "--rounds", "1", "--qdtypes", "int8", "--json", str(out)], timeout=300)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["rows"], r["warps"], r["values_per_thread"]) for r in rows] == [(1, 1, 2), (2, 2, 2)]
    assert min(r["vs_best"] for r in rows) == 1.0 and all(r["us"] > 0 for r in rows)


def test_launch_shapes_without_add_times_layernorm_1(monkeypatch):
    """--without_add measures the LayerNorm without the residual add (the add kernel runs once, to start Triton)."""
    from hf_switchback.kernels import norm_quant

    calls = []
    monkeypatch.setattr(norm_quant, "layernorm_quantize_rowwise", lambda *a: calls.append("layernorm"))
    monkeypatch.setattr(norm_quant, "add_layernorm_quantize_rowwise", lambda *a: calls.append("add"))
    shapes = load_script("launch_shapes")
    launch_shape, interpret = norm_quant._launch_shape, os.environ.get("TRITON_INTERPRET")
    argv = [
        "--device",
        "cpu",
        "--shapes",
        "4x64",
        "--launches",
        "1x1",
        "2x1",
        "--rounds",
        "1",
        "--qdtypes",
        "int8",
    ]
    rows = shapes.main([*argv, "--without_add"])
    assert calls == ["add"] + ["layernorm"] * 4 and [r["residual_add"] for r in rows] == [False, False]
    # the process as it was: the launch rule and the environment
    assert norm_quant._launch_shape is launch_shape and os.environ.get("TRITON_INTERPRET") == interpret


def test_dynamo_trace_times_each_variant_and_counts_its_graph(tmp_path):
    """The CPU smoke run: one trace per variant after an untimed one; the fused layer's two leaves record a
    smaller graph than the blocks' leaves (blocks/layer_leaves.py), and the -blocks variant restores the switch.
    The text tower's first layer (the vision tower's is the default)."""
    out = tmp_path / "trace.json"
    args = ["benchmarks/dynamo_trace.py", "--device", "cpu", "--tiny", "--rounds", "1", "--tower", "text"]
    run_script([*args, "--variants", "bf16", "int8", "int8-blocks", "--json", str(out)], timeout=300)
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"bf16", "int8", "int8-blocks"}
    assert all(r["tower"] == "text" for r in rows.values())
    assert all(r["trace_s"] > 0 and len(r["traces_s"]) == 1 for r in rows.values())
    assert rows["int8"]["graph_nodes"] < rows["int8-blocks"]["graph_nodes"]


def test_dynamo_trace_refuses_an_unknown_variant():
    with pytest.raises(SystemExit):
        load_script("dynamo_trace").parse_args(["--device", "cpu", "--tiny", "--variants", "int4"])
