"""The accuracy harness (benchmarks/parity.py): graded-shapes task, simulated gradient quantizers, pretrain ->
save -> fine-tune, the train_clip protocol, the paired summary."""

import importlib.util
import math
import statistics
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))  # the accuracy harness's research package lives there
from accuracy import grad_quant_sim as gq  # noqa: E402
from accuracy import graded_run as gr  # noqa: E402
from accuracy import graded_shapes as gs  # noqa: E402
from accuracy import summary as sm  # noqa: E402
from accuracy import train_clip_run as tc  # noqa: E402
from accuracy.sim_switchback import SimSwitchBackLinear, apply_sim_switchback  # noqa: E402


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pg = load_script("parity")


# --- task ---------------------------------------------------------------------------------------------------
def test_batches_are_a_function_of_seed_and_step_and_captions_match_attributes():
    a = gs.sample(gs.ALL, 64, 16, gs.step_generator("cpu", 3, 7))
    b = gs.sample(gs.ALL, 64, 16, gs.step_generator("cpu", 3, 7))
    c = gs.sample(gs.ALL, 64, 16, gs.step_generator("cpu", 3, 8))
    assert torch.equal(a.pixels, b.pixels) and torch.equal(a.caption, b.caption)
    assert not torch.equal(a.pixels, c.pixels)
    table, classes = gs.caption_table(gs.ALL), gs.ALL.classnames()
    for caption, label in zip(a.caption.tolist(), a.label.tolist(), strict=True):
        words = table[caption]
        assert classes[label].split()[0] in words.split() and classes[label].split()[1] in words.split()
    assert a.pixels.shape == (64, 3, 16, 16) and a.pixels.min() >= 0 and a.pixels.max() <= 1


def test_eval_set_uses_full_captions_and_tasks_are_shifted():
    full = gs.FINETUNE.full_captions()
    batch = next(gs.eval_batches(gs.FINETUNE, 50, 16, "cpu"))
    for caption, label in zip(batch.caption.tolist(), batch.label.tolist(), strict=True):
        assert gs.FINETUNE.classnames()[label] in full[caption]
        assert len(full[caption].split()) >= 5  # size and position always present
    assert not set(gs.FINETUNE.colors) & set(gs.PRETRAIN.colors)
    assert set(gs.FINETUNE.shapes) - set(gs.PRETRAIN.shapes)
    assert set(gs.vocabulary()) >= {w for c in gs.caption_table(gs.ALL) for w in c.split()}


def test_shapes_render_distinct_masks():
    n = len(gs.SHAPES)
    pixels = gs.render(
        torch.full((n,), 6),  # white
        torch.arange(n),
        torch.full((n,), 2),  # large
        torch.full((n,), 4),  # centre
        32,
        gs.step_generator("cpu", 0, 0),
    )
    masks = pixels.mean(1) > 0.6
    for i in range(n):
        assert masks[i].sum() > 20, gs.SHAPES[i]
        for j in range(i):
            assert (masks[i] ^ masks[j]).sum() > 10, (gs.SHAPES[i], gs.SHAPES[j])


# --- simulated gradient quantizers, against an independent loop-based reference ------------------------------
def _ref_quant_row(row: list[float], scale_of) -> list[float]:
    out = []
    for start in range(0, len(row), scale_of):
        block = row[start : start + scale_of]
        absmax = max(abs(v) for v in block)
        scale = absmax / 127 if absmax else 1.0
        # round half to even, as torch.round
        out += [max(-127, min(127, round(v / scale))) * scale for v in block]
    return out


def test_row_and_block_quantizers_match_a_loop_reference():
    g = torch.randn(5, 40) * torch.logspace(-3, 1, 40)
    row = gq.fake_quant_grad(g, "row")
    block = gq.fake_quant_grad(g, "block16")
    for i in range(5):
        values = g[i].tolist()
        torch.testing.assert_close(row[i], torch.tensor(_ref_quant_row(values, 40)), rtol=1e-5, atol=0)
        torch.testing.assert_close(block[i], torch.tensor(_ref_quant_row(values, 16)), rtol=1e-5, atol=0)


