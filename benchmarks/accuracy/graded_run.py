"""One graded-shapes run of the accuracy harness: a small CLIP, a SwitchBack variant, its own training loop.

`train_graded(spec)` trains from a seeded init (or `spec["init_from"]`, a saved HF checkpoint) on one task of
`graded_shapes`, batches generated on the device from (seed, step), AdamW with linear warm-up and cosine decay,
bf16 autocast on a GPU; it ends with zero-shot top-1 and image->caption R@1 on held-out images and returns the
run's record (losses, evals, timings, and for sim-* variants gradient statistics).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

# model sizes (both towers alike): hidden, layers (vision, text), heads, MLP width, image side, patch
ARCHS = {
    "tiny": dict(hidden=32, layers=(1, 1), heads=2, mlp=64, image=16, patch=4),
    # CPU experiments: 16 px images, 16 patches, two layers of width 64 per tower
    "cpu": dict(hidden=64, layers=(2, 2), heads=2, mlp=256, image=16, patch=4),
    "cpu-wide": dict(hidden=192, layers=(3, 2), heads=3, mlp=768, image=16, patch=4),
    # ~ViT-Ti/S-sized towers at 32 px: 6 + 4 layers of width 256 (4.7M + 3.2M encoder parameters)
    "small": dict(hidden=256, layers=(6, 4), heads=4, mlp=1024, image=32, patch=4),
}
MAX_TEXT = 12
SPEED_SAFETY = 0.8  # steps="auto": plan for 80% of the speed measured over the warm-up steps
# (the torch-heavy imports stay inside the functions: --merge and --help need none of them)


def build_model(arch: str, vocab_size: int):
    """A randomly initialised CLIPModel of ARCHS[arch] for a tokenizer of `vocab_size` words."""
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
    from hf_switchback import SwitchBackConfig, apply_switchback

    from .sim_switchback import apply_sim_switchback

    if variant == "bf16":
        return []
    if variant in SWITCHBACK_FIELDS:
        # min_tokens=0: small batches would otherwise run the 16-bit matmul and compare bf16 with itself
        apply_switchback(model, SwitchBackConfig(**SWITCHBACK_FIELDS[variant], min_tokens=0))
        return []
    if variant.startswith("sim-"):
        return apply_sim_switchback(model, variant[len("sim-") :])
    raise ValueError(f"unknown variant {variant!r}")


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

    from . import graded_shapes as gs

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


def train_graded(spec: dict) -> dict:
    """Train one run as `spec` says; returns its record (losses, evals, timings, gradient statistics)."""
    import torch

    from hf_switchback.training.tokenizer import build_word_tokenizer

    from . import graded_shapes as gs

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
