"""One graded-shapes run: a small CLIP, a SwitchBack variant, its own training loop, its record.

Batches come from `graded_shapes` on the device as a function of (seed, step); AdamW, linear warm-up then cosine,
bf16 autocast on a GPU; the run ends with zero-shot top-1 and image->caption R@1 on held-out images.
The torch-heavy imports stay inside the functions: --merge and --help need none of them.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from common import write_json

# model sizes (both towers alike): hidden, layers (vision, text), heads, MLP width, image side, patch
ARCHS = {
    "tiny": dict(hidden=32, layers=(1, 1), heads=2, mlp=64, image=16, patch=4),  # tests
    "cpu": dict(hidden=64, layers=(2, 2), heads=2, mlp=256, image=16, patch=4),
    # ~ViT-Ti/S-sized towers at 32 px: 4.7M + 3.2M encoder parameters
    "small": dict(hidden=256, layers=(6, 4), heads=4, mlp=1024, image=32, patch=4),
}
MAX_TEXT = 12
SPEED_SAFETY = 0.8  # steps="auto": plan for 80% of the speed measured over the warm-up steps
PROGRESS_EVERY = 25  # steps between partial records, so that a run killed by the time budget keeps its curve
# The SwitchBack variants: the SwitchBackConfig fields each one sets.
SWITCHBACK_FIELDS = {
    "int8": {},
    "fp8": dict(precision="fp8"),
    "int8-int8grad": dict(grad_precision="int8"),
    "int8-memeff": dict(memory_efficient=True),
    "fp8-wgrad8": dict(precision="fp8", wgrad_precision="fp8"),
}


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
    return CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=a["hidden"] // 2))


def apply_variant(model, variant: str) -> None:
    """Swap the model's linears for `variant` (bf16 keeps them)."""
    from hf_switchback import SwitchBackConfig, apply_switchback

    from .sim_switchback import apply_sim_switchback

    if variant in SWITCHBACK_FIELDS:
        # min_tokens=0: small batches would otherwise run the 16-bit matmul and compare bf16 with itself
        apply_switchback(model, SwitchBackConfig(**SWITCHBACK_FIELDS[variant], min_tokens=0))
    elif variant.startswith("sim-"):
        apply_sim_switchback(model, variant[len("sim-") :])
    elif variant != "bf16":
        raise ValueError(f"unknown variant {variant!r}")


def lr_at(step: int, steps: int, warmup: int, lr: float) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def _normalized(features):
    import torch

    features = getattr(features, "pooler_output", features)  # a model output on some transformers versions
    return torch.nn.functional.normalize(features.float(), dim=-1)


def evaluate(model, tokenizer, task, spec: dict, device, autocast) -> dict:
    """Zero-shot top-1 (colour x shape prompts) and image->caption R@1 on spec['eval_samples'] images."""
    import torch

    from . import graded_shapes as gs

    def encode(texts, chunk=2048):
        t = tokenizer(texts, padding="max_length", max_length=MAX_TEXT, return_tensors="pt").to(device)
        ids, mask = t["input_ids"], t["attention_mask"]
        parts = [
            model.get_text_features(input_ids=ids[i : i + chunk], attention_mask=mask[i : i + chunk])
            for i in range(0, len(ids), chunk)
        ]
        return torch.cat([_normalized(p) for p in parts])

    model.eval()
    with torch.no_grad(), autocast():
        prompts = encode([gs.PROMPT.format(c) for c in task.classnames()])
        captions = encode(task.full_captions())
        hits = dict(zero_shot_top1=0, caption_r1=0)
        for b in gs.eval_batches(task, spec["eval_samples"], ARCHS[spec["arch"]]["image"], device):
            img = _normalized(model.get_image_features(pixel_values=b.pixels * 2 - 1))
            hits["zero_shot_top1"] += (img @ prompts.T).argmax(1).eq(b.label).sum().item()
            hits["caption_r1"] += (img @ captions.T).argmax(1).eq(b.caption).sum().item()
    model.train()
    return {k: v / spec["eval_samples"] for k, v in hits.items()}


def decide_steps(spec: dict, done: int, elapsed_s: float, device) -> int:
    """The step count of a spec with steps="auto": what fits before spec["deadline"] (epoch seconds) at this
    run's speed so far, at most spec["max_steps"]."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize()
    rate = done / max(elapsed_s, 1e-6)
    left = spec["deadline"] - time.time()
    return max(done + 1, min(spec["max_steps"], int(done + SPEED_SAFETY * rate * left)))


def train_graded(spec: dict) -> dict:
    """Train one run as `spec` says; returns its record (losses, evals, timings)."""
    import torch

    from hf_switchback.training.tokenizer import build_word_tokenizer

    from . import graded_shapes as gs

    t0 = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    torch.manual_seed(spec["seed"])
    if spec.get("init_from"):
        from transformers import AutoTokenizer, CLIPModel

        model = CLIPModel.from_pretrained(spec["init_from"])
        tokenizer = AutoTokenizer.from_pretrained(spec["init_from"])
    else:
        tokenizer = build_word_tokenizer(gs.vocabulary(), model_max_length=MAX_TEXT)
        model = build_model(spec["arch"], len(tokenizer))
    model.to(device)
    apply_variant(model, spec["variant"])
    task = gs.TASKS[spec["task"]]
    table = tokenizer(gs.caption_table(task), padding="max_length", max_length=MAX_TEXT, return_tensors="pt")
    ids, mask = table["input_ids"].to(device), table["attention_mask"].to(device)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embedding" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embedding" not in n)]
    groups = [dict(params=decay, weight_decay=0.1), dict(params=rest, weight_decay=0.0)]
    opt = torch.optim.AdamW(groups, lr=spec["lr"], betas=(0.9, 0.98), eps=1e-6)
    image_size = ARCHS[spec["arch"]]["image"]
    record = dict(spec=spec, train=[], evals=[], device=str(device), steps=spec["steps"])
    model.train()
    t_train = time.perf_counter()
    steps = spec["max_steps"] if spec["steps"] == "auto" else spec["steps"]
    step = 0
    while step < steps:  # `steps` of an "auto" run is decided after its warm-up
        if spec["steps"] == "auto" and step == spec["warmup"]:
            # the learning rate so far did not depend on the step count: decide it now, from the speed so far
            steps = record["steps"] = decide_steps(spec, step, time.perf_counter() - t_train, device)
        if step and step % PROGRESS_EVERY == 0 and spec.get("progress_to"):
            write_json(Path(spec["progress_to"]), dict(record, status="partial"))
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, spec["warmup"], spec["lr"])
        batch = gs.sample(task, spec["batch_size"], image_size, gs.step_generator(device, spec["seed"], step))
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
        step += 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    record["train_s"] = time.perf_counter() - t_train
    record["status"] = record.get("status", "ok")
    if record["status"] == "ok":
        record["results"] = evaluate(model, tokenizer, task, spec, device, autocast)
        record["evals"].append(dict(step=steps, **record["results"]))
    if spec.get("save_to"):
        model.save_pretrained(spec["save_to"])  # pretraining runs are bf16: nothing to convert back
        tokenizer.save_pretrained(spec["save_to"])
        # what the pretrained model already knows of the shifted task (its new words untrained)
        record["zero_shot_before_finetune"] = evaluate(model, tokenizer, gs.FINETUNE, spec, device, autocast)
    record["wall_s"] = time.perf_counter() - t0
    return record