def test_blocks_keep_small_entries_that_rows_flush():
    g = torch.full((4, 256), 1e-3)
    g[:, 0] = 1.0  # one outlier per row: every other entry is below absmax / 254
    assert (gq.fake_quant_grad(g, "row")[:, 1:] == 0).all()
    assert (gq.fake_quant_grad(g, "block128")[:, 128:] - 1e-3).abs().max() < 1e-5
    kept = gq.fake_quant_grad(g, "row-outlier1")
    assert kept[:, 0].eq(1.0).all() and (kept[:, 1:] - 1e-3).abs().max() < 1e-5


def test_stochastic_rounding_is_unbiased():
    g = torch.full((2000, 64), 1e-3)
    g[:, 0] = 1.0
    generator = torch.Generator().manual_seed(0)
    sr = gq.fake_quant_grad(g, "row-sr", generator)
    assert sr[:, 1:].mean().item() == pytest.approx(1e-3, rel=0.05)
    assert (sr[:, 1:] == 0).float().mean() > 0.5  # still mostly zeros, but unbiased on average


def test_gradient_stats_name_the_flush_and_the_outlier_columns():
    g = torch.randn(64, 128) * 1e-3
    g[:, 5] = 1.0
    stats = gq.gradient_stats(g, torch.randn(128, 32), ("row", "block32"))
    assert stats["row/flushed"] > 0.9 and stats["block32/flushed"] < stats["row/flushed"]
    assert stats["row_max_in_top1pct_cols"] == 1.0
    assert stats["row/grad_input_rel_err"] > stats["block32/grad_input_rel_err"]
    with pytest.raises(ValueError, match="unknown gradient quantizer"):
        gq.parse_grad_quantizer("block")


def test_sim_linear_gradients_follow_the_quantizer():
    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 8)
    sim = SimSwitchBackLinear.from_linear(linear, "block4")
    x = torch.randn(6, 16, requires_grad=True)
    grad = torch.randn(6, 8)
    sim(x).backward(grad)
    expected_x = gq.fake_quant_grad(grad, "block4") @ gq.fake_quant_tensor(linear.weight)
    torch.testing.assert_close(x.grad, expected_x)
    torch.testing.assert_close(linear.weight.grad, grad.t() @ x.detach())  # grad-weight unquantized
    expected_out = gq.fake_quant_rows(x.detach()) @ gq.fake_quant_tensor(linear.weight).t() + linear.bias
    torch.testing.assert_close(sim(x).detach(), expected_out.detach())


# --- pretrain -> save -> fine-tune -------------------------------------------------------------------------
def _spec(**kw):
    spec = dict(protocol="finetune", task="finetune", steps=3, batch_size=8, lr=1e-3, warmup=1, arch="tiny")
    spec.update(eval_samples=20, log_every=1, init_from=None, variant="bf16", seed=0, name="t", stats_every=1)
    spec.update(kw)
    return spec


def test_pretrain_save_finetune_round_trip(tmp_path):
    ckpt = tmp_path / "pretrained"
    pre = pg.train_one(_spec(protocol="pretrain", task="pretrain", save_to=str(ckpt)))
    assert pre["status"] == "ok" and (ckpt / "config.json").exists()
    assert set(pre["zero_shot_before_finetune"]) == {"zero_shot_top1", "caption_r1"}
    from transformers import CLIPModel

    saved = CLIPModel.from_pretrained(ckpt)
    assert not any("Sim" in type(m).__name__ or "SwitchBack" in type(m).__name__ for m in saved.modules())
    runs = [pg.train_one(_spec(init_from=str(ckpt), variant=v, seed=1)) for v in ("bf16", "sim-block8")]
    for run in runs:
        assert run["status"] == "ok" and len(run["train"]) == 3
        assert 0 <= run["results"]["zero_shot_top1"] <= 1
    # same start and batches: the first step's loss (before any update) is the same for both
    assert runs[0]["train"][0]["loss"] == pytest.approx(runs[1]["train"][0]["loss"], rel=2e-2)
    assert runs[1]["grad_stats"] and "block32/flushed" not in runs[1]["grad_stats"][0]
    assert "row/flushed" in runs[1]["grad_stats"][0]
    assert set(runs[1]["grad_stats"][0]["by_kind"]) >= {"vision fc1", "text q_proj"}


