"""The accuracy harness (benchmarks/parity.py): the graded-shapes task, the simulated all-int8 linear, pretrain ->
save -> fine-tune, the paired summary against hand-computed intervals and the recorded tables, both protocols
end to end on the CPU."""

import json
import math
import statistics
import subprocess
import sys
import time

import helpers
import pytest
import torch

sys.path.insert(0, str(helpers.REPO / "benchmarks"))  # the harness's parts live there, outside the package
from accuracy import graded_run as gr
from accuracy import graded_shapes as gs
from accuracy import sim_switchback as ss
from accuracy import summary as sm

pg = helpers.load_script("benchmarks/parity.py")
FIGURES = helpers.REPO / "docs" / "figures"


# --- task ---------------------------------------------------------------------------------------------------
def test_batches_are_a_function_of_seed_and_step_and_captions_match_attributes():
    a = gs.sample(gs.ALL, 64, 16, gs.step_generator("cpu", 3, 7))
    b = gs.sample(gs.ALL, 64, 16, gs.step_generator("cpu", 3, 7))
    c = gs.sample(gs.ALL, 64, 16, gs.step_generator("cpu", 3, 8))
    assert torch.equal(a.pixels, b.pixels) and torch.equal(a.caption, b.caption)
    assert not torch.equal(a.pixels, c.pixels)
    table, classes = gs.caption_table(gs.ALL), gs.ALL.classnames()
    for caption, label in zip(a.caption.tolist(), a.label.tolist(), strict=True):
        assert set(classes[label].split()) <= set(table[caption].split())
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
    white, large, centre = torch.full((n,), 6), torch.full((n,), 2), torch.full((n,), 4)
    masks = gs.render(white, torch.arange(n), large, centre, 32, gs.step_generator("cpu", 0, 0)).mean(1) > 0.6
    for i in range(n):
        assert masks[i].sum() > 20, gs.SHAPES[i]
        for j in range(i):
            assert (masks[i] ^ masks[j]).sum() > 10, (gs.SHAPES[i], gs.SHAPES[j])


# --- the simulated all-int8 linear, against an independent loop-based reference -----------------------------
def _ref_quant_row(row: list[float], run: int) -> list[float]:
    out = []
    for start in range(0, len(row), run):
        block = row[start : start + run]
        scale = max(abs(v) for v in block) / 127 or 1.0
        out += [max(-127, min(127, round(v / scale))) * scale for v in block]  # round half to even, as torch
    return out


def test_row_and_block_quantizers_match_a_loop_reference():
    g = torch.randn(5, 40) * torch.logspace(-3, 1, 40)
    g[2] = 0.0  # an all-zero row stays zero, never NaN
    row, block = ss.fake_quant(g), ss.fake_quant(g, ss.block_size("block16"))
    for i in range(5):
        values = g[i].tolist()
        torch.testing.assert_close(row[i], torch.tensor(_ref_quant_row(values, 40)), rtol=1e-5, atol=0)
        torch.testing.assert_close(block[i], torch.tensor(_ref_quant_row(values, 16)), rtol=1e-5, atol=0)
    w = torch.randn(3, 7)
    expected = torch.tensor(_ref_quant_row(w.flatten().tolist(), 21)).view(3, 7)
    torch.testing.assert_close(ss.fake_quant_tensor(w), expected, rtol=1e-5, atol=0)


def test_blocks_keep_small_entries_that_rows_flush():
    g = torch.full((4, 256), 1e-3)
    g[:, 0] = 1.0  # one outlier per row: every other entry is below absmax / 254
    assert (ss.fake_quant(g)[:, 1:] == 0).all()
    assert (ss.fake_quant(g, 128)[:, 128:] - 1e-3).abs().max() < 1e-5
    assert ss.block_size("row") is None and ss.block_size("block64") == 64
    for bad in ("block", "block0", "row-sr"):
        with pytest.raises(ValueError, match="unknown gradient quantizer"):
            ss.block_size(bad)
    for bad in ("sim-block0", "int9", "sim-"):
        with pytest.raises(pg.argparse.ArgumentTypeError, match="sim-block<N>"):
            pg.variant_arg(bad)


