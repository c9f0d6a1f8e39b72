"""Accuracy parity: SwitchBack variants against bf16 in paired runs (same init, same batches), 95% t intervals.

Three protocols:

    finetune    small CLIP models on `accuracy.graded_shapes`: pretrain once in bf16 on the PRETRAIN task (8
                colours x 6 shapes) and save a normal HF checkpoint (CLIPModel.save_pretrained + tokenizer), or
                take one with --init_from DIR; then fine-tune it on the shifted FINETUNE task (6 new colours, 4
                new shapes, new words) once per (variant, seed)
    scratch     the same models from a seeded random init on the ALL task (14 colours x 10 shapes, graded)
    train_clip  examples/train_clip.py itself per (variant, seed): --model_config (ViT-B/16) from scratch on
                the embedded synthetic set, its DataLoader workers, bf16 autocast on a GPU. That task leaves its
                loss plateau at a step that varies by hundreds between seeds and has 576 eval images, so it
                cannot resolve 0.5 pp (BENCHMARKS.md); it checks the training script end to end at full size

Graded-shapes batches are generated on the device from (seed, step), so runs of one seed see identical batches
and need no loader workers; the eval uses --eval_samples held-out images (default 10,000: one accuracy's
binomial SE is at most 0.5 pp): zero-shot top-1 over colour x shape classes and image->caption R@1 (the one full
caption among all of the task's; train_clip: its image_to_text_R@1). Every run is paired with the bf16 run of the
same seed and schedule; per variant the table gives the mean paired difference of zero-shot, R@1 and final loss
with its 95% Student t interval, and the verdict against +-0.5 pp. It also dates when each run's smoothed loss
crossed fixed fractions of its way down, to show whether runs split into early and late escapes.

Variants: bf16 (no SwitchBack), int8 (the library default: on Hopper/Ada fp8 output gradients), fp8,
int8-int8grad (the paper's all-int8), int8-rowweight (row-wise weight scales), int8-memeff (the memory switch:
memory_efficient=True), fp8-wgrad8 (fp8 with wgrad_precision="fp8": the weight gradient in fp8 too), and, graded
shapes only, sim-<q>: all-int8 SwitchBack simulated in torch (`accuracy.sim_switchback`) with output-gradient
quantizer q (row, block128, row-sr, row-outlier8, ...).

    # one H100: pretrain once, then 4 variants x 5 seeds fine-tuned, one process per seed (its 4 variants one
    # after another: small runs are host-bound, and each process pays its own CUDA context and Triton autotune;
    # 12-20 processes of one run each on 16 CPU cores did not finish a single SwitchBack run)
    PYTHONPATH=src python benchmarks/parity.py --protocol finetune --arch small --batch_size 512 \
        --eval_samples 5000 --variants bf16 int8 fp8 int8-int8grad --seeds 0 1 2 3 4 --parallel 5 \
        --runs_per_process 4 --pretrain_steps auto --steps 150 --warmup 15 --lr 3e-4 --warm --out_dir $OUT/ft
    # ViT-B/16 through train_clip.py, two runs sharing the GPU (~420 s on an H100)
    PYTHONPATH=src python benchmarks/parity.py --protocol train_clip --steps 1000 --batch_size 256 --lr 5e-4 \
        --warmup 60 --eval_samples 576 --eval_every 100 --seeds 3 --variants bf16 int8 --parallel 2 \
        --num_workers 7 --time_budget_s 570 --out_dir $OUT/s3
    # re-summarize (and plot) saved results on any machine
    python benchmarks/parity.py --merge ft/parity.json --out_dir docs/figures/parity_finetune
    # CPU smoke tests
    PYTHONPATH=src python benchmarks/parity.py --protocol finetune --smoke --out_dir /tmp/pg
    PYTHONPATH=src python benchmarks/parity.py --protocol train_clip --smoke --variants bf16 int8 --out_dir /tmp/pc
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))  # `accuracy` and `common`, however this file is loaded
import common  # noqa: E402
from common import mean_se, t95  # noqa: E402

BOUND_PP = 0.5
METRICS = (("zero_shot_top1", "zero-shot top-1", 100.0), ("caption_r1", "image→caption R@1", 100.0))
# model sizes (both towers alike): hidden, layers (vision, text), heads, MLP width, image side, patch
ARCHS = {
    "tiny": dict(hidden=32, layers=(1, 1), heads=2, mlp=64, image=16, patch=4),
    # CPU experiments: 16 px images, 16 patches, two layers of width 64 per tower
    "cpu": dict(hidden=64, layers=(2, 2), heads=2, mlp=256, image=16, patch=4),
    "cpu-wide": dict(hidden=192, layers=(3, 2), heads=3, mlp=768, image=16, patch=4),
    "mini": dict(hidden=128, layers=(3, 2), heads=4, mlp=512, image=32, patch=4),
    # ~ViT-Ti/S-sized towers at 32 px: 6 + 4 layers of width 256 (4.7M + 3.2M encoder parameters)
    "small": dict(hidden=256, layers=(6, 4), heads=4, mlp=1024, image=32, patch=4),
}
PROTOCOL_TASK = {"pretrain": "pretrain", "finetune": "finetune", "scratch": "all", "train_clip": "default"}
TRAIN_CLIP = ROOT / "examples" / "train_clip.py"
VIT_B16 = ROOT / "examples" / "configs" / "clip-vit-b-16.json"
DROP_FRACTIONS = (0.5, 0.8, 0.9)
LAST_FRACTION = 0.2  # "final loss" = mean over the last 20% of logged steps
MAX_TEXT = 12
WAVE_RESERVE_S = 25
SPEED_SAFETY = 0.8  # steps="auto": plan for 80% of the speed measured over the warm-up steps
EVAL_RESERVE_S = 20.0  # steps="auto": time kept for the final eval (and saving) after training


# ------------------------------------------------------------------------------------------------------------
# One run (in its own process)
# ------------------------------------------------------------------------------------------------------------
def build_model(arch: str, vocab_size: int):
    from transformers import CLIPConfig, CLIPModel

    a = ARCHS[arch]
    tower = dict(hidden_size=a["hidden"], intermediate_size=a["mlp"], num_attention_heads=a["heads"])
    text = dict(
        tower, num_hidden_layers=a["layers"][1], vocab_size=vocab_size, max_position_embeddings=MAX_TEXT
    )
    text.update(pad_token_id=0, bos_token_id=2, eos_token_id=3)
    vision = dict(tower, num_hidden_layers=a["layers"][0], image_size=a["image"], patch_size=a["patch"])
    config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=a["hidden"] // 2)
    return CLIPModel(config)


# The SwitchBack variants: the SwitchBackConfig fields each one sets.
SWITCHBACK_FIELDS = {
    "int8": {},
    "fp8": dict(precision="fp8"),
    "int8-int8grad": dict(grad_precision="int8"),
    "int8-rowweight": dict(weight_scaling="row"),
    # the memory switch: 8-bit saved inputs, fused MLPs (dW from the dequantized input)
    "int8-memeff": dict(memory_efficient=True),
    # opt-in beyond the paper: the weight-gradient GEMM in fp8 too (all three GEMMs of each linear 8-bit)
    "fp8-wgrad8": dict(precision="fp8", wgrad_precision="fp8"),
}


def apply_variant(model, variant: str) -> list:
    """Swap the linears for the variant; returns the simulated linears (for gradient statistics)."""
    from accuracy.sim_switchback import apply_sim_switchback

    from hf_switchback import SwitchBackConfig, apply_switchback

    if variant == "bf16":
        return []
    if variant in SWITCHBACK_FIELDS:
        # min_tokens=0: small batches would otherwise run the 16-bit matmul and compare bf16 with itself
        apply_switchback(model, SwitchBackConfig(**SWITCHBACK_FIELDS[variant], min_tokens=0))
        return []
    if variant.startswith("sim-"):
        return apply_sim_switchback(model, variant[len("sim-") :])
    raise ValueError(f"unknown variant {variant!r}")


def check_variant(variant: str) -> str:
    if variant == "bf16" or variant in SWITCHBACK_FIELDS:
        return variant
    if variant.startswith("sim-"):
        from accuracy.grad_quant_sim import parse_grad_quantizer

        parse_grad_quantizer(variant[len("sim-") :])
        return variant
    raise argparse.ArgumentTypeError(f"unknown variant {variant!r}")


def lr_at(step: int, steps: int, warmup: int, lr: float) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * 0.5 * (1 + math.cos(math.pi * progress))


def encode_texts(model, ids, mask, chunk=2048):
    import torch

    feats = [
        model.get_text_features(input_ids=ids[i : i + chunk], attention_mask=mask[i : i + chunk])
        for i in range(0, len(ids), chunk)
    ]
    feats = [f.pooler_output if hasattr(f, "pooler_output") else f for f in feats]
    return torch.nn.functional.normalize(torch.cat(feats).float(), dim=-1)


def encode_images(model, pixels):
    import torch

    f = model.get_image_features(pixel_values=pixels * 2 - 1)
    f = f.pooler_output if hasattr(f, "pooler_output") else f
    return torch.nn.functional.normalize(f.float(), dim=-1)


def evaluate(model, tokenizer, task, spec: dict, device, autocast) -> dict:
    """Zero-shot top-1 (colour x shape prompts) and image->caption R@1 on spec['eval_samples'] images."""
    import torch
    from accuracy import graded_shapes as gs

    model.eval()
    with torch.no_grad(), autocast():

        def table(texts):
            t = tokenizer(texts, padding="max_length", max_length=MAX_TEXT, return_tensors="pt")
            return encode_texts(model, t["input_ids"].to(device), t["attention_mask"].to(device))

        prompts = table([gs.PROMPT.format(c) for c in task.classnames()])
        captions = table(task.full_captions())
        hits = dict(zero_shot_top1=0, caption_r1=0)
        image_size = ARCHS[spec["arch"]]["image"]
        for b in gs.eval_batches(task, spec["eval_samples"], image_size, device):
            img = encode_images(model, b.pixels)
            hits["zero_shot_top1"] += (img @ prompts.T).argmax(1).eq(b.label).sum().item()
            hits["caption_r1"] += (img @ captions.T).argmax(1).eq(b.caption).sum().item()
    model.train()
    return {k: v / spec["eval_samples"] for k, v in hits.items()}


def decide_steps(spec: dict, done: int, elapsed_s: float, device) -> int:
    """The step count of a spec with steps="auto" (pretraining): what fits before spec["deadline"] (epoch
    seconds) at this run's speed so far."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize()
    rate = done / max(elapsed_s, 1e-6)
    left = spec["deadline"] - time.time()
    return max(done + 1, min(spec["max_steps"], int(done + SPEED_SAFETY * rate * left)))