def test_apply_sim_switchback_swaps_the_switchback_targets():
    model = gr.build_model("tiny", 40)
    sims = apply_sim_switchback(model, "row")
    names = {n for n, m in model.named_modules() if isinstance(m, SimSwitchBackLinear)}
    assert len(sims) == len(names) == 12  # q/k/v/out_proj/fc1/fc2 of one layer per tower
    assert not isinstance(model.visual_projection, SimSwitchBackLinear)


def test_memory_switch_variant_fuses_the_mlps_and_trains(tmp_path):
    from hf_switchback.mlp import is_fused_mlp

    assert pg.check_variant("int8-memeff") == "int8-memeff"
    model = gr.build_model("tiny", 40)
    gr.apply_variant(model, "int8-memeff")
    assert sum(is_fused_mlp(m) for m in model.modules()) == 2  # one MLP per tower
    run = pg.train_one(_spec(variant="int8-memeff", seed=1))
    assert run["status"] == "ok" and all(math.isfinite(r["loss"]) for r in run["train"])


# --- summary maths on fabricated logs ---------------------------------------------------------------------
def _run(variant, seed, zs, r1, losses, status="ok", protocol="finetune"):
    spec = _spec(variant=variant, seed=seed, protocol=protocol, name=f"{variant}{seed}", steps=len(losses))
    train = [dict(step=i, loss=v) for i, v in enumerate(losses)]
    return dict(
        spec=spec, status=status, train=train, evals=[], results=dict(zero_shot_top1=zs, caption_r1=r1)
    )


def test_summary_pairs_by_seed_and_reads_a_t_interval():
    base = [0.80, 0.70, 0.75, 0.90, 0.85]
    deltas = [0.001, -0.002, 0.003, 0.000, 0.001]
    runs = []
    for seed, (b, d) in enumerate(zip(base, deltas, strict=True)):
        runs.append(_run("bf16", seed, b, b / 2, [2.0] * 10))
        runs.append(_run("int8", seed, b + d, b / 2 - 0.01, [2.1] * 10))
    runs.append(_run("int8", 9, 0.1, 0.1, [9.0] * 10))  # no bf16 partner: left out
    runs.append(_run("int8", 0, 0.1, 0.1, [9.0] * 10, status="failed"))
    summary = sm.summarize(runs)
    (pool,) = summary["pooled"]
    d = [100 * x for x in deltas]
    assert pool["d_zero_shot_top1"]["n"] == 5
    assert pool["d_zero_shot_top1"]["mean"] == pytest.approx(statistics.mean(d))
    half = 2.78 * statistics.stdev(d) / math.sqrt(5)  # t(0.975, 4 df)
    assert pool["d_zero_shot_top1"]["low"] == pytest.approx(statistics.mean(d) - half, rel=1e-3)
    assert pool["verdict_zero_shot"].startswith("**parity within ±0.5 pp**")
    assert pool["d_caption_r1"]["mean"] == pytest.approx(-1.0)
    assert pool["d_final_loss"]["mean"] == pytest.approx(0.1)
    text = sm.markdown(summary, dict(arch="tiny", eval_samples=10000))
    assert "parity within" in text and "0.50 pp" in text


def test_verdict_resolves_either_way_and_needs_five_pairs():
    assert sm.verdict(sm.interval([-2.0, -2.1, -1.9, -2.0, -2.05])).startswith("**worse")
    assert sm.verdict(sm.interval([1.0, 1.1, 0.9, 1.0, 1.05])).startswith("**better")
    assert sm.verdict(sm.interval([1.0, -1.0, 0.5, -0.5, 0.0])).startswith("not resolved (95%")
    assert sm.verdict(sm.interval([0.0, 0.1, 0.0, 0.1])).startswith("not resolved (4 pairs")