def test_sim_linear_gradients_follow_the_quantizer_and_keep_the_parameters():
    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 8)
    sim = ss.SimSwitchBackLinear(linear, "block4")
    assert sim.weight is linear.weight and sim.bias is linear.bias
    x = torch.randn(2, 3, 16, requires_grad=True)
    grad = torch.randn(2, 3, 8)
    sim(x).backward(grad)
    g, w = grad.view(6, 8), linear.weight.detach()
    expected_x = torch.tensor([_ref_quant_row(row, 4) for row in g.tolist()]) @ ss.fake_quant_tensor(w)
    torch.testing.assert_close(x.grad.view(6, 16), expected_x)
    torch.testing.assert_close(linear.weight.grad, g.t() @ x.detach().view(6, 16))  # grad-weight unquantized
    expected_out = ss.fake_quant(x.detach().view(6, 16)) @ ss.fake_quant_tensor(w).t() + linear.bias
    torch.testing.assert_close(sim(x).detach().view(6, 8), expected_out.detach())


def test_apply_sim_switchback_swaps_the_switchback_targets():
    model = gr.build_model("tiny", 40)
    assert ss.apply_sim_switchback(model, "row") == 12  # q/k/v/out_proj/fc1/fc2 of one layer per tower
    assert sum(isinstance(m, ss.SimSwitchBackLinear) for m in model.modules()) == 12
    assert not isinstance(model.visual_projection, ss.SimSwitchBackLinear)


# --- runs: pretrain -> save -> fine-tune, the memory switch, child processes ----------------------------------
def _spec(**kw):
    spec = dict(protocol="finetune", task="finetune", steps=3, batch_size=8, lr=1e-3, warmup=1, arch="tiny")
    return {
        **spec,
        **dict(eval_samples=20, log_every=1, init_from=None, variant="bf16", seed=0, name="t"),
        **kw,
    }


def test_pretrain_save_finetune_round_trip(tmp_path):
    from transformers import CLIPModel

    ckpt = tmp_path / "pretrained"
    pre = gr.train_graded(_spec(protocol="pretrain", task="pretrain", save_to=str(ckpt)))
    assert pre["status"] == "ok" and set(pre["zero_shot_before_finetune"]) == {"zero_shot_top1", "caption_r1"}
    assert all(
        type(m).__module__.startswith(("torch", "transformers"))
        for m in CLIPModel.from_pretrained(ckpt).modules()
    )
    runs = [gr.train_graded(_spec(init_from=str(ckpt), variant=v, seed=1)) for v in ("bf16", "sim-block8")]
    for run in runs:
        assert run["status"] == "ok" and len(run["train"]) == 3 and 0 <= run["results"]["zero_shot_top1"] <= 1
    # same start and batches: the first step's loss (before any update) is the same up to int8 rounding
    assert runs[0]["train"][0]["loss"] == pytest.approx(runs[1]["train"][0]["loss"], rel=2e-2)
    assert runs[0]["train"][-1]["loss"] != runs[1]["train"][-1]["loss"]  # the simulated gradients differ


def test_memory_switch_variant_fuses_the_mlps_and_trains():
    from hf_switchback.blocks.mlp import is_fused_mlp

    model = gr.build_model("tiny", 40)
    gr.apply_variant(model, "int8-memeff")
    assert sum(is_fused_mlp(m) for m in model.modules()) == 2  # one MLP per tower
    run = gr.train_graded(_spec(variant="int8-memeff", seed=1))
    assert run["status"] == "ok" and all(math.isfinite(r["loss"]) for r in run["train"])


def test_runs_of_one_process_each_leave_their_record(tmp_path):
    specs = [_spec(steps=2, eval_samples=16, name="g_ok"), _spec(steps=2, name="g_bad", task="no-such-task")]
    records = pg.run_specs(specs, tmp_path, parallel=1, budget_s=300, per_process=2)
    assert [(r["spec"]["name"], r["status"]) for r in records] == [("g_ok", "ok"), ("g_bad", "failed")]
    assert "no-such-task" in "\n".join(records[1]["output_tail"])
    assert len(records[0]["train"]) == 2 and records[1]["train"] == []