def write_atomic(path: Path, value) -> None:
    """Write JSON so that a reader polling for the file never sees it half written."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value))
    tmp.rename(path)


def layer_kind(name: str) -> str:
    """'vision fc2', 'text q_proj', ... of a dotted CLIP module name."""
    tower = "vision" if name.startswith("vision") else "text"
    return f"{tower} {name.rsplit('.', 1)[-1]}"


def layer_stats(sims: list) -> dict:
    """Gradient statistics of one step: the mean over all simulated linears, and row-wise flush and
    absmax / RMS per layer kind ("by_kind"), to see where the outliers are."""
    per_layer = [(layer_kind(getattr(sim, "name", "")), s) for sim in sims for s in sim.record]
    if not per_layer:
        return {}
    out = {k: sum(s[k] for _, s in per_layer) / len(per_layer) for k in per_layer[0][1]}
    by_kind: dict[str, list] = {}
    for kind, s in per_layer:
        by_kind.setdefault(kind, []).append(s)
    keys = [k for k in ("row/flushed", "row_absmax_over_rms_median") if k in per_layer[0][1]]
    out["by_kind"] = {
        kind: {k: sum(s[k] for s in group) / len(group) for k in keys} for kind, group in by_kind.items()
    }
    return out


def train_one(spec: dict) -> dict:
    """Train one run as `spec` says; returns its record (losses, evals, timings, gradient statistics)."""
    if spec.get("model_config"):
        return train_clip_run(spec)
    import torch
    from accuracy import graded_shapes as gs

    from hf_switchback.training.tokenizer import build_word_tokenizer

    t0 = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    use_bf16 = device.type == "cuda"

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16)

    torch.manual_seed(spec["seed"])
    if spec.get("init_from"):
        from transformers import AutoTokenizer, CLIPModel

        model = CLIPModel.from_pretrained(spec["init_from"])
        tokenizer = AutoTokenizer.from_pretrained(spec["init_from"])
    else:
        tokenizer = build_word_tokenizer(gs.vocabulary(), model_max_length=MAX_TEXT)
        model = build_model(spec["arch"], len(tokenizer))
    model.to(device)
    sims = apply_variant(model, spec["variant"])
    task = gs.TASKS[spec["task"]]
    table = tokenizer(gs.caption_table(task), padding="max_length", max_length=MAX_TEXT, return_tensors="pt")
    ids, mask = table["input_ids"].to(device), table["attention_mask"].to(device)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embedding" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embedding" not in n)]
    groups = [dict(params=decay, weight_decay=0.1), dict(params=rest, weight_decay=0.0)]
    opt = torch.optim.AdamW(groups, lr=spec["lr"], betas=(0.9, 0.98), eps=1e-6)
    image_size = ARCHS[spec["arch"]]["image"]
    record = dict(spec=spec, train=[], evals=[], grad_stats=[], device=str(device), steps=spec["steps"])
    model.train()
    t_train = time.perf_counter()
    steps = spec["max_steps"] if spec["steps"] == "auto" else spec["steps"]
    step = 0
    while step < steps:
        if spec["steps"] == "auto" and step == spec["warmup"]:
            # the learning rate so far did not depend on the step count: decide it now, from the speed so far
            steps = decide_steps(spec, step, time.perf_counter() - t_train, device)
            record["steps"] = steps
        if step and step % 25 == 0 and spec.get("progress_to"):  # a killed run still leaves its curve
            write_atomic(Path(spec["progress_to"]), dict(record, status="partial"))
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, spec["warmup"], spec["lr"])
        batch = gs.sample(task, spec["batch_size"], image_size, gs.step_generator(device, spec["seed"], step))
        stats_step = bool(sims) and spec.get("stats_every") and step % spec["stats_every"] == 0
        for sim in sims:
            sim.record = [] if stats_step else None
            sim.stat_quantizers = tuple(spec.get("stat_quantizers", ("row",)))
        with autocast():
            out = model(
                input_ids=ids[batch.caption],
                attention_mask=mask[batch.caption],
                pixel_values=batch.pixels * 2 - 1,
            )
            logits = out.logits_per_image.float()
            labels = torch.arange(len(logits), device=device)
            loss = (
                torch.nn.functional.cross_entropy(logits, labels)
                + torch.nn.functional.cross_entropy(logits.T, labels)
            ) / 2
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))
        if step % spec["log_every"] == 0 or step == steps - 1:
            record["train"].append(dict(step=step, loss=loss.item()))
            if not math.isfinite(record["train"][-1]["loss"]):
                record["status"] = "diverged"
                break
        if stats_step:
            record["grad_stats"].append(dict(step=step, **layer_stats(sims)))
            for sim in sims:
                sim.record = None
        if spec.get("eval_every") and step and step % spec["eval_every"] == 0:
            record["evals"].append(
                dict(step=step, **evaluate(model, tokenizer, task, spec, device, autocast))
            )
        step += 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    record["train_s"] = time.perf_counter() - t_train
    record["status"] = record.get("status", "ok")
    if record["status"] == "ok":
        record["results"] = evaluate(model, tokenizer, task, spec, device, autocast)
        record["evals"].append(dict(step=steps, **record["results"]))
    if spec.get("save_to"):
        from hf_switchback import remove_switchback

        remove_switchback(model)
        model.save_pretrained(spec["save_to"])
        tokenizer.save_pretrained(spec["save_to"])
        # what the pretrained model already knows of the shifted task (new words untrained)
        shifted = gs.TASKS[spec.get("then_task", "finetune")]
        record["zero_shot_before_finetune"] = evaluate(model, tokenizer, shifted, spec, device, autocast)
    record["wall_s"] = time.perf_counter() - t0
    return record


# ------------------------------------------------------------------------------------------------------------
# The train_clip protocol: one examples/train_clip.py process per run
# ------------------------------------------------------------------------------------------------------------
def run_dir_of(spec: dict) -> Path:
    """Where a train_clip run writes (by name: warm-up runs get their own)."""
    return Path(spec["runs_dir"]) / spec["name"]


def train_clip_command(spec: dict, run_dir: Path) -> list[str]:
    """The train_clip.py command line of one run."""
    import torch

    # min_tokens 0: a parity run measures the 8-bit path; with the default floor the measured crossover table
    # (kernels/crossover) would keep most layers 16-bit on Hopper and compare bf16 with itself
    flags = (
        ["--switchback", "off"] if spec["variant"] == "bf16" else ["--switchback", "on", "--min_tokens", "0"]
    )
    for field, value in SWITCHBACK_FIELDS.get(spec["variant"], {}).items():
        flags += [f"--{field}"] if value is True else [f"--{field}", str(value)]
    steps, batch = spec["steps"], spec["batch_size"]
    numbers = dict(
        seed=spec["seed"], batch_size=batch, max_train_steps=steps, lr=spec["lr"], warmup_steps=spec["warmup"],
        synthetic_train_samples=steps * batch,  # one epoch: no loader restart
        num_workers=spec["num_workers"], max_eval_samples=spec["eval_samples"], logging_steps=spec["log_every"],
        eval_steps=spec["eval_every"], mixed_precision="bf16" if torch.cuda.is_available() else "no",
    )  # fmt: skip
    cmd = [sys.executable, str(TRAIN_CLIP), "--model_config", spec["model_config"], *flags]
    cmd += [word for key, value in numbers.items() for word in (f"--{key}", str(value))]
    return [*cmd, "--output_dir", str(run_dir), "--overwrite_output_dir", "--report_to", "none"]


def read_train_log(path: Path) -> tuple[list[dict], list[dict]]:
    """(training lines, eval lines) of a train_log.jsonl; eval lines are the ones without a loss."""
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    return [x for x in lines if "loss" in x], [x for x in lines if "loss" not in x]


def train_clip_results(results: dict) -> dict:
    """train_clip's all_results.json in this harness's metrics (its own figures kept under "train_clip")."""
    return dict(
        zero_shot_top1=results.get("zero_shot_top1"),
        caption_r1=results.get("image_to_text_R@1"),
        train_clip=results,
    )


def train_clip_run(spec: dict) -> dict:
    """One train_clip.py run (its DataLoader workers in this process group: a timeout kills them too)."""
    t0 = time.perf_counter()
    run_dir = run_dir_of(spec)
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = train_clip_command(spec, run_dir)
    with open(run_dir / "stdout.txt", "w") as out:
        returncode = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode
    train, evals = read_train_log(run_dir / "train_log.jsonl")
    record = dict(
        spec=spec, train=train, evals=evals, grad_stats=[], steps=spec["steps"], command=" ".join(cmd)
    )
    results = run_dir / "all_results.json"
    if returncode == 0 and results.exists():
        record.update(status="ok", results=train_clip_results(json.loads(results.read_text())))
    else:
        record.update(status="failed", output_tail=(run_dir / "stdout.txt").read_text().splitlines()[-30:])
    record["train_s"] = record["wall_s"] = time.perf_counter() - t0
    return record


def from_train_clip_harness(run: dict, env: dict) -> dict:
    """A run record of the former train_clip-only harness (no "spec") in this harness's form, for --merge.

    Its runs before 2026-11-23 (no "data_layout") drew batches that depended on --num_workers: the worker
    count joins the pairing key there."""
    words = run.get("command", "").split()
    flag = {w: words[i + 1] for i, w in enumerate(words[:-1]) if w.startswith("--")}  # the last one wins
    layout = run.get("data_layout") or f"strided-{flag.get('--num_workers')}"
    spec = dict(
        protocol="train_clip", task="default", variant=run["variant"], seed=run["seed"], data_order=layout,
        name=f"train_clip_{run['variant']}_seed{run['seed']}", arch=Path(flag.get("--model_config", "?")).name,
        batch_size=int(flag.get("--batch_size", env.get("batch_size", 0))), lr=float(flag.get("--lr", 0)),
        warmup=int(flag.get("--warmup_steps", 0)), eval_samples=int(flag.get("--max_eval_samples", 0)),
        steps=int(flag.get("--max_train_steps", env.get("steps", 0))), mixed=flag.get("--mixed_precision"),
        num_workers=int(flag.get("--num_workers", 0)),
    )  # fmt: skip
    results = run.get("results")
    return dict(
        run, spec=spec, steps=spec["steps"], grad_stats=[], train_s=run.get("wall_s"),
        results=train_clip_results(results) if results else None,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------------------
# Many runs (subprocesses, several at a time)
# ------------------------------------------------------------------------------------------------------------
def launch(specs: list[dict], path: Path, timeout_s: float) -> list[dict]:
    """Run `specs` one after another in one child process (one CUDA context and one Triton autotune for all
    of them); their records, a failure record for each that did not finish."""
    specs = [dict(s, progress_to=str(path.with_name(f"{s['name']}.out.json"))) for s in specs]
    for s in specs:
        Path(s["progress_to"]).unlink(missing_ok=True)
    path.write_text(json.dumps(specs))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--one_run",
        str(path),
        "--out_dir",
        str(path.parent),
    ]
    t0 = time.perf_counter()
    # its own process group, killed whole on timeout: train_clip runs and their DataLoader workers go with it
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        tail, status = proc.communicate(timeout=max(5.0, timeout_s))[0].splitlines()[-30:], "failed"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        tail, status = ["timeout"], "timeout"
    records = []
    for spec in specs:
        out = Path(spec["progress_to"])
        record = json.loads(out.read_text()) if out.exists() else {}
        if record and record.get("status") != "partial":
            records.append(record)
            continue
        # a killed or failed run: its curve so far (written every 25 steps, or train_clip's log), no final eval
        # (the partial record carries its own spec and status: ours replace them, not collide with them)
        train, evals = (
            read_train_log(run_dir_of(spec) / "train_log.jsonl") if "runs_dir" in spec else ([], [])
        )
        empty = dict(train=train, evals=evals, grad_stats=[])
        ended = dict(spec=spec, status=status, output_tail=tail, wall_s=time.perf_counter() - t0)
        records.append({**empty, **record, **ended})
    return records


def run_specs(
    specs: list[dict], runs_dir: Path, parallel: int, budget_s: float, on_wave=None, per_process: int = 1
) -> list[dict]:
    """Run specs within budget_s seconds: `per_process` consecutive specs one after another in one child
    process, `parallel` such processes at a time. Returns their records in order."""
    groups = [specs[i : i + per_process] for i in range(0, len(specs), per_process)]
    runs, start = [], time.perf_counter()
    for first in range(0, len(groups), parallel):
        wave = groups[first : first + parallel]
        left = budget_s - (time.perf_counter() - start)
        # the wave may use all but WAVE_RESERVE_S per later wave: a slow first wave still finishes (whole
        # pairs), later ones are cut instead
        share = left - WAVE_RESERVE_S * (math.ceil((len(groups) - first) / parallel) - 1)
        deadline = time.time() + share - EVAL_RESERVE_S
        wave = [[dict(s, deadline=deadline) if s["steps"] == "auto" else s for s in g] for g in wave]
        with ThreadPoolExecutor(max_workers=len(wave)) as pool:
            futures = [pool.submit(launch, g, runs_dir / f"{g[0]['name']}.json", share) for g in wave]
            done = [r for f in futures for r in f.result()]
        for r in done:
            brief = {k: r.get(k) for k in ("status", "results", "wall_s", "train_s")}
            print(json.dumps(dict(name=r["spec"]["name"], **brief)), flush=True)
        runs += done
        if on_wave:
            on_wave(runs)
    return runs


# ------------------------------------------------------------------------------------------------------------
# Summary
# ------------------------------------------------------------------------------------------------------------
def tail_window(train: list[dict]) -> list[dict]:
    """The last LAST_FRACTION of logged training steps (at least one): the window of "final loss"."""
    return train[-max(1, math.ceil(len(train) * LAST_FRACTION)) :]


def final_loss(run: dict) -> float | None:
    return mean_se([x["loss"] for x in tail_window(run["train"])])[0] if run["train"] else None


def ema_of(values: list[float], decay: float = 0.8) -> list[float]:
    """The loss curve smoothed as plotted (exponential moving average)."""
    out, ema = [], values[0]
    for v in values:
        ema = decay * ema + (1 - decay) * v
        out.append(ema)
    return out


def drop_step(train: list[dict], level: float) -> int | None:
    """First logged step whose smoothed loss is at or below `level`; None if never."""
    smoothed = ema_of([x["loss"] for x in train]) if train else []
    return next((x["step"] for x, s in zip(train, smoothed, strict=True) if s <= level), None)


def pair_key(run: dict) -> tuple:
    """What fixes a run's weights at start, batches and schedule: runs pair with bf16 only when all are equal
    (the step count is the one the run trained with, also when its spec said "auto")."""
    spec = run["spec"]
    keys = (
        "protocol",
        "task",
        "seed",
        "batch_size",
        "lr",
        "warmup",
        "arch",
        "init_id",
        "eval_samples",
        "data_order",
    )
    return (*(spec.get(k) for k in keys), run.get("steps", spec.get("steps")))


def interval(diffs: list[float]) -> dict:
    """Mean, SE and two-sided 95% Student t interval of paired differences (None where undefined)."""
    mean, se = mean_se(diffs)
    out = dict(n=len(diffs), mean=mean, se=se, low=None, high=None)
    if se is not None:
        half = t95(len(diffs) - 1) * se
        out.update(low=mean - half, high=mean + half)
    return out


def verdict(iv: dict, bound: float = BOUND_PP, min_pairs: int = 5) -> str:
    """Read a paired-difference interval (pp) against +-bound: resolved when it lies inside or outside."""
    if iv["n"] < min_pairs or iv["low"] is None:
        return f"not resolved ({iv['n']} pairs; needs >= {min_pairs})"
    span = f"95% interval {iv['low']:+.2f} to {iv['high']:+.2f} pp"
    if -bound <= iv["low"] and iv["high"] <= bound:
        return f"**parity within ±{bound} pp** ({span})"
    if iv["high"] < -bound:
        return f"**worse by more than {bound} pp** ({span})"
    if iv["low"] > bound:
        return f"**better by more than {bound} pp** ({span})"
    return f"not resolved ({span})"


def drop_steps(run: dict, start: float, end: float) -> dict:
    """Per fraction f of DROP_FRACTIONS: first logged step whose smoothed loss is below start - f (start - end)."""
    out = {}
    for f in DROP_FRACTIONS:
        out[f] = drop_step(run["train"], start - f * (start - end))
    return out


def summarize(runs: list[dict]) -> dict:
    """Rows per run, pooled paired differences per (protocol, variant), and drop-step spreads."""
    bf16 = {}
    for r in runs:
        if r["spec"]["variant"] == "bf16" and r.get("status") == "ok":
            bf16[pair_key(r)] = r
    rows = []
    for r in runs:
        s = r["spec"]
        row = dict(
            name=s["name"],
            protocol=s["protocol"],
            variant=s["variant"],
            seed=s["seed"],
            status=r.get("status"),
        )
        row["final_loss"] = final_loss(r)
        row.update({k: (r.get("results") or {}).get(k) for k, _, _ in METRICS})
        row["wall_s"], row["train_s"] = r.get("wall_s"), r.get("train_s")
        # the count trained; a killed run's last logged step
        row["steps"] = (
            r.get("steps") if r.get("status") == "ok" else (r["train"] or [{"step": 0}])[-1]["step"]
        )
        base = bf16.get(pair_key(r))
        if base is not None and base is not r and r.get("status") == "ok":
            for key, _, scale in METRICS:
                row[f"d_{key}"] = scale * (r["results"][key] - base["results"][key])
            base_loss = {x["step"]: x["loss"] for x in base["train"]}
            window = tail_window(r["train"])
            diffs = [x["loss"] - base_loss[x["step"]] for x in window if x["step"] in base_loss]
            row["d_final_loss"] = mean_se(diffs)[0]
        rows.append(row)
    pools = []
    for protocol in dict.fromkeys(r["protocol"] for r in rows):
        for variant in dict.fromkeys(r["variant"] for r in rows if r["protocol"] == protocol):
            mine = [
                r
                for r in rows
                if r["protocol"] == protocol and r["variant"] == variant and "d_zero_shot_top1" in r
            ]
            if variant == "bf16" or not mine:
                continue
            pool = dict(protocol=protocol, variant=variant)
            for key in ("d_zero_shot_top1", "d_caption_r1", "d_final_loss"):
                pool[key] = interval([r[key] for r in mine if r.get(key) is not None])
            pool["verdict_zero_shot"] = verdict(pool["d_zero_shot_top1"])
            pool["verdict_caption_r1"] = verdict(pool["d_caption_r1"])
            pools.append(pool)
    spreads = []
    for protocol in dict.fromkeys(r["spec"]["protocol"] for r in runs):
        mine = [
            r for r in runs if r["spec"]["protocol"] == protocol and r.get("status") == "ok" and r["train"]
        ]
        ends = [final_loss(r) for r in mine if r["spec"]["variant"] == "bf16"]
        if not ends:
            continue
        start = math.log(mine[0]["spec"]["batch_size"])  # a contrastive loss starts near ln(batch)
        end = sum(ends) / len(ends)
        for variant in dict.fromkeys(r["spec"]["variant"] for r in mine):
            steps = [drop_steps(r, start, end) for r in mine if r["spec"]["variant"] == variant]
            for f in DROP_FRACTIONS:
                values = [s[f] for s in steps if s[f] is not None]
                never = len(steps) - len(values)
                if values:
                    mean, se = mean_se(values)
                    sd = None if se is None else se * math.sqrt(len(values))
                    spreads.append(
                        dict(protocol=protocol, variant=variant, fraction=f, level=start - f * (start - end),
                             n=len(values), never=never, min=min(values), max=max(values), mean=mean, sd=sd)
                    )  # fmt: skip
    return dict(rows=rows, pooled=pools, drop_spread=spreads)


def _f(value, spec=".2f") -> str:
    return "-" if value is None else format(value, spec)


def _iv(iv: dict, spec="+.2f") -> str:
    if iv["mean"] is None:
        return "-"
    if iv["low"] is None:
        return _f(iv["mean"], spec)
    return f"{iv['mean']:{spec}} ({iv['low']:{spec}} to {iv['high']:{spec}})"


def markdown(summary: dict, env: dict) -> str:
    lines = [
        f"Parity: {env.get('device', 'cpu')}, torch {env.get('torch')}, arch {env.get('arch')} "
        f"({ARCHS.get(env.get('arch'), {})}), batch {env.get('batch_size')}, eval on {env.get('eval_samples')} images.",
        "",
        "Paired differences to bf16 (same seed: same start weights and batches), mean and 95% Student t interval:",
        "",
        "| protocol | variant | pairs | Δ zero-shot pp | Δ image→caption R@1 pp | Δ final loss | verdict (zero-shot, ±0.5 pp) |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for p in summary["pooled"]:
        lines.append(
            f"| {p['protocol']} | {p['variant']} | {p['d_zero_shot_top1']['n']} | {_iv(p['d_zero_shot_top1'])} "
            f"| {_iv(p['d_caption_r1'])} | {_iv(p['d_final_loss'], '+.4f')} | {p['verdict_zero_shot']} |"
        )
    lines += [
        "",
        "| protocol | variant | seed | status | steps | final loss (last 20%) | zero-shot | Δ pp | R@1 | Δ pp | train s |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in summary["rows"]:
        lines.append(
            f"| {r['protocol']} | {r['variant']} | {r['seed']} | {r['status']} | {r['steps']} "
            f"| {_f(r['final_loss'], '.4f')} "
            f"| {_f(r['zero_shot_top1'] and 100 * r['zero_shot_top1'])} | {_f(r.get('d_zero_shot_top1'), '+.2f')} "
            f"| {_f(r['caption_r1'] and 100 * r['caption_r1'])} | {_f(r.get('d_caption_r1'), '+.2f')} "
            f"| {_f(r['train_s'], '.0f')} |"
        )
    if summary["drop_spread"]:
        lines += [
            "",
            "When the smoothed loss (EMA 0.8) first crossed a fraction of its way from ln(batch) to bf16's final "
            "loss (a bimodal escape shows as a large spread or 'never'):",
            "",
            "| protocol | variant | fraction (level) | runs | never | first step: min / mean / max | SD |",
            "|---|---|---|---:|---:|---:|---:|",
        ]
        for s in summary["drop_spread"]:
            lines.append(
                f"| {s['protocol']} | {s['variant']} | {s['fraction']} ({s['level']:.3f}) | {s['n']} | {s['never']} "
                f"| {s['min']} / {s['mean']:.0f} / {s['max']} | {_f(s['sd'], '.0f')} |"
            )
    n = env.get("eval_samples") or 0
    if n:
        lines += ["", f"One accuracy's binomial SE on {n} images: at most {50 / math.sqrt(n):.2f} pp."]
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], path: Path) -> bool:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False
    protocols = list(dict.fromkeys(r["spec"]["protocol"] for r in runs))
    fig = Figure(figsize=(6.5 * len(protocols), 4.5))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(protocols), squeeze=False)[0]
    colors = {"bf16": "tab:blue", "int8": "tab:orange", "fp8": "tab:green", "int8-int8grad": "tab:red"}
    for ax, protocol in zip(axes, protocols, strict=True):
        seen = set()
        for r in runs:
            if r["spec"]["protocol"] != protocol or not r["train"]:
                continue
            v = r["spec"]["variant"]
            xs = [x["step"] for x in r["train"]]
            ys = ema_of([x["loss"] for x in r["train"]])
            ax.plot(
                xs, ys, color=colors.get(v, "gray"), alpha=0.6, linewidth=0.9, label=None if v in seen else v
            )
            seen.add(v)
        ax.set(title=f"{protocol}: training loss (EMA 0.8), one line per seed", xlabel="step", ylabel="loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def write_outputs(runs: list[dict], env: dict, out_dir: Path) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(runs)
    (out_dir / "parity.json").write_text(json.dumps(dict(env=env, summary=summary, runs=runs)))
    text = markdown(summary, env)
    if not plot(runs, out_dir / "parity_loss.png"):
        text += "\n(no plot: matplotlib is not installed here; re-plot with --merge parity.json)\n"
    (out_dir / "parity.md").write_text(text)
    return summary


def tiny_clip_config(config: Path, directory: Path) -> Path:
    """A CLIP config JSON shrunk to CPU-test size (train_clip smoke runs)."""
    data = json.loads(config.read_text())
    tower = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2)
    data["text_config"].update(tower, vocab_size=64, projection_dim=32)
    data["vision_config"].update(tower, image_size=32, patch_size=8, projection_dim=32)
    data["projection_dim"] = 32
    path = directory / "tiny_clip.json"
    path.write_text(json.dumps(data))
    return path


def environment(args) -> dict:
    arch = Path(args.model_config).name if args.protocol == "train_clip" else args.arch
    env = dict(arch=arch, batch_size=args.batch_size, eval_samples=args.eval_samples, args=vars(args).copy())
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return dict(env, **common.versions(device, ("triton", "transformers")))


def steps_arg(value: str):
    if value == "auto":
        return value
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive step count or 'auto', got {value!r}")
    return int(value)


def make_specs(args, protocol: str, init_from: str | None) -> list[dict]:
    base = dict(protocol=protocol, task=PROTOCOL_TASK[protocol], steps=args.steps, batch_size=args.batch_size)
    base.update(
        max_steps=args.max_steps,
        lr=args.lr,
        warmup=args.warmup,
        arch=args.arch,
        eval_samples=args.eval_samples,
    )
    base.update(log_every=args.log_every, init_from=init_from, init_id=init_from and Path(init_from).name)
    base.update(
        stats_every=args.stats_every, stat_quantizers=args.stat_quantizers, eval_every=args.eval_every
    )
    specs = [
        dict(base, variant=v, seed=s, name=f"{protocol}_{v}_seed{s}")
        for s in args.seeds
        for v in args.variants
    ]
    if protocol == "train_clip":
        arch = Path(args.model_config).name
        extra = dict(model_config=str(args.model_config), arch=arch, num_workers=args.num_workers)
        # train_clip hands each DataLoader worker whole batches: the batches do not depend on the worker count
        extra["data_order"] = "worker-blocks"
        specs = [dict(s, **extra, runs_dir=str(args.runs_dir)) for s in specs]
    return specs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out_dir", required=True, help="parity.json / .md / _loss.png go here")
    parser.add_argument("--protocol", choices=("finetune", "scratch", "train_clip"), default="finetune")
    parser.add_argument(
        "--init_from", help="finetune: start from this HF CLIP checkpoint instead of pretraining"
    )
    parser.add_argument("--variants", nargs="+", type=check_variant, default=["bf16", "int8", "fp8"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--arch", choices=list(ARCHS), default="small", help="graded shapes: the model size")
    parser.add_argument("--model_config", default=str(VIT_B16), help="train_clip: the CLIP config JSON")
    parser.add_argument("--num_workers", type=int, default=10, help="train_clip: DataLoader workers")
    parser.add_argument(
        "--steps",
        type=int,
        default=300,
        help="optimizer steps per run (one count for all: pairs must train alike)",
    )
    parser.add_argument("--batch_size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument(
        "--pretrain_steps",
        type=steps_arg,
        default=1500,
        help="or 'auto': as many as fit in --pretrain_share of the budget, decided from the speed of the first "
        "2 x --warmup steps",
    )
    parser.add_argument("--max_steps", type=int, default=3000, help="upper bound for --pretrain_steps auto")
    parser.add_argument("--pretrain_lr", type=float, default=1e-3)
    parser.add_argument("--eval_samples", type=int, default=10_000)
    parser.add_argument("--eval_every", type=int, default=0, help="extra evals every N steps (0: final only)")
    parser.add_argument("--log_every", type=int, default=5)
    parser.add_argument(
        "--stats_every", type=int, default=50, help="sim-* variants: gradient statistics every N"
    )
    parser.add_argument(
        "--stat_quantizers", nargs="+", default=["row", "block32", "block128", "row-sr", "row-outlier8"]
    )
    parser.add_argument("--parallel", type=int, default=1, help="processes sharing the device at once")
    parser.add_argument(
        "--runs_per_process",
        type=int,
        default=1,
        help="consecutive runs (a seed's variants, in --variants order) one after another in one process: one "
        "CUDA context, one Triton compile and autotune, instead of one per run",
    )
    parser.add_argument("--time_budget_s", type=float, default=500)
    parser.add_argument("--warm", action="store_true", help="fill Triton's kernel cache first (a GPU run)")
    parser.add_argument(
        "--pretrain_share",
        type=float,
        default=0.4,
        help="at most this share of the time budget for pretraining",
    )
    parser.add_argument("--runs_dir", help="run files and the pretrained checkpoint (default: a temp dir)")
    parser.add_argument("--smoke", action="store_true", help="CPU test size: tiny model, few steps")
    parser.add_argument("--merge", nargs="+", help="re-summarize these parity.json files, no runs")
    parser.add_argument("--one_run", help=argparse.SUPPRESS)
    args = parser.parse_args()
    out_dir = Path(args.out_dir)
    if args.runs_per_process < 1 or args.parallel < 1:
        parser.error("--parallel and --runs_per_process must be >= 1")

    if args.protocol == "train_clip" and any(v.startswith("sim-") for v in args.variants):
        parser.error("sim-* variants simulate linears in the graded-shapes protocols only")
    if args.one_run:  # child process: its runs one after another, each record to the spec's progress_to
        for spec in json.loads(Path(args.one_run).read_text()):
            write_atomic(Path(spec["progress_to"]), train_one(spec))
        return
    if args.merge:
        loaded = [json.loads(Path(p).read_text()) for p in args.merge]
        runs = [r if "spec" in r else from_train_clip_harness(r, d["env"]) for d in loaded for r in d["runs"]]
        first = runs[0]["spec"]  # the former harness's env has no arch / eval set size
        env = {"arch": first.get("arch"), "eval_samples": first.get("eval_samples"), **loaded[0]["env"]}
        write_outputs(runs, env, out_dir)
        print((out_dir / "parity.md").read_text())
        return
    args.runs_dir = args.runs_dir or tempfile.mkdtemp(prefix="parity_")
    runs_dir = Path(args.runs_dir)
    runs_dir.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        args.arch, args.steps, args.batch_size, args.warmup, args.pretrain_steps = "tiny", 6, 16, 2, 6
        args.eval_samples, args.log_every, args.stats_every, args.num_workers = 64, 1, 2, 0
        if args.protocol == "train_clip":
            args.model_config = str(tiny_clip_config(Path(args.model_config), runs_dir))
    env = environment(args)
    start = time.perf_counter()
    init_from, runs = args.init_from, []
    # A few steps of each Triton variant beside the pretraining (or first): they fill Triton's on-disk kernel
    # cache, so the parallel runs after them do not all compile (and autotune) the same kernels at once.
    warm = [
        dict(
            spec, steps=3, eval_samples=1000, name=f"warm_{spec['variant']}", init_from=None, protocol="warm"
        )
        for spec in make_specs(args, args.protocol, None)[: len(args.variants)]
        if args.warm and spec["variant"] in ("int8", "fp8", "int8-int8grad")
    ]
    first = []
    if args.protocol == "finetune" and not init_from:
        init_from = str(runs_dir / "pretrained")
        pre = make_specs(args, "finetune", None)[0]
        pre.update(protocol="pretrain", task="pretrain", variant="bf16", seed=0, name="pretrain")
        auto = args.pretrain_steps == "auto"
        warmup = 2 * args.warmup if auto else max(args.warmup, args.pretrain_steps // 20)
        pre.update(save_to=init_from, steps=args.pretrain_steps, lr=args.pretrain_lr, warmup=warmup)
        first.append(pre)
    if first or warm:
        done = run_specs(first + warm, runs_dir, len(first + warm), args.pretrain_share * args.time_budget_s)
        runs += [r for r in done if r["spec"]["protocol"] != "warm"]
    if first:
        env["pretrain"] = {
            k: runs[0].get(k) for k in ("results", "zero_shot_before_finetune", "train_s", "status")
        }
        if runs[0].get("status") != "ok":
            write_outputs(runs, env, out_dir)
            sys.exit(f"pretraining failed: {runs[0].get('output_tail')}")
    specs = make_specs(args, args.protocol, init_from)
    left = args.time_budget_s - (time.perf_counter() - start)
    runs += run_specs(
        specs,
        runs_dir,
        args.parallel,
        left,
        on_wave=lambda done: write_outputs(runs + done, env, out_dir),
        per_process=args.runs_per_process,
    )
    write_outputs(runs, env, out_dir)
    print((out_dir / "parity.md").read_text())


if __name__ == "__main__":
    main()