def test_drop_step_is_read_on_the_smoothed_curve():
    train = [dict(step=5 * (i + 1), loss=v) for i, v in enumerate([3.0, 3.0, 3.0, 1.0, 1.0, 1.0])]
    # EMA 0.8 from 3.0: 3.0, 3.0, 3.0, 2.6, 2.28 -> first at or below 2.5 on the 5th entry (step 25)
    assert sm.drop_step(train, 2.5) == 25
    assert sm.drop_step(train, 0.5) is None and sm.drop_step([], 2.5) is None


def test_drop_spread_dates_a_late_escape():
    early = [5.0] * 2 + [1.0] * 38
    late = [5.0] * 30 + [1.0] * 10
    runs = [
        _run("bf16", 0, 0.5, 0.5, early, protocol="scratch"),
        _run("bf16", 1, 0.5, 0.5, late, protocol="scratch"),
    ]
    for r in runs:
        r["spec"]["batch_size"] = 148  # ln(148) ~ 5.0
    spread = [s for s in sm.summarize(runs)["drop_spread"] if s["fraction"] == 0.5]
    assert spread[0]["min"] < 10 and spread[0]["max"] >= 30


def test_auto_steps_are_what_fits_before_the_deadline_at_the_speed_so_far():
    spec = _spec(steps="auto", max_steps=10_000, deadline=time.time() + 30)
    count = gr.decide_steps(spec, 10, 2.0, torch.device("cpu"))
    # 10 steps in 2 s: 10 + 0.8 x 5 steps/s x ~30 s
    assert 10 + 0.8 * 5 * 29 <= count <= 10 + 0.8 * 5 * 30
    assert gr.decide_steps(dict(spec, max_steps=50), 10, 0.1, torch.device("cpu")) == 50
    assert gr.decide_steps(dict(spec, deadline=time.time() - 1), 10, 1.0, torch.device("cpu")) == 11


def test_pairs_use_the_step_count_the_runs_trained_with():
    a, b = _run("bf16", 0, 0.5, 0.5, [2.0] * 10), _run("int8", 0, 0.5, 0.5, [2.0] * 10)
    a["spec"]["steps"] = b["spec"]["steps"] = "auto"
    a["steps"], b["steps"] = 100, 120
    assert "d_zero_shot_top1" not in sm.summarize([a, b])["rows"][1]
    b["steps"] = 100
    assert sm.summarize([a, b])["rows"][1]["d_zero_shot_top1"] == 0.0


def test_runs_of_one_process_each_leave_their_record(tmp_path):
    specs = [_spec(steps=2, eval_samples=16, name="g_ok"), _spec(steps=2, name="g_bad", task="no-such-task")]
    records = pg.run_specs(specs, tmp_path, parallel=1, budget_s=300, per_process=2)
    assert [r["spec"]["name"] for r in records] == ["g_ok", "g_bad"]
    assert [r["status"] for r in records] == ["ok", "failed"]
    assert "no-such-task" in "\n".join(records[1]["output_tail"])
    assert len(records[0]["train"]) == 2 and records[1]["train"] == []