def test_a_killed_run_keeps_its_partial_curve_and_is_marked_timeout(tmp_path, monkeypatch):
    """The launcher kills the child's whole process group at the time budget and keeps the curve of the partial
    record the run left, under its own spec and status."""
    spec = dict(name="scratch_fp8_seed0", protocol="scratch", variant="fp8", seed=0)
    partial_path, killed = tmp_path / "scratch_fp8_seed0.out.json", []

    class Child:  # writes its partial record, then runs past the time budget
        pid = 12345

        def __init__(self, cmd, **kwargs):
            assert kwargs[
                "start_new_session"
            ]  # its own process group, so that killpg reaches what it started
            curve = [dict(step=5, loss=6.0), dict(step=10, loss=5.5)]
            partial_path.write_text(json.dumps(dict(spec=dict(spec, x=1), status="partial", train=curve)))

        def communicate(self, timeout=None):
            if timeout is not None:
                raise subprocess.TimeoutExpired("child", timeout)
            return "", None

    monkeypatch.setattr(pg.subprocess, "Popen", Child)
    monkeypatch.setattr(pg.os, "killpg", lambda pid, sig: killed.append((pid, sig)))
    (record,) = pg.launch([spec], tmp_path / "group.json", timeout_s=5)
    assert killed == [(12345, pg.signal.SIGKILL)]
    assert (
        record["status"] == "timeout" and record["output_tail"] == ["timeout"] and "x" not in record["spec"]
    )
    assert [x["step"] for x in record["train"]] == [5, 10] and record["evals"] == []


def test_auto_steps_are_what_fits_before_the_deadline_at_the_speed_so_far():
    spec = _spec(steps="auto", max_steps=10_000, deadline=time.time() + 30)
    count = gr.decide_steps(spec, 10, 2.0, torch.device("cpu"))
    assert 10 + 0.8 * 5 * 29 <= count <= 10 + 0.8 * 5 * 30  # 10 steps in 2 s: 10 + 0.8 x 5 steps/s x ~30 s
    assert gr.decide_steps(dict(spec, max_steps=50), 10, 0.1, torch.device("cpu")) == 50
    assert gr.decide_steps(dict(spec, deadline=time.time() - 1), 10, 1.0, torch.device("cpu")) == 11


# --- summary maths -------------------------------------------------------------------------------------------
def _run(variant, seed, zs, r1, losses, status="ok", protocol="finetune"):
    spec = _spec(variant=variant, seed=seed, protocol=protocol, name=f"{variant}{seed}", steps=len(losses))
    train = [dict(step=i, loss=v) for i, v in enumerate(losses)]
    return dict(spec=spec, status=status, train=train, results=dict(zero_shot_top1=zs, caption_r1=r1))


def test_summary_pairs_by_seed_and_reads_a_t_interval():
    base = [0.80, 0.70, 0.75, 0.90, 0.85]
    deltas = [0.001, -0.002, 0.003, 0.000, 0.001]
    runs = []
    for seed, (b, d) in enumerate(zip(base, deltas, strict=True)):
        runs += [
            _run("bf16", seed, b, b / 2, [2.0] * 10),
            _run("int8", seed, b + d, b / 2 - 0.01, [2.1] * 10),
        ]
    runs.append(_run("int8", 9, 0.1, 0.1, [9.0] * 10))  # no bf16 partner: left out
    runs.append(_run("int8", 0, 0.1, 0.1, [9.0] * 10, status="failed"))
    summary = sm.summarize(runs)
    (pool,) = summary["pooled"]
    d = [100 * x for x in deltas]
    half = 2.78 * statistics.stdev(d) / math.sqrt(5)  # t(0.975, 4 df)
    assert pool["d_zero_shot_top1"]["n"] == 5
    assert pool["d_zero_shot_top1"]["mean"] == pytest.approx(statistics.mean(d))
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


def test_drop_steps_are_read_on_the_smoothed_curve_and_date_a_late_escape():
    train = [dict(step=5 * (i + 1), loss=v) for i, v in enumerate([3.0, 3.0, 3.0, 1.0, 1.0, 1.0])]
    # EMA 0.8 from 3.0: 3.0, 3.0, 3.0, 2.6, 2.28 -> first at or below 2.5 on the 5th entry (step 25)
    assert sm.drop_step(train, 2.5) == 25
    assert sm.drop_step(train, 0.5) is None and sm.drop_step([], 2.5) is None
    early, late = [5.0] * 2 + [1.0] * 38, [5.0] * 30 + [1.0] * 10
    runs = [
        _run("bf16", 0, 0.5, 0.5, early, protocol="scratch"),
        _run("bf16", 1, 0.5, 0.5, late, protocol="scratch"),
    ]
    for r in runs:
        r["spec"]["batch_size"] = 148  # ln(148) ~ 5.0
    spread = [s for s in sm.summarize(runs)["drop_spread"] if s["fraction"] == 0.5]
    assert spread[0]["min"] < 10 and spread[0]["max"] >= 30


