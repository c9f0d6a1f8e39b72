"""The command line of examples/train_clip.py: `build_parser()` (flags grouped by topic, help on every flag) and
`check_args(parser, args)` (bad combinations rejected before anything is loaded)."""

from __future__ import annotations

import argparse
import importlib.util
import math
import os

from ..config import BACKENDS, GRAD_PRECISIONS, PRECISIONS, WEIGHT_SCALINGS
from . import synthetic
from .model_setup import SWITCHBACK_FLAGS
from .optimizers import OPTIMIZER_CHOICES
from .runtime import COMPILE_MODES
from .sources import has_real_data


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Contrastive CLIP training with SwitchBack 8-bit linears (run with `accelerate launch`).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = parser.add_argument_group("model")
    g.add_argument(
        "--model_name_or_path", help="Local dir or Hub id of a CLIPModel; its processor is used too."
    )
    g.add_argument("--model_config", help="CLIPConfig json to train from scratch (random init).")
    g.add_argument(
        "--tokenizer_name_or_path",
        help="Tokenizer when not using --model_name_or_path (default: synthetic words).",
    )
    g.add_argument(
        "--max_text_length", type=int, default=77, help="Token limit (capped by the model's positions)."
    )

    g = parser.add_argument_group("SwitchBack (unset fields keep SwitchBackConfig's defaults)")
    g.add_argument(
        "--switchback", choices=("on", "off"), default="on", help="Swap the encoder linears for SwitchBack."
    )
    g.add_argument(
        "--weight_scaling", choices=WEIGHT_SCALINGS, help="One weight scale per tensor or per row."
    )
    g.add_argument(
        "--memory_efficient",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Save the 8-bit input for backward instead of the 16-bit one.",
    )
    g.add_argument(
        "--precision",
        choices=PRECISIONS,
        help="Forward format: int8 (default), or fp8 (Ada/Hopper GPUs; the smallest spread from scratch in the "
        "parity runs, 3 pairs, BENCHMARKS.md 'Accuracy').",
    )
    g.add_argument(
        "--grad_precision",
        choices=GRAD_PRECISIONS,
        help="Format of the grad-input GEMM. auto (default): fp8 on GPUs with fp8 tensor cores (sm89+), int8 "
        "elsewhere; fp8 gradients kept bf16 accuracy where int8 ones did not (BENCHMARKS.md, Accuracy).",
    )
    g.add_argument(
        "--fuse_mlp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Run each CLIP MLP as one fused SwitchBack op: ~20%% less activation memory, slower under compile.",
    )
    g.add_argument("--target_modules", nargs="+", help="Module names / dotted suffixes to swap.")
    g.add_argument("--exclude_modules", nargs="+", help="Module names / dotted suffixes never to swap.")
    g.add_argument(
        "--backend", choices=BACKENDS, help="Kernel backend: triton on GPU, torch reference elsewhere."
    )
    g.add_argument(
        "--min_tokens", type=int, help="Run the 16-bit matmul when a batch has fewer tokens than this."
    )

    g = parser.add_argument_group("data (default: the embedded synthetic shapes set)")
    g.add_argument("--train_file", help="CSV/TSV/JSON(L) with image path and caption columns.")
    g.add_argument(
        "--train_data_dir", help="imagefolder directory with a metadata.csv/jsonl holding captions."
    )
    g.add_argument(
        "--train_shards", help="Webdataset tar shards: glob, comma list or folder; always streamed."
    )
    g.add_argument("--dataset_name", help="A data set on the Hub (or a local datasets script/dir) by name.")
    g.add_argument("--dataset_config_name", help="Configuration of --dataset_name.")
    g.add_argument(
        "--train_split", default="train", help="Split of --dataset_name / --train_data_dir to train on."
    )
    g.add_argument(
        "--streaming", action="store_true", help="Stream --dataset_name / files instead of loading."
    )
    g.add_argument("--image_column", help="Image column (default: first of image, jpg, png, ...).")
    g.add_argument("--caption_column", help="Caption column (default: first of caption, txt, text, ...).")
    g.add_argument("--validation_file", help="CSV/JSON for eval (retrieval).")
    g.add_argument("--validation_shards", help="Webdataset shards for eval (retrieval).")
    g.add_argument("--validation_split", help="Split of --dataset_name for eval (retrieval).")
    g.add_argument(
        "--zeroshot_label_column", help="Integer class column of the eval data, for zero-shot accuracy."
    )
    g.add_argument(
        "--zeroshot_classnames", help="Comma-separated class names (default: the ClassLabel names)."
    )
    g.add_argument("--zeroshot_templates", default="a photo of a {}.", help="'|'-separated prompt templates.")
    g.add_argument(
        "--max_eval_samples", type=int, default=256, help="Eval set size (synthetic: at most 576)."
    )
    g.add_argument(
        "--synthetic_train_samples", type=int, default=100_000, help="Size of the synthetic train set."
    )
    g.add_argument("--num_workers", type=int, default=1, help="DataLoader worker processes per rank.")
    g.add_argument("--shuffle_buffer", type=int, default=1000, help="Streaming shuffle buffer (samples).")
    g.add_argument(
        "--crop_scale_min", type=float, default=0.9, help="Random resized crop: smallest area kept."
    )

    g = parser.add_argument_group("optimization")
    g.add_argument("--batch_size", type=int, default=128, help="Micro-batch per device.")
    g.add_argument(
        "--accum_freq", type=int, default=1, help="Micro-batches per step, OpenCLIP-style (full negatives)."
    )
    g.add_argument("--max_train_steps", type=int, help="Optimizer steps (required for streamed data).")
    g.add_argument(
        "--num_train_epochs", type=int, default=1, help="Epochs when --max_train_steps is not given."
    )
    g.add_argument("--optimizer", choices=OPTIMIZER_CHOICES, default="adamw", help="Optimizer.")
    g.add_argument("--lr", type=float, default=2e-3, help="Peak learning rate.")
    g.add_argument("--warmup_steps", type=int, help="Linear warmup steps (default: 5%% of training).")
    g.add_argument("--min_lr_ratio", type=float, default=0.0, help="Cosine floor as a fraction of --lr.")
    g.add_argument(
        "--weight_decay", type=float, default=0.1, help="Decoupled weight decay on weight matrices."
    )
    g.add_argument("--beta1", type=float, default=0.9, help="Adam beta1.")
    g.add_argument("--beta2", type=float, default=0.98, help="Adam beta2.")
    g.add_argument("--eps", type=float, default=1e-6, help="Adam epsilon.")
    g.add_argument(
        "--layer_scale_init",
        type=float,
        help="Add a learnable per-channel layer-scale, initialized to this value, to the attention and MLP "
        "branches of every encoder layer (0 = the paper's zero-init; default: off). Folded into out_proj/fc2 "
        "at save time, so the saved model is a plain CLIPModel.",
    )
    g.add_argument("--grad_clip_norm", type=float, default=1.0, help="Clip the global grad norm (0: off).")
    g.add_argument(
        "--local_loss",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Local rows x global columns loss.",
    )
    g.add_argument(
        "--gather_with_grad",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Differentiable all-gather of features.",
    )
    g.add_argument("--seed", type=int, default=0, help="Seed for init, data order and augmentation.")

    g = parser.add_argument_group("speed and memory")
    g.add_argument(
        "--mixed_precision",
        choices=("no", "bf16", "fp16"),
        help="Autocast dtype (default: accelerate config).",
    )
    g.add_argument("--grad_checkpointing", action="store_true", help="Recompute encoder layers in backward.")
    g.add_argument(
        "--patch_dropout", type=float, default=0.0, help="Fraction of image patches dropped in training."
    )
    g.add_argument("--torch_compile", action="store_true", help="torch.compile the model (inductor).")
    g.add_argument(
        "--compile_mode",
        choices=COMPILE_MODES,
        help="torch.compile mode with --torch_compile (default: 'default'). 'reduce-overhead' replays the "
        "step's kernels as CUDA graphs: for steps the CPU cannot launch fast enough (small batches, ViT-H, "
        "SwitchBack's extra quantize launches); on Hopper it also selects the TMA 8-bit GEMM, whose launch "
        "setup the graphs hide (BENCHMARKS.md, Whole training step). Needs --accum_freq 1.",
    )
    g.add_argument("--lock_image", action="store_true", help="Freeze the vision tower and its projection.")
    g.add_argument("--lock_text", action="store_true", help="Freeze the text tower and its projection.")

    g = parser.add_argument_group("logging, eval, checkpoints")
    g.add_argument(
        "--output_dir", default="runs/clip_switchback", help="Checkpoints, final model, all_results.json."
    )
    g.add_argument("--report_to", choices=("tensorboard", "wandb", "none"), default="none", help="Tracker.")
    g.add_argument("--project_name", default="clip_switchback", help="Tracker project / run name.")
    g.add_argument("--logging_steps", type=int, default=10, help="Log training scalars every N steps.")
    g.add_argument("--log_losses", action="store_true", help="Also print every logged loss (full precision).")
    g.add_argument(
        "--spike_monitor",
        action="store_true",
        help="Log the per-layer RMS(g^2/v) of the optimizer state (rms/max, rms/<layer>), warn when it jumps, "
        "and plot loss and max RMS to <output_dir>/spike_monitor.png (not with DeepSpeed).",
    )
    g.add_argument(
        "--spike_threshold", type=float, default=4.0, help="--spike_monitor warns when max RMS exceeds this."
    )
    g.add_argument(
        "--eval_steps", type=int, default=100, help="Zero-shot + retrieval eval every N steps (0: end only)."
    )
    g.add_argument("--checkpointing_steps", type=int, default=0, help="save_state every N steps (0: never).")
    g.add_argument(
        "--checkpoints_total_limit", type=int, default=2, help="Keep only the newest N checkpoints."
    )
    g.add_argument(
        "--resume_from_checkpoint", help="'latest' (in output_dir/checkpoints) or a checkpoint path."
    )
    g.add_argument("--push_to_hub", action="store_true", help="Upload the final model with a model card.")
    g.add_argument("--hub_model_id", help="Repository id for --push_to_hub, e.g. user/clip-switchback.")
    g.add_argument("--hub_private", action="store_true", help="Create the Hub repository as private.")
    g.add_argument("--hub_token", help="Hub token (default: the logged-in one).")
    return parser


