"""Eval throughput of a CLIP ViT-B/16: bf16 vs SwitchBack inference mode (int8 / fp8 cached weights).

    python benchmarks/bench_inference.py                                  # GPU: bf16, int8, fp8 at batch 256
    python benchmarks/bench_inference.py --modes bf16 int8 --batch-size 512 --compile
    python benchmarks/bench_inference.py --device cpu --tiny --batch-size 4 --iters 1 --warmup 0   # smoke test

The model is built from examples/configs/clip-vit-b-16.json (bench_train.py's "vit-b-16") with random weights
(no download), so throughput is representative and the cosine column only says that the 8-bit path computes
the same function as bf16 on these weights; accuracy on trained weights is what the zero-shot eval measures.
One markdown table is printed: images/s (get_image_features), texts/s (get_text_features, 77 tokens),
speed-up vs bf16, and the worst per-sample cosine similarity of the embeddings vs the bf16 model.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import CLIPModel

from hf_switchback import SwitchBackConfig, apply_switchback, prepare_for_inference

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_train

MODES = ("bf16", "int8", "fp8")


def build_model(mode: str, args, state_dict=None) -> CLIPModel:
    """CLIP ViT-B/16 on args.device in bf16; for int8/fp8, SwitchBack layers prepared for inference."""
    torch.manual_seed(0)
    model = CLIPModel(bench_train.clip_config("vit-b-16", tiny=args.tiny))
    if state_dict is not None:
        model.load_state_dict(state_dict)
    model = model.to(args.device, torch.bfloat16).eval()
    if mode != "bf16":
        config = SwitchBackConfig(precision=mode, weight_scaling=args.weight_scaling, backend=args.backend)
        prepare_for_inference(apply_switchback(model, config))
    if args.compile:
        model.get_image_features = torch.compile(model.get_image_features)
        model.get_text_features = torch.compile(model.get_text_features)
    return model


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()
def throughput(fn, n_items: int, args) -> tuple[float, torch.Tensor]:
    """Items per second of fn() over args.iters timed calls after args.warmup; also the last output."""
    for _ in range(args.warmup):
        out = fn()
    sync(args.device)
    start = time.perf_counter()
    for _ in range(args.iters):
        out = fn()
    sync(args.device)
    return n_items * args.iters / (time.perf_counter() - start), out.pooler_output.float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda or cpu")
    parser.add_argument("--batch-size", type=int, default=256, help="images and texts per forward")
    parser.add_argument("--iters", type=int, default=20, help="timed forwards per tower and mode")
    parser.add_argument("--warmup", type=int, default=5, help="untimed forwards first (autotune, compile)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="bf16 is the baseline")
    parser.add_argument(
        "--weight-scaling", choices=("tensor", "row"), default="tensor", help="SwitchBack weights"
    )
    parser.add_argument(
        "--backend", choices=("auto", "triton", "torch"), default="auto", help="SwitchBack kernels"
    )
    parser.add_argument("--compile", action="store_true", help="torch.compile the two feature functions")
    parser.add_argument("--tiny", action="store_true", help="CPU-test-size towers (smoke test)")
    args = parser.parse_args()

    config = bench_train.clip_config("vit-b-16", tiny=args.tiny)
    side, text = config.vision_config.image_size, config.text_config
    g = torch.Generator().manual_seed(1)
    pixels = torch.randn(args.batch_size, 3, side, side, generator=g).to(args.device, torch.bfloat16)
    # words only (above the special ids), eos last: the text tower pools there
    ids = torch.randint(
        text.eos_token_id + 1, text.vocab_size, (args.batch_size, text.max_position_embeddings), generator=g
    )
    ids[:, -1] = text.eos_token_id
    ids = ids.to(args.device)

    weights = CLIPModel(config).state_dict()
    rows, baseline = [], {}
    for mode in ["bf16", *[m for m in args.modes if m != "bf16"]]:
        model = build_model(mode, args, weights)
        img_s, img = throughput(
            lambda m=model: m.get_image_features(pixel_values=pixels), args.batch_size, args
        )
        txt_s, txt = throughput(lambda m=model: m.get_text_features(input_ids=ids), args.batch_size, args)
        if mode == "bf16":
            baseline = {"img_s": img_s, "txt_s": txt_s, "img": img, "txt": txt}
        cos_img = F.cosine_similarity(img, baseline["img"], dim=-1).min().item()
        cos_txt = F.cosine_similarity(txt, baseline["txt"], dim=-1).min().item()
        if mode in args.modes:
            rows.append(
                (mode, img_s, img_s / baseline["img_s"], txt_s, txt_s / baseline["txt_s"], cos_img, cos_txt)
            )
        del model
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()

    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    print(
        f"\nCLIP {'tiny' if args.tiny else 'ViT-B/16'} eval, batch {args.batch_size}, {device}, torch {torch.__version__}, "
        f"weight_scaling={args.weight_scaling}, compile={args.compile}, {datetime.date.today()}\n"
    )
    print("| mode | images/s | vs bf16 | texts/s | vs bf16 | min cos image | min cos text |")
    print("|---|---|---|---|---|---|---|")
    for mode, img_s, img_x, txt_s, txt_x, ci, ct in rows:
        print(f"| {mode} | {img_s:.1f} | {img_x:.2f}x | {txt_s:.1f} | {txt_x:.2f}x | {ci:.5f} | {ct:.5f} |")


if __name__ == "__main__":
    main()