def test_a_killed_run_keeps_its_partial_curve_and_is_marked_timeout(tmp_path, monkeypatch):
    """A run killed by the time budget leaves a partial record (spec, status "partial", curve so far): the
    launcher kills the child's whole process group, marks the run "timeout" and keeps its curve, without
    crashing on the duplicate keys. A killed train_clip run keeps the curve of its own train_log.jsonl."""
    spec = dict(name="scratch_fp8_seed0", protocol="scratch", variant="fp8", seed=0)
    clip = dict(
        name="train_clip_int8_seed0", protocol="train_clip", variant="int8", seed=0, runs_dir=str(tmp_path)
    )
    partial_path = tmp_path / "scratch_fp8_seed0.out.json"
    (tmp_path / clip["name"]).mkdir()
    (tmp_path / clip["name"] / "train_log.jsonl").write_text(
        '{"step": 5, "loss": 4.0}\n{"step": 100, "x": 1}\n'
    )
    killed = []

    class Child:  # the child process: writes its partial record, then runs past the time budget
        pid = 12345

        def __init__(self, cmd, **kwargs):
            assert kwargs["start_new_session"]  # its own process group, so that killpg reaches its workers
            partial = dict(spec=dict(spec, progress_to=str(partial_path)), status="partial", steps=1000)
            partial["train"] = [dict(step=5, loss=6.0), dict(step=10, loss=5.5)]
            partial_path.write_text(pg.json.dumps(partial))

        def communicate(self, timeout=None):
            if timeout is not None:
                raise pg.subprocess.TimeoutExpired("child", timeout)
            return "", None

    monkeypatch.setattr(pg.subprocess, "Popen", Child)
    monkeypatch.setattr(pg.os, "killpg", lambda pid, sig: killed.append((pid, sig)))
    record, clip_record = pg.launch([spec, clip], tmp_path / "group.json", timeout_s=5)
    assert killed == [(12345, pg.signal.SIGKILL)]
    assert record["status"] == "timeout" and record["output_tail"] == ["timeout"]
    assert record["spec"]["name"] == spec["name"] and record["spec"]["progress_to"] == str(partial_path)
    assert [x["step"] for x in record["train"]] == [5, 10] and record["evals"] == []
    assert clip_record["status"] == "timeout" and clip_record["train"] == [dict(step=5, loss=4.0)]
    assert clip_record["evals"] == [dict(step=100, x=1)]