def check_args(parser: argparse.ArgumentParser, args) -> None:
    """Reject bad combinations before anything is loaded."""
    sources = [
        f"--{k}" for k in ("train_file", "train_data_dir", "train_shards", "dataset_name") if getattr(args, k)
    ]
    if len(sources) > 1:
        parser.error(f"choose one training data source, got {' and '.join(sources)}")
    if args.model_name_or_path and args.model_config:
        parser.error(
            "--model_name_or_path and --model_config are exclusive (pretrained weights vs random init)"
        )
    if args.model_name_or_path and args.tokenizer_name_or_path:
        parser.error(
            "--tokenizer_name_or_path is for random init: --model_name_or_path brings its own tokenizer"
        )
    if args.lock_image and args.lock_text:
        parser.error("--lock_image and --lock_text together leave nothing to train")
    if (args.train_shards or args.streaming) and args.max_train_steps is None:
        parser.error("streamed data has no length: pass --max_train_steps")
    if args.precision == "fp8" and args.grad_precision == "int8":
        parser.error(
            "--precision fp8 with --grad_precision int8 is not supported: use --grad_precision auto or fp8"
        )
    if args.switchback == "off":
        given = [f"--{k}" for k in SWITCHBACK_FLAGS if getattr(args, k) is not None]
        if given:
            parser.error(f"{', '.join(given)} configure SwitchBack, which --switchback off disables")
    for name in ("batch_size", "accum_freq", "logging_steps", "num_train_epochs", "max_eval_samples"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.compile_mode is not None and not args.torch_compile:
        parser.error("--compile_mode needs --torch_compile")
    if args.compile_mode == "reduce-overhead" and args.accum_freq > 1:
        # the cached-feature passes keep outputs of one replay while the next replay overwrites them
        parser.error("--compile_mode reduce-overhead (CUDA graphs) needs --accum_freq 1")
    if args.max_train_steps is not None and args.max_train_steps < 1:
        parser.error(f"--max_train_steps must be >= 1, got {args.max_train_steps}")
    if not 0.0 <= args.patch_dropout < 1.0:
        parser.error(f"--patch_dropout must be in [0, 1), got {args.patch_dropout}")
    if args.layer_scale_init is not None and not math.isfinite(args.layer_scale_init):
        parser.error(f"--layer_scale_init must be a finite number, got {args.layer_scale_init}")
    if args.spike_threshold <= 0:
        parser.error(f"--spike_threshold must be > 0, got {args.spike_threshold}")
    if not 0.0 < args.crop_scale_min <= 1.0:
        parser.error(f"--crop_scale_min must be in (0, 1], got {args.crop_scale_min}")
    tracker_module = {"tensorboard": "tensorboard", "wandb": "wandb"}.get(args.report_to)
    if tracker_module and importlib.util.find_spec(tracker_module) is None:
        parser.error(f"--report_to {args.report_to} needs `pip install {tracker_module}`")
    if "{}" not in args.zeroshot_templates:
        parser.error("--zeroshot_templates: every template needs a {} for the class name")
    if args.push_to_hub and not args.hub_model_id:
        parser.error("--push_to_hub needs --hub_model_id")
    if not has_real_data(args) and args.max_eval_samples > len(synthetic.all_specs()):
        parser.error(
            f"--max_eval_samples: the synthetic eval set has {len(synthetic.all_specs())} distinct samples"
        )
    ckpt = args.resume_from_checkpoint
    if ckpt and ckpt != "latest" and not os.path.isdir(ckpt):
        parser.error(f"--resume_from_checkpoint {ckpt!r} is not a directory")