def test_pairs_use_the_step_count_the_runs_trained_with():
    a, b = _run("bf16", 0, 0.5, 0.5, [2.0] * 10), _run("int8", 0, 0.5, 0.5, [2.0] * 10)
    a["spec"]["steps"] = b["spec"]["steps"] = "auto"
    a["steps"], b["steps"] = 100, 120
    assert "d_zero_shot_top1" not in sm.summarize([a, b])["rows"][1]
    b["steps"] = 100
    assert sm.summarize([a, b])["rows"][1]["d_zero_shot_top1"] == 0.0


@pytest.mark.parametrize("protocol", ["finetune", "scratch"])
def test_the_recorded_runs_give_the_recorded_table(protocol):
    """BENCHMARKS.md's current table, from the committed runs: the summary stored with them and its figures."""
    data = json.loads((FIGURES / f"parity_{protocol}" / "h100" / "parity.json").read_text())
    pooled = {p["variant"]: p for p in sm.summarize(data["runs"])["pooled"]}
    stored = {p["variant"]: p for p in data["summary"]["pooled"]}
    assert pooled.keys() == stored.keys()
    for variant, pool in pooled.items():
        for key in ("d_zero_shot_top1", "d_caption_r1", "d_final_loss"):
            assert pool[key] == pytest.approx(stored[variant][key], rel=1e-9), (variant, key)
    zero_shot = pooled["int8"][
        "d_zero_shot_top1"
    ]  # BENCHMARKS.md: +0.01 (-0.09 to +0.10) / +0.04 (-0.27 to +0.35)
    expected = dict(finetune=(5, 0.01, -0.09, 0.10), scratch=(10, 0.04, -0.27, 0.35))[protocol]
    assert zero_shot["n"] == expected[0]
    assert [zero_shot[k] for k in ("mean", "low", "high")] == pytest.approx(expected[1:], abs=0.005)


# --- the command line ----------------------------------------------------------------------------------------
def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(helpers.REPO / "src"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    script = str(helpers.REPO / "benchmarks" / "parity.py")
    return subprocess.run(
        [sys.executable, script, *args], env=env, capture_output=True, text=True, timeout=300
    )


def test_merge_refuses_runs_of_the_train_clip_harness_by_name(tmp_path):
    proc = _cli("--merge", str(FIGURES / "parity_1000" / "parity.json"), "--out_dir", str(tmp_path))
    assert proc.returncode == 1 and "train_clip harness" in proc.stderr and "aa227a1" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "protocol, variants, names",
    [
        ("finetune", ["bf16", "int8"], ["pretrain", "finetune_bf16_seed0", "finetune_int8_seed0"]),
        ("scratch", ["bf16", "sim-block8"], ["scratch_bf16_seed0", "scratch_sim-block8_seed0"]),
    ],
)
def test_cli_smoke_runs_a_protocol_and_merges(tmp_path, protocol, variants, names):
    """Each protocol end to end on the CPU (a seed's variants in one process), the table and JSON, then --merge
    re-summarizes the JSON to the same summary."""
    out, merged = tmp_path / "out", tmp_path / "merged"
    proc = _cli(
        "--protocol",
        protocol,
        "--smoke",
        "--seeds",
        "0",
        "--variants",
        *variants,
        "--runs_per_process",
        "2",
        "--out_dir",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((out / "parity.json").read_text())
    assert [r["spec"]["name"] for r in data["runs"]] == names and all(
        r["status"] == "ok" for r in data["runs"]
    )
    (row,) = [r for r in data["summary"]["rows"] if r["variant"] == variants[1]]
    assert (
        "d_zero_shot_top1" in row and math.isfinite(row["final_loss"]) and math.isfinite(row["d_final_loss"])
    )
    assert f"| {protocol} | {variants[1]} | 0 | ok | 6 |" in (out / "parity.md").read_text()
    proc = _cli("--merge", str(out / "parity.json"), "--out_dir", str(merged))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((merged / "parity.json").read_text())["summary"] == data["summary"]
