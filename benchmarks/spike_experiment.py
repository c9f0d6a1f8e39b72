"""Loss spikes with AdamW vs StableAdamW on a tiny CLIP, plus the memory of 8-bit optimizer states.

Part 1 trains the same tiny CLIPModel (same init, same batches) on the embedded synthetic shapes data set with
each optimizer at a deliberately high learning rate and β2 = 0.99 (the setting in which the SwitchBack paper sees
AdamW's second moment fall behind the gradient), with the spike monitor on. It writes one PNG per optimizer
(loss + max RMS(g²/v̂)) and an overlay of the two losses, and prints a summary.

Part 2 measures the optimizer state bytes of fp32 AdamW and the 8-bit variants after one step on a
ViT-B/32-sized CLIPModel (transformers' CLIPConfig defaults), on CPU.

    python benchmarks/spike_experiment.py --output_dir docs/figures      # ~3-4 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

import numpy as np
import torch
from transformers import CLIPConfig, CLIPModel

from hf_switchback.training.optim import create_optimizer, unstable_parameters
from hf_switchback.training.spike_monitor import SpikeMonitor
from hf_switchback.training.synthetic import SyntheticShapes, vocabulary
from hf_switchback.training.tokenizer import build_word_tokenizer

logger = logging.getLogger("spike_experiment")


def tiny_clip(tokenizer, image_size: int) -> CLIPModel:
    # eos_token_id must be the tokenizer's: CLIP pools the text tower at the first eos position
    text = dict(
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=len(tokenizer),
        max_position_embeddings=tokenizer.model_max_length,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision = dict(
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=image_size,
        patch_size=8,
    )
    return CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=32))


def build_dataset(num_samples: int, image_size: int):
    """Render the synthetic set once into tensors: pixel_values (N,3,H,W) in [-1, 1], token ids, masks."""
    data = SyntheticShapes(num_samples, image_size=image_size, seed=0)
    tokenizer = build_word_tokenizer(vocabulary())
    samples = [data[i] for i in range(num_samples)]
    pixels = np.stack([np.asarray(s["image"].convert("RGB"), dtype=np.float32) for s in samples])
    pixels = torch.from_numpy(pixels).permute(0, 3, 1, 2) / 127.5 - 1.0
    text = tokenizer(
        [s["caption"] for s in samples], padding="max_length", truncation=True, return_tensors="pt"
    )
    return pixels, text["input_ids"], text["attention_mask"], tokenizer


def run(name, pixels, ids, mask, tokenizer, args) -> SpikeMonitor:
    torch.manual_seed(0)
    model = tiny_clip(tokenizer, pixels.shape[-1])
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.2}, {"params": no_decay, "weight_decay": 0.0}]
    opt = create_optimizer(name, groups, lr=args.lr, betas=(0.9, args.beta2), eps=1e-6)
    warmup = args.warmup
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    monitor = SpikeMonitor(model, opt, threshold=args.threshold)
    gen = torch.Generator().manual_seed(1)  # same batches for every optimizer
    start = time.perf_counter()
    for step in range(args.steps):
        idx = torch.randint(0, len(ids), (args.batch_size,), generator=gen)
        out = model(input_ids=ids[idx], attention_mask=mask[idx], pixel_values=pixels[idx], return_loss=True)
        out.loss.backward()
        opt.step()
        monitor.update(step, out.loss.item())
        opt.zero_grad(set_to_none=True)
        sched.step()
    logger.info("%s: %d steps in %.0fs", name, args.steps, time.perf_counter() - start)
    monitor.save_plot(os.path.join(args.output_dir, f"spike_{name}.png"))
    return monitor


def spikes(losses: list[float], window: int = 10, jump: float = 0.3) -> list[int]:
    """Steps whose loss exceeds the median of the previous `window` steps by more than `jump` (absolute, in
    nats; the loss starts at ln(batch) ≈ 4.16) — a crude spike count."""
    out = []
    for i in range(window, len(losses)):
        if losses[i] > float(np.median(losses[i - window : i])) + jump:
            out.append(i)
    return out


def overlay_plot(monitors: dict[str, SpikeMonitor], path: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_rms = fig.subplots(2, 1, sharex=True)
    for name, m in monitors.items():
        ax_loss.plot(m.loss_steps, m.losses, lw=1, label=name)
        ax_rms.plot(m.rms_steps, m.max_rms, lw=1, label=name)
    ax_loss.set_ylabel("contrastive loss")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    ax_rms.set_yscale("log")
    ax_rms.axhline(1.0, ls=":", color="black", lw=1)
    ax_rms.set_ylabel("max RMS(g² / v̂)")
    ax_rms.set_xlabel("step")
    ax_rms.grid(alpha=0.3)
    fig.savefig(path, dpi=110)


def state_memory() -> dict[str, int]:
    """Optimizer state bytes after one step on a ViT-B/32-sized CLIPModel (random grads, no forward)."""
    torch.manual_seed(0)
    model = CLIPModel(CLIPConfig())
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    result = {"params": sum(p.numel() for p in model.parameters())}
    for name in ("adamw", "adamw8bit"):
        groups = [{"params": decay, "weight_decay": 0.2}, {"params": no_decay, "weight_decay": 0.0}]
        opt = create_optimizer(
            name, groups, lr=1e-5, betas=(0.9, 0.98), eps=1e-6, keep_32bit=unstable_parameters(model)
        )
        opt.step()
        seen, total = set(), 0
        for state in opt.state.values():
            for v in state.values():
                if torch.is_tensor(v) and v.data_ptr() not in seen:
                    seen.add(v.data_ptr())
                    total += v.numel() * v.element_size()
        result[name] = total
        del opt
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output_dir", default="docs/figures", help="where the PNGs and results.json go")
    parser.add_argument("--steps", type=int, default=300, help="training steps per optimizer")
    parser.add_argument("--batch_size", type=int, default=64, help="contrastive batch size")
    parser.add_argument("--lr", type=float, default=1e-2, help="peak learning rate (deliberately high)")
    parser.add_argument("--beta2", type=float, default=0.99, help="Adam β2 (0.99: spikes appear)")
    parser.add_argument("--warmup", type=int, default=20, help="linear warmup steps")
    parser.add_argument("--threshold", type=float, default=4.0, help="spike monitor warning threshold")
    parser.add_argument("--num_samples", type=int, default=2048, help="synthetic images rendered once")
    parser.add_argument(
        "--skip_memory", action="store_true", help="skip the ViT-B/32 state-memory measurement"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    os.makedirs(args.output_dir, exist_ok=True)
    torch.set_num_threads(os.cpu_count() or 1)

    pixels, ids, mask, tokenizer = build_dataset(args.num_samples, image_size=32)
    monitors = {name: run(name, pixels, ids, mask, tokenizer, args) for name in ("adamw", "stableadamw")}
    overlay_plot(monitors, os.path.join(args.output_dir, "spike_adamw_vs_stableadamw.png"))

    results = {"config": vars(args), "torch": torch.__version__, "runs": {}}
    for name, m in monitors.items():
        results["runs"][name] = {
            "final_loss_mean_last50": round(float(np.mean(m.losses[-50:])), 3),
            "loss_spikes_median10_plus_0.3": spikes(m.losses),
            "monitor_warnings": [(s, t, round(r, 2)) for s, t, r in m.warnings],
            "max_rms": round(max(m.max_rms), 2),
        }
    if not args.skip_memory:
        results["state_memory_bytes_vit_b32"] = state_memory()
    with open(os.path.join(args.output_dir, "spike_results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps({k: v for k, v in results.items() if k != "config"}, indent=1))


if __name__ == "__main__":
    main()