@pytest.mark.slow
def test_cli_smoke_pretrains_finetunes_and_merges(tmp_path):
    """The command line end to end on the CPU: pretrain, two variants fine-tuned in one process, the table and
    JSON, then --merge re-summarizes the JSON to the same summary."""
    import json
    import subprocess

    env = {"PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    script = str(ROOT / "benchmarks" / "parity.py")
    flags = ["--smoke", "--seeds", "0", "--variants", "bf16", "int8", "--runs_per_process", "2"]
    out, merged = tmp_path / "out", tmp_path / "merged"
    for args in (
        [*flags, "--out_dir", str(out), "--runs_dir", str(tmp_path / "runs")],
        ["--merge", str(out / "parity.json"), "--out_dir", str(merged)],
    ):
        proc = subprocess.run(
            [sys.executable, script, *args], env=env, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((out / "parity.json").read_text())
    assert [r["spec"]["name"] for r in data["runs"]] == [
        "pretrain",
        "finetune_bf16_seed0",
        "finetune_int8_seed0",
    ]
    assert all(r["status"] == "ok" for r in data["runs"])
    (row,) = [r for r in data["summary"]["rows"] if r["variant"] == "int8"]
    assert "d_zero_shot_top1" in row and math.isfinite(row["final_loss"])
    assert "| finetune | int8 | 0 | ok |" in (out / "parity.md").read_text()
    assert json.loads((merged / "parity.json").read_text())["summary"] == data["summary"]


# --- the train_clip protocol ---------------------------------------------------------------------------------
def _clip_spec(variant, **kw):
    spec = _spec(
        protocol="train_clip", task="default", variant=variant, model_config="cfg.json", arch="cfg.json"
    )
    spec.update(num_workers=2, eval_every=0, runs_dir="/runs", data_order="worker-blocks", **kw)
    return spec


def test_train_clip_command_sets_the_variant_and_one_epoch(tmp_path):
    def flags(variant):
        words = tc.train_clip_command(_clip_spec(variant, steps=40, batch_size=8), tmp_path)
        return {w: words[i + 1] if i + 1 < len(words) else None for i, w in enumerate(words)}

    bf16, int8, memeff, grad = flags("bf16"), flags("int8"), flags("int8-memeff"), flags("int8-int8grad")
    assert bf16["--switchback"] == "off" and "--min_tokens" not in bf16
    assert int8["--switchback"] == "on" and int8["--min_tokens"] == "0" and "--precision" not in int8
    assert "--memory_efficient" in memeff and grad["--grad_precision"] == "int8"
    assert flags("fp8-wgrad8")["--wgrad_precision"] == "fp8"
    assert int8["--synthetic_train_samples"] == "320" and int8["--max_train_steps"] == "40"  # one epoch
    assert int8["--output_dir"] == str(tmp_path) and int8["--num_workers"] == "2"


def test_runs_of_the_former_train_clip_harness_merge_with_their_data_order():
    """Records without a spec (the former ViT-B/16-only harness) pair on seed, schedule and data order: before
    the data layout was recorded, batches depended on --num_workers, so the worker count must match."""

    def old(variant, zs, workers, layout=None, extra=""):
        command = f"train_clip.py --model_config x/clip.json --seed 0 --batch_size 8 --num_workers {workers} --lr 5e-4{extra}"
        run = dict(variant=variant, seed=0, status="ok", command=command, wall_s=1.0)
        run.update(train=[dict(step=s, loss=2.0) for s in (5, 10)], evals=[])
        run["results"] = {"zero_shot_top1": zs, "image_to_text_R@1": 0.1, "text_to_image_R@1": 0.2}
        return tc.from_train_clip_harness(run if layout is None else dict(run, data_layout=layout), {})

    def deltas(*runs):
        return [r.get("d_zero_shot_top1") for r in sm.summarize(list(runs))["rows"][1:]]

    assert deltas(old("bf16", 0.9, 5), old("int8", 0.8, 5), old("int8", 0.8, 4)) == [
        pytest.approx(-10.0),
        None,
    ]
    blocks = [old("bf16", 0.9, 5, "worker-blocks"), old("int8", 0.85, 4, "worker-blocks")]
    assert deltas(*blocks) == [pytest.approx(-5.0)]
    assert deltas(blocks[0], old("int8", 0.8, 5, "worker-blocks", " --lr 1e-3")) == [
        None
    ]  # the last flag wins
    assert blocks[1]["results"]["caption_r1"] == 0.1 and blocks[1]["spec"]["arch"] == "clip.json"


@pytest.mark.slow
def test_train_clip_protocol_cpu_smoke(tmp_path):
    """Two tiny train_clip.py runs (bf16, int8) in one child process, read into the paired table."""
    import json
    import subprocess

    env = {"PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    args = ["--protocol", "train_clip", "--smoke", "--seeds", "0", "--variants", "bf16", "int8"]
    args += [
        "--runs_per_process",
        "2",
        "--out_dir",
        str(tmp_path / "out"),
        "--runs_dir",
        str(tmp_path / "runs"),
    ]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "parity.py"), *args],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "out" / "parity.json").read_text())
    bf16, int8 = data["runs"]
    assert bf16["status"] == int8["status"] == "ok"
    assert [x["step"] for x in bf16["train"]] == [1, 2, 3, 4, 5, 6] and "--switchback on" in int8["command"]
    assert int8["results"]["train_clip"]["switchback"]["min_tokens"] == 0
    (row,) = [r for r in data["summary"]["rows"] if r["variant"] == "int8"]
    assert row["steps"] == 6 and "d_zero_shot_top1" in row and math.isfinite(row["d_final_loss"])
    assert (tmp_path / "runs" / "train_clip_int8_seed0" / "all_results.json").exists()


def test_train_clip_protocol_refuses_what_train_clip_would(tmp_path):
    """Refused before any run starts: an eval set larger than train_clip's, a simulated variant."""
    import subprocess

    script = [sys.executable, str(ROOT / "benchmarks" / "parity.py"), "--protocol", "train_clip"]
    for extra, message in (
        (["--eval_samples", "1000"], "synthetic eval set has 576 images"),
        (["--variants", "bf16", "sim-row"], "sim-* variants simulate linears in the graded-shapes protocols"),
    ):
        proc = subprocess.run([*script, *extra, "--out_dir", str(tmp_path)], capture_output=True, text=True)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
