"""OpenCLIP training step speed: bf16 vs the bitsandbytes drop-in (MLP linears) vs SwitchBack on all linears.

One open_clip model (random init) on random images and token ids: forward, the CLIP loss, backward, fused AdamW,
bf16 autocast over fp32 weights (OpenCLIP's `--precision amp_bf16`). Variants: bf16 (stock); mlp (OpenCLIP's
`--use-bnb-linear SwitchBackLinearGlobal` through hf_switchback.bnb_compat: c_fc / c_proj); all
(apply_switchback on c_fc, c_proj and each nn.MultiheadAttention). Both 8-bit variants quantize at every size
(min_tokens=0, as bitsandbytes did). Needs open_clip_torch (with ftfy, regex, timm, torchvision).

    PYTHONPATH=.whl/site:src python benchmarks/bench_openclip.py --model ViT-B-32 --batch 256
    PYTHONPATH=.whl/site:src python benchmarks/bench_openclip.py --device cpu --model tiny --steps 1  # smoke
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch
import torch.nn.functional as F

from hf_switchback import SwitchBackConfig, apply_switchback, bnb_compat

VARIANTS = ("bf16", "mlp", "all")
# A ViT small enough for a CPU smoke run (open_clip takes a config dict through its registry).
TINY = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 64, "patch_size": 16},
    "text_cfg": {"context_length": 16, "vocab_size": 1000, "width": 64, "heads": 2, "layers": 1},
}


def build(variant: str, base: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    model = copy.deepcopy(base)
    if variant == "mlp":
        from open_clip.utils import replace_linear

        replace_linear(model, bnb_compat.SwitchBackLinearGlobal)
    elif variant == "all":
        apply_switchback(model, SwitchBackConfig(target_modules=["c_fc", "c_proj", "attn"], min_tokens=0))
    return model.to(device)


def step_ms(model, images, texts, steps: int, warmup: int) -> float:
    """Median milliseconds of one training step over `steps` timed steps after `warmup` untimed ones."""
    device = images.device
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    labels = torch.arange(len(images), device=device)
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        with torch.autocast(device.type, torch.bfloat16):
            image_features, text_features, logit_scale = model(images, texts)[:3]
            logits = logit_scale * image_features @ text_features.t()
            loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--model", default="ViT-B-32", help="open_clip model name, or 'tiny' (CPU smoke run)")
    parser.add_argument("--batch", type=int, default=256, help="images (and captions) per step")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant (median reported)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (autotuning, compile)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), help="rows")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: smoke runs only")
    args = parser.parse_args()

    import open_clip  # imported here so that --help works without it

    device = torch.device(args.device)
    torch.manual_seed(0)
    if args.model == "tiny":
        import open_clip.factory

        open_clip.factory._MODEL_CONFIGS.setdefault("tiny", TINY)
    base = open_clip.create_model(args.model)
    size = base.visual.image_size
    size = size if isinstance(size, int) else size[0]
    images = torch.randn(args.batch, 3, size, size, device=device)
    texts = torch.randint(1, base.vocab_size, (args.batch, base.context_length), device=device)

    results = {}
    for variant in args.variants:
        model = build(variant, base, device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        ms = step_ms(model, images, texts, args.steps, args.warmup)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
        results[variant] = ms
        row = {"model": args.model, "batch": args.batch, "variant": variant}
        print(json.dumps({**row, "step_ms": round(ms, 2), "peak_gib": round(peak, 2)}), flush=True)
        del model
    if "bf16" in results:
        cells = " | ".join(f"{v} {results[v]:.1f} ms ({results['bf16'] / results[v]:.2f}x)" for v in results)
        print(f"| {args.model} b{args.batch} | {cells} |")


if __name__ == "__main__":
    main()
