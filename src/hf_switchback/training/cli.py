"""The command line of examples/train_clip.py: `build_parser()` (flags grouped by topic, help on every flag) and
`check_args(parser, args)` (bad combinations rejected before anything is loaded).

`--help` shows every flag's default once: its argparse default, or, for a flag whose argparse default is None
("not given"), what happens then (UNSET_DEFAULTS). The flag names of transformers' run_clip.py / Trainer that
mean the same here are accepted as aliases (HF_ALIASES).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import warnings

from ..config import BACKENDS, GRAD_PRECISIONS, PRECISIONS, WEIGHT_SCALINGS, SwitchBackConfig
from . import synthetic
from .checkpoints import check_checkpoint, check_output_dir
from .data import CAPTION_COLUMNS, DEFAULT_MAX_IMAGE_PIXELS, IMAGE_COLUMNS
from .guard import DEFAULT_MAX_CONSECUTIVE
from .model_setup import SWITCHBACK_FLAGS, model_type
from .optim import OPTIMIZER_CHOICES
from .runtime import COMPILE_MODES
from .siglip_loss import DIST_IMPLS
from .sources import has_real_data

_LIBRARY = SwitchBackConfig()
# What a flag whose argparse default is None means when it is not given (shown in --help as its default).
UNSET_DEFAULTS = {
    "model_name_or_path": "none, random init",
    "model_config": "the embedded small CLIP",
    "tokenizer_name_or_path": "a word tokenizer of the synthetic captions",
    "weight_scaling": _LIBRARY.weight_scaling,
    "memory_efficient": _LIBRARY.memory_efficient,
    "precision": _LIBRARY.precision,
    "grad_precision": _LIBRARY.grad_precision,
    "fuse_mlp": "on with --memory_efficient, else off",
    "target_modules": " ".join(_LIBRARY.target_modules),
    "exclude_modules": " ".join(_LIBRARY.exclude_modules),
    "backend": _LIBRARY.backend,
    "min_tokens": "per layer shape, measured on this GPU (16384 without a table); 0 off CUDA",
    "train_file": "none",
    "train_data_dir": "none",
    "train_shards": "none",
    "dataset_name": "none",
    "dataset_config_name": "the data set's default",
    "image_column": f"the first of {', '.join(IMAGE_COLUMNS)}",
    "caption_column": f"the first of {', '.join(CAPTION_COLUMNS)}",
    "validation_file": "none",
    "validation_shards": "none",
    "validation_split": "the first training samples; synthetic: held-out shapes",
    "zeroshot_label_column": "none, retrieval only; synthetic: the shape classes",
    "zeroshot_classnames": "the ClassLabel names",
    "max_train_steps": "--num_train_epochs over the data",
    "warmup_steps": "5%% of the steps",
    "layer_scale_init": "off",
    "mixed_precision": "the accelerate config's",
    "compile_mode": "default",
    "resume_from_checkpoint": "none, start from scratch",
    "hub_model_id": "none",
    "hub_token": "HF_TOKEN, else the cached login",
}


class HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to every flag's help, once: the argparse default, or UNSET_DEFAULTS for None."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or action.default is argparse.SUPPRESS:
            return text  # BooleanOptionalAction (Python < 3.13) has added it already; --help has none
        if action.default is None and action.nargs == 0 and action.const is not None:
            shown = "off"  # a store_const alias such as --bf16 (its dest's default belongs to the main flag)
        elif action.default is None:
            shown = UNSET_DEFAULTS.get(action.dest, "none")
        else:
            shown = "%(default)s"
        return f"{text} (default: {shown})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Contrastive CLIP training with SwitchBack 8-bit linears (run with `accelerate launch`). "
        "The second name of a flag is its name in transformers' run_clip.py / Trainer.",
        formatter_class=HelpFormatter,
    )
    # Aliases: run_clip.py's names where the meaning is the same. Not aliased: --gradient_accumulation_steps
    # (Trainer's micro-batches see only their own negatives; --accum_freq keeps all of them), --freeze_vision_model
    # / --freeze_text_model (they leave the projection trainable; --lock_image / --lock_text freeze it too).
    g = parser.add_argument_group("model")
    g.add_argument(
        "--model_name_or_path", help="Local dir or Hub id of a CLIPModel; its processor is used too."
    )
    g.add_argument("--model_config", help="CLIPConfig json to train from scratch (random init).")
    g.add_argument(
        "--tokenizer_name_or_path",
        "--tokenizer_name",
        help="Tokenizer when not using --model_name_or_path.",
    )
    g.add_argument(
        "--max_text_length",
        "--max_seq_length",
        type=int,
        default=77,
        help="Token limit (capped by the model's positions).",
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
        help="The memory switch: save each linear's input in 8 bits for backward and fuse each MLP (its "
        "fc1 output recomputed): about half of bf16's saved activations, so larger batches without "
        "checkpointing; grad-weight from the 8-bit input (BENCHMARKS.md, Memory).",
    )
    g.add_argument(
        "--precision",
        choices=PRECISIONS,
        help="Forward format: int8, or fp8 (Ada/Hopper GPUs; the smallest spread from scratch in the "
        "parity runs, 3 pairs, BENCHMARKS.md 'Accuracy').",
    )
    g.add_argument(
        "--grad_precision",
        choices=GRAD_PRECISIONS,
        help="Format of the grad-input GEMM. auto: fp8 on GPUs with fp8 tensor cores (sm89+), int8 "
        "elsewhere; fp8 gradients kept bf16 accuracy where int8 ones did not (BENCHMARKS.md, Accuracy).",
    )
    g.add_argument(
        "--fuse_mlp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Run each CLIP MLP as one fused SwitchBack op: less activation memory, slower under compile "
        "without --memory_efficient.",
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
    g.add_argument("--image_column", help="Image column.")
    g.add_argument("--caption_column", help="Caption column.")
    g.add_argument("--validation_file", help="CSV/JSON for eval (retrieval).")
    g.add_argument("--validation_shards", help="Webdataset shards for eval (retrieval).")
    g.add_argument("--validation_split", help="Split of --dataset_name for eval (retrieval).")
    g.add_argument(
        "--zeroshot_label_column", help="Integer class column of the eval data, for zero-shot accuracy."
    )
    g.add_argument("--zeroshot_classnames", help="Comma-separated class names.")
    g.add_argument("--zeroshot_templates", default="a photo of a {}.", help="'|'-separated prompt templates.")
    g.add_argument(
        "--max_eval_samples", type=int, default=256, help="Eval set size (synthetic: at most 576)."
    )
    g.add_argument(
        "--synthetic_train_samples", type=int, default=100_000, help="Size of the synthetic train set."
    )
    g.add_argument(
        "--num_workers",
        "--dataloader_num_workers",
        type=int,
        default=1,
        help="DataLoader worker processes per rank.",
    )
    g.add_argument("--shuffle_buffer", type=int, default=1000, help="Streaming shuffle buffer (samples).")
    g.add_argument(
        "--crop_scale_min", type=float, default=0.9, help="Random resized crop: smallest area kept."
    )
    g.add_argument(
        "--max_image_pixels",
        type=int,
        default=DEFAULT_MAX_IMAGE_PIXELS,
        help="Skip images with more pixels, before decoding them (PIL's warning level, Image.MAX_IMAGE_PIXELS; 0: "
        "no limit of ours; PIL itself refuses twice its level whatever this is).",
    )

    g = parser.add_argument_group("optimization")
    g.add_argument(
        "--batch_size", "--per_device_train_batch_size", type=int, default=128, help="Micro-batch per device."
    )
    g.add_argument(
        "--accum_freq", type=int, default=1, help="Micro-batches per step, OpenCLIP-style (full negatives)."
    )
    g.add_argument(
        "--max_train_steps", "--max_steps", type=int, help="Optimizer steps (required for streamed data)."
    )
    g.add_argument(
        "--num_train_epochs", type=int, default=1, help="Epochs when --max_train_steps is not given."
    )
    g.add_argument("--optimizer", choices=OPTIMIZER_CHOICES, default="adamw", help="Optimizer.")
    g.add_argument("--lr", "--learning_rate", type=float, default=2e-3, help="Peak learning rate.")
    g.add_argument("--warmup_steps", type=int, help="Linear warmup steps.")
    g.add_argument("--min_lr_ratio", type=float, default=0.0, help="Cosine floor as a fraction of --lr.")
    g.add_argument(
        "--weight_decay", type=float, default=0.1, help="Decoupled weight decay on weight matrices."
    )
    g.add_argument("--beta1", "--adam_beta1", type=float, default=0.9, help="Adam beta1.")
    g.add_argument("--beta2", "--adam_beta2", type=float, default=0.98, help="Adam beta2.")
    g.add_argument("--eps", "--adam_epsilon", type=float, default=1e-6, help="Adam epsilon.")
    g.add_argument(
        "--layer_scale_init",
        type=float,
        help="Add a learnable per-channel layer-scale, initialized to this value, to the attention and MLP "
        "branches of every encoder layer (0 = the paper's zero-init). Folded into out_proj/fc2 "
        "at save time, so the saved model is a plain CLIPModel.",
    )
    g.add_argument(
        "--grad_clip_norm",
        "--max_grad_norm",
        type=float,
        default=1.0,
        help="Clip the global grad norm (0: off).",
    )
    g.add_argument(
        "--max_nonfinite_steps",
        type=int,
        default=DEFAULT_MAX_CONSECUTIVE,
        help="A step with a NaN/inf loss or gradient norm is skipped (no update); stop the run (exit 1) after "
        "this many in a row (0: never stop).",
    )
    g.add_argument(
        "--local_loss",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CLIP: local rows x global columns loss.",
    )
    g.add_argument(
        "--gather_with_grad",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CLIP: differentiable all-gather of features.",
    )
    g.add_argument(
        "--siglip_dist_impl",
        choices=DIST_IMPLS,
        default="bidir",
        help="SigLIP (a SiglipConfig / siglip model): how text features travel between ranks for the sigmoid "
        "loss. bidir: both ring neighbours per round; shift: one way round the ring; reduce: all-reduces; "
        "gather: one all-gather. Same loss and gradients; exchanges are always differentiable.",
    )
    g.add_argument("--seed", type=int, default=0, help="Seed for init, data order and augmentation.")

    g = parser.add_argument_group("speed and memory")
    g.add_argument(
        "--mixed_precision",
        choices=("no", "bf16", "fp16"),
        help="Autocast dtype.",
    )
    for dtype in ("bf16", "fp16"):
        g.add_argument(
            f"--{dtype}",
            dest="mixed_precision",
            action="store_const",
            const=dtype,
            help=f"Same as --mixed_precision {dtype} (Trainer's flag).",
        )
    g.add_argument(
        "--grad_checkpointing",
        "--gradient_checkpointing",
        action="store_true",
        help="Recompute encoder layers in backward.",
    )
    g.add_argument(
        "--patch_dropout", type=float, default=0.0, help="Fraction of image patches dropped in training."
    )
    g.add_argument(
        "--torch_compile",
        action="store_true",
        help="torch.compile the model (inductor). Compiled graphs, SwitchBack layers included, are kept in "
        "torch's on-disk cache (TORCHINDUCTOR_CACHE_DIR), so a resumed run compiles faster.",
    )
    g.add_argument(
        "--compile_mode",
        choices=COMPILE_MODES,
        help="torch.compile mode with --torch_compile. 'reduce-overhead' replays the "
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
    g.add_argument(
        "--checkpointing_steps",
        "--save_steps",
        type=int,
        default=0,
        help="save_state every N steps (0: never).",
    )
    g.add_argument(
        "--checkpoints_total_limit",
        "--save_total_limit",
        type=int,
        default=2,
        help="Keep only the newest N checkpoints.",
    )
    g.add_argument(
        "--resume_from_checkpoint",
        help="'latest' (in output_dir/checkpoints) or a checkpoint path; newer checkpoints of output_dir move to "
        "checkpoints/abandoned_after_step_N/.",
    )
    g.add_argument(
        "--overwrite_output_dir",
        action="store_true",
        help="Start afresh in an --output_dir that holds a previous run (its checkpoints, log, results removed).",
    )
    g.add_argument(
        "--allow_resume_mismatch",
        action="store_true",
        help="Resume although the checkpoint was written under other settings (model, data, batch geometry, "
        "world size, steps, SwitchBack config, optimizer).",
    )
    g.add_argument(
        "--ddp_timeout",
        type=float,
        default=30,
        help="Minutes a collective waits for a stuck rank before the run fails (30 as in HF Trainer: torch's own "
        "default for gloo, up from its 10 for NCCL, so a rank writing the model or a checkpoint alone is not cut off).",
    )
    g.add_argument(
        "--save_plain",
        action="store_true",
        help="Save (and push) the final model as a plain CLIPModel: config.json without SwitchBack's "
        "quantization_config, so it reloads without SwitchBack layers even with hf_switchback imported.",
    )
    g.add_argument("--push_to_hub", action="store_true", help="Upload the final model with a model card.")
    g.add_argument("--hub_model_id", help="Repository id for --push_to_hub, e.g. user/clip-switchback.")
    g.add_argument(
        "--hub_private",
        "--hub_private_repo",
        action="store_true",
        help="Create the Hub repository as private.",
    )
    g.add_argument(
        "--hub_token",
        help="Deprecated: a token on the command line shows in the process list and in launcher errors; set "
        "HF_TOKEN or run `hf auth login`.",
    )
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
    if args.model_config:
        try:  # a local json: read its model_type now, so another model's config never starts a run
            model_type(args)
        except (OSError, ValueError) as err:
            parser.error(f"--model_config: {err}")
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
    for name in ("max_image_pixels", "max_nonfinite_steps"):
        if getattr(args, name) < 0:
            parser.error(f"--{name} must be >= 0, got {getattr(args, name)}")
    if not args.ddp_timeout > 0:
        parser.error(f"--ddp_timeout must be > 0 minutes, got {args.ddp_timeout}")
    try:
        check_output_dir(args.output_dir, args.resume_from_checkpoint, args.overwrite_output_dir)
        if args.resume_from_checkpoint not in (None, "latest"):
            check_checkpoint(args.resume_from_checkpoint)
    except ValueError as err:
        parser.error(str(err))
    check_hub_token(parser, args)


def check_hub_token(parser: argparse.ArgumentParser, args) -> None:
    """--hub_token moves to HF_TOKEN (nothing that prints args can echo it); --push_to_hub needs a token now,
    not after training."""
    if args.hub_token:
        warnings.warn(
            "--hub_token is deprecated: the token is visible in the process list and in launcher errors; set "
            "HF_TOKEN or run `hf auth login` instead",
            FutureWarning,
            stacklevel=2,
        )
        os.environ["HF_TOKEN"] = args.hub_token
        args.hub_token = None
    if args.push_to_hub:
        from ..hub import resolve_token

        if resolve_token() is None:
            parser.error("--push_to_hub needs a Hub token: set HF_TOKEN or run `hf auth login`")
