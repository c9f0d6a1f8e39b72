"""End-to-end CLIP training step speed: bf16 vs SwitchBack vs torchao float8, one process, one table.

Each row is one HF CLIPModel built from a config (random init, no download) trained on random data:
forward with the contrastive loss, backward, fused AdamW step, bf16 autocast, SDPA attention. Ratios are
against bf16 eager and bf16 + torch.compile measured in the same run.

    PYTHONPATH=src python benchmarks/bench_train.py                       # ViT-B/16, L/14, H/14, all variants
    PYTHONPATH=src python benchmarks/bench_train.py --models vit-h-14 --variants bf16 bf16+compile \
        int8+compile --grad_ckpt both --steps 10

Needs CUDA. torchao rows are skipped (with the import error shown) when torchao is not installed.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

# (vision width, layers, heads, patch) / (text width, layers, heads) / projection dim, per OpenCLIP's configs
MODELS = {
    "vit-b-16": dict(vision=(768, 12, 12, 16), text=(512, 12, 8), proj=512, batch=256),
    "vit-l-14": dict(vision=(1024, 24, 16, 14), text=(768, 12, 12), proj=768, batch=128),
    "vit-h-14": dict(vision=(1280, 32, 16, 14), text=(1024, 24, 16), proj=1024, batch=64),
}
VARIANTS = (
    "bf16",
    "bf16+compile",
    "int8",
    "int8+compile",
    "int8-row-memeff+compile",
    "fp8",
    "fp8+compile",
    "torchao-float8-rowwise_with_gw_hp+compile",
)


def clip_config(name: str):
    from transformers import CLIPConfig

    spec = MODELS[name]
    vw, vl, vh, patch = spec["vision"]
    tw, tl, th = spec["text"]
    vision = dict(
        hidden_size=vw,
        intermediate_size=4 * vw,
        num_hidden_layers=vl,
        num_attention_heads=vh,
        image_size=224,
        patch_size=patch,
    )
    text = dict(
        hidden_size=tw,
        intermediate_size=4 * tw,
        num_hidden_layers=tl,
        num_attention_heads=th,
        max_position_embeddings=77,
    )
    return CLIPConfig(text_config=text, vision_config=vision, projection_dim=spec["proj"])


def build_model(name: str, variant: str, grad_ckpt: bool):
    """(model, compile?) for one table row."""
    from transformers import CLIPModel

    from hf_switchback import SwitchBackConfig, apply_switchback

    model = CLIPModel(clip_config(name)).cuda()
    model.config._attn_implementation = "sdpa"
    if grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    base = variant.removesuffix("+compile")
    if base == "int8":
        apply_switchback(model, SwitchBackConfig(backend="triton"))
    elif base == "int8-row-memeff":
        apply_switchback(
            model, SwitchBackConfig(weight_scaling="row", memory_efficient=True, backend="triton")
        )
    elif base == "fp8":
        apply_switchback(model, SwitchBackConfig(precision="fp8", backend="triton"))
    elif base.startswith("torchao-float8-"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        recipe = base.removeprefix("torchao-float8-")
        # same coverage as SwitchBack's defaults: encoder linears only, projections stay bf16
        convert_to_float8_training(
            model,
            config=Float8LinearConfig.from_recipe_name(recipe),
            module_filter_fn=lambda m, fqn: "encoder.layers" in fqn,
        )
    elif base != "bf16":
        raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}")
    return model, variant.endswith("+compile")


def time_training(name: str, variant: str, grad_ckpt: bool, steps: int, warmup: int) -> dict:
    batch = MODELS[name]["batch"]
    model, compiled = build_model(name, variant, grad_ckpt)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    forward = torch.compile(model) if compiled else model
    ids = torch.randint(0, model.config.text_config.vocab_size, (batch, 77), device="cuda")
    pixels = torch.randn(batch, 3, 224, 224, device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = forward(input_ids=ids, pixel_values=pixels, return_loss=True).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first_step_s = time.perf_counter() - t0
    for _ in range(warmup):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / steps
    row = dict(
        model=name,
        variant=variant,
        grad_ckpt=grad_ckpt,
        batch=batch,
        ms_per_step=ms,
        samples_per_s=batch * 1000 / ms,
        peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30,
        first_step_s=first_step_s,
    )
    return row  # model, optimizer and compiled graphs are freed by the caller's cleanup()


def cleanup() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch._dynamo.reset()


def print_table(rows: list[dict]) -> None:
    base = {(r["model"], r["grad_ckpt"], r["variant"]): r["ms_per_step"] for r in rows if "ms_per_step" in r}
    header = (
        f"{'model':9} {'ckpt':4} {'variant':42} {'ms/step':>8} {'samples/s':>9} {'vs bf16':>7} "
        f"{'vs bf16+c':>9} {'peak GiB':>8} {'1st step s':>10}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        if "error" in r:
            print(f"{r['model']:9} {r['grad_ckpt']!s:4} {r['variant']:42} error: {r['error']}")
            continue
        eager = base.get((r["model"], r["grad_ckpt"], "bf16"))
        comp = base.get((r["model"], r["grad_ckpt"], "bf16+compile"))
        vs_e = f"{eager / r['ms_per_step']:.2f}x" if eager else "-"
        vs_c = f"{comp / r['ms_per_step']:.2f}x" if comp else "-"
        print(
            f"{r['model']:9} {r['grad_ckpt']!s:4} {r['variant']:42} {r['ms_per_step']:8.1f} "
            f"{r['samples_per_s']:9.0f} {vs_e:>7} {vs_c:>9} {r['peak_mem_gib']:8.1f} {r['first_step_s']:10.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS), help="CLIP sizes")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), help="table rows")
    parser.add_argument(
        "--grad_ckpt",
        choices=("off", "on", "both"),
        default="off",
        help="gradient checkpointing of both towers",
    )
    parser.add_argument("--steps", type=int, default=10, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps after the first (compile) step")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_train.py needs a CUDA GPU")

    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    ckpts = {"off": [False], "on": [True], "both": [False, True]}[args.grad_ckpt]
    rows = []
    for name in args.models:
        for grad_ckpt in ckpts:
            for variant in args.variants:
                try:
                    rows.append(time_training(name, variant, grad_ckpt, args.steps, args.warmup))
                except Exception as err:  # one failing peer must not lose the rest of the table
                    rows.append(dict(model=name, variant=variant, grad_ckpt=grad_ckpt, error=repr(err)[:200]))
                cleanup()
                print(json.dumps(rows[-1]), flush=True)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
