"""The flags of examples/train_clip.py, declared as dataclasses for transformers' `HfArgumentParser` (the shape of
its run_clip.py): one field per flag, its help in the field's metadata, one dataclass per `--help` group.

`build_parser()` returns the parser; `parser.parse_args(argv)` gives the flat namespace the script and training/*
read (`args.lr`, `args.batch_size`, ...). A field's metadata holds, besides "help": "aliases" (other flag names,
mostly run_clip.py / Trainer's), "unset" (what a None default means, shown in `--help` as the default), and any
argparse keyword where HfArgumentParser's own mapping of the type does not fit (e.g. BooleanOptionalAction).
The checks of the parsed values live in training/cli.py.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import types
from dataclasses import dataclass
from typing import Literal

from transformers import HfArgumentParser

from ..config import (
    BACKENDS,
    GRAD_PRECISIONS,
    PRECISIONS,
    WEIGHT_SCALINGS,
    WGRAD_PRECISIONS,
    SwitchBackConfig,
)
from .data import CAPTION_COLUMNS, DEFAULT_MAX_IMAGE_PIXELS, IMAGE_COLUMNS
from .guard import DEFAULT_MAX_CONSECUTIVE, UNBOUNDED_CEILING
from .optim import OPTIMIZER_CHOICES
from .runtime import COMPILE_MODES, COMPILE_SCOPES
from .siglip_loss import DIST_IMPLS

PROG = "train_clip.py"
_LIBRARY = SwitchBackConfig()


def arg(default, help: str, *aliases: str, unset: str | None = None, **argparse_kwargs):
    """A dataclass field for one flag: its default, help, other names, and what None means when it is unset."""
    metadata = {"help": help, **argparse_kwargs}
    if aliases:
        metadata["aliases"] = list(aliases)
    if unset is not None:
        metadata["unset"] = unset
    return dataclasses.field(default=default, metadata=metadata)


def switch(default: bool | None, help: str, **kw):
    """A --flag / --no-flag pair (argparse's BooleanOptionalAction), as the script has always spelled it."""
    return arg(default, help, action=argparse.BooleanOptionalAction, **kw)


@dataclass
class ModelArguments:
    _argument_group_name = "model"
    model_name_or_path: str | None = arg(
        None, "Local dir or Hub id of a CLIPModel; its processor is used too.", unset="none, random init"
    )
    model_config: str | None = arg(
        None,
        "CLIPConfig/SiglipConfig json to train from scratch (random init).",
        "--config_name",
        unset="the embedded small CLIP",
    )
    tokenizer_name_or_path: str | None = arg(
        None,
        "Tokenizer when not using --model_name_or_path.",
        "--tokenizer_name",
        unset="none; the synthetic set's word tokenizer, for the synthetic data only",
    )
    allow_synthetic_tokenizer: bool = arg(
        False,
        "Train on your own data with the synthetic set's 28-word tokenizer (other words become <unk>); without "
        "it, own data needs --model_name_or_path or --tokenizer_name_or_path.",
    )
    max_text_length: int = arg(77, "Token limit (capped by the model's positions).", "--max_seq_length")


@dataclass
class SwitchBackArguments:
    _argument_group_name = "SwitchBack (unset fields keep SwitchBackConfig's defaults)"
    switchback: Literal["on", "off"] = arg("on", "Swap the encoder linears for SwitchBack.")
    weight_scaling: Literal[WEIGHT_SCALINGS] | None = arg(
        None, "One weight scale per tensor or per row.", unset=_LIBRARY.weight_scaling
    )
    memory_efficient: bool | None = switch(
        None,
        "The memory switch: save each linear's input in 8 bits for backward and fuse each MLP (its fc1 output "
        "recomputed): about half of bf16's saved activations, so larger batches without checkpointing; "
        "grad-weight from the 8-bit input (BENCHMARKS.md, Memory).",
        unset=str(_LIBRARY.memory_efficient),
    )
    precision: Literal[PRECISIONS] | None = arg(
        None,
        "Forward format: int8, or fp8 (Ada/Hopper GPUs; the smallest spread from scratch in the parity runs, 3 "
        "pairs, BENCHMARKS.md 'Accuracy').",
        unset=_LIBRARY.precision,
    )
    grad_precision: Literal[GRAD_PRECISIONS] | None = arg(
        None,
        "Format of the grad-input GEMM. auto: fp8 on GPUs with fp8 tensor cores (sm89+), int8 elsewhere; fp8 "
        "gradients kept bf16 accuracy where int8 ones did not (BENCHMARKS.md, Accuracy).",
        unset=_LIBRARY.grad_precision,
    )
    wgrad_precision: Literal[WGRAD_PRECISIONS] | None = arg(
        None,
        "Format of the grad-weight GEMM. 16bit: the paper's. fp8 (opt-in, sm89+ GPUs; CPU runs the reference): all "
        "three GEMMs of each linear in 8 bits; accuracy at parity with bf16 on graded shapes (BENCHMARKS.md), "
        "slower today (0.79x at ViT-B/16 b256).",
        unset=_LIBRARY.wgrad_precision,
    )
    fuse_mlp: bool | None = switch(
        None,
        "Run each CLIP MLP as one fused SwitchBack op (fc2's input activation recomputed in backward, not "
        "saved): 16-19%% less peak memory at the same compiled step time (ViT-H/14 b192).",
        unset="on with --memory_efficient, else off",
    )
    fuse_norm: bool | None = switch(
        None,
        "Let each encoder layer's LayerNorms (the second with the residual add before it) write the next "
        "SwitchBack ops' 8-bit input in the same kernel instead of a separate quantize pass (and out_proj's "
        "input come from the one-pass quantize kernel).",
        unset="on (the library default)",
    )
    fuse_activation: bool | None = switch(
        None,
        "Let the MLP activation write fc2's 8-bit input in the same kernel, and its backward fc1's 8-bit output "
        "gradient (separate MLP layers).",
        unset="on (the library default)",
    )
    # arg() returns a dataclasses.field (default None), not a list shared between instances
    target_modules: list[str] | None = arg(  # noqa: RUF009
        None, "Module names / dotted suffixes to swap.", unset=" ".join(_LIBRARY.target_modules)
    )
    exclude_modules: list[str] | None = arg(  # noqa: RUF009
        None, "Module names / dotted suffixes never to swap.", unset=" ".join(_LIBRARY.exclude_modules)
    )
    backend: Literal[BACKENDS] | None = arg(
        None, "Kernel backend: triton on GPU, torch reference elsewhere.", unset=_LIBRARY.backend
    )
    min_tokens: int | None = arg(
        None,
        "Run the 16-bit matmul when a batch has fewer tokens than this (>= 0).",
        unset="per layer shape, measured on this GPU (16384 without a table); 0 off CUDA",
    )


@dataclass
class DataArguments:
    _argument_group_name = "data (default: the embedded synthetic shapes set)"
    train_file: str | None = arg(None, "CSV/TSV/JSON(L) with image path and caption columns.", unset="none")
    train_data_dir: str | None = arg(
        None, "imagefolder directory with a metadata.csv/jsonl holding captions.", "--data_dir", unset="none"
    )
    train_shards: str | None = arg(
        None, "Webdataset tar shards: glob, comma list or folder; always streamed.", unset="none"
    )
    dataset_name: str | None = arg(
        None,
        "A data set on the Hub (or a local datasets dir) by name; loading scripts are not run.",
        unset="none",
    )
    dataset_config_name: str | None = arg(
        None, "Configuration of --dataset_name.", unset="the data set's default"
    )
    train_split: str = arg("train", "Split of --dataset_name / --train_data_dir to train on.")
    streaming: bool = arg(False, "Stream --dataset_name / files instead of loading.")
    image_column: str | None = arg(None, "Image column.", unset=f"the first of {', '.join(IMAGE_COLUMNS)}")
    caption_column: str | None = arg(
        None, "Caption column.", unset=f"the first of {', '.join(CAPTION_COLUMNS)}"
    )
    validation_file: str | None = arg(None, "CSV/JSON for eval (retrieval).", unset="none")
    validation_shards: str | None = arg(None, "Webdataset shards for eval (retrieval).", unset="none")
    validation_split: str | None = arg(
        None,
        "Split of --dataset_name for eval (retrieval).",
        unset="the first training samples; synthetic: held-out shapes",
    )
    zeroshot_label_column: str | None = arg(
        None,
        "Integer class column of the eval data, for zero-shot accuracy.",
        unset="none, retrieval only; synthetic: the shape classes",
    )
    zeroshot_classnames: str | None = arg(None, "Comma-separated class names.", unset="the ClassLabel names")
    zeroshot_templates: str = arg("a photo of a {}.", "'|'-separated prompt templates.")
    max_train_samples: int | None = arg(
        None, "Train on the first N samples only (streamed: the first N of the stream).", unset="all"
    )
    max_eval_samples: int = arg(256, "Eval set size (synthetic: at most 576).")
    synthetic_train_samples: int = arg(100_000, "Size of the synthetic train set.")
    num_workers: int = arg(1, "DataLoader worker processes per rank (>= 0).", "--dataloader_num_workers")
    shuffle_buffer: int = arg(1000, "Streaming shuffle buffer (samples).")
    crop_scale_min: float = arg(0.9, "Random resized crop: smallest area kept.")
    max_image_pixels: int = arg(
        DEFAULT_MAX_IMAGE_PIXELS,
        "Skip images with more pixels, before decoding them (PIL's warning level, Image.MAX_IMAGE_PIXELS; 0: no "
        "limit of ours; PIL itself refuses twice its level whatever this is).",
    )


@dataclass
class OptimizationArguments:
    _argument_group_name = "optimization"
    batch_size: int = arg(128, "Micro-batch per device.", "--per_device_train_batch_size")
    eval_batch_size: int = arg(
        256, "Images (and captions) per forward in eval.", "--per_device_eval_batch_size"
    )
    accum_freq: int = arg(1, "Micro-batches per step, OpenCLIP-style (full negatives).")
    max_train_steps: int | None = arg(
        None,
        "Optimizer steps (required for streamed data).",
        "--max_steps",
        unset="--num_train_epochs over the data",
    )
    num_train_epochs: int = arg(1, "Epochs when --max_train_steps is not given.")
    optimizer: Literal[OPTIMIZER_CHOICES] = arg("adamw", "Optimizer.")
    # lr 2e-3 and weight decay 0.1 are for the embedded default run (small model, small batch); OpenCLIP's
    # ViT-B runs at batch ~32k use 5e-4 and 0.2: scale the learning rate with the batch size.
    lr: float = arg(2e-3, "Peak learning rate (> 0).", "--learning_rate")
    warmup_steps: int | None = arg(None, "Linear warmup steps (>= 0).", unset="5%% of the steps")
    min_lr_ratio: float = arg(0.0, "Cosine floor as a fraction of --lr, in [0, 1].")
    weight_decay: float = arg(0.1, "Decoupled weight decay on weight matrices (>= 0).")
    # Betas and eps are OpenCLIP's ViT recipe, also the SwitchBack paper's. beta2 = 0.98, not 0.999: 0.999's
    # slower second moment under-estimates g² after a quiet stretch, and that under-estimate precedes loss
    # spikes (paper §3.4); StableAdamW lets beta2 go back up. eps 1e-6, not 1e-8: with bf16/fp16 activations a
    # small v̂ would blow up the update.
    beta1: float = arg(0.9, "Adam beta1, in [0, 1).", "--adam_beta1")
    beta2: float = arg(0.98, "Adam beta2, in [0, 1).", "--adam_beta2")
    eps: float = arg(1e-6, "Adam epsilon (> 0).", "--adam_epsilon")
    layer_scale_init: float | None = arg(
        None,
        "Add a learnable per-channel layer-scale, initialized to this value, to the attention and MLP branches "
        "of every encoder layer (0 = the paper's zero-init). Folded into out_proj/fc2 at save time, so the "
        "saved model is a plain CLIPModel.",
        unset="off",
    )
    grad_clip_norm: float = arg(1.0, "Clip the global grad norm (0: off).", "--max_grad_norm")
    max_nonfinite_steps: int = arg(
        DEFAULT_MAX_CONSECUTIVE,
        "A step with a NaN/inf loss or gradient norm is skipped (no update); stop the run (exit 1) after this "
        f"many in a row (0: after {UNBOUNDED_CEILING}, the most a diverged run may loop).",
    )
    local_loss: bool = switch(True, "CLIP: local rows x global columns loss.")
    gather_with_grad: bool = switch(True, "CLIP: differentiable all-gather of features.")
    siglip_dist_impl: Literal[DIST_IMPLS] = arg(
        "bidir",
        "SigLIP (a SiglipConfig / siglip model): how text features travel between ranks for the sigmoid loss. "
        "bidir: both ring neighbours per round; shift: one way round the ring; reduce: all-reduces; gather: one "
        "all-gather. Same loss and gradients; exchanges are always differentiable.",
    )
    seed: int = arg(0, "Seed for init, data order and augmentation.")


@dataclass
class SpeedArguments:
    _argument_group_name = "speed and memory"
    mixed_precision: Literal["no", "bf16", "fp16"] | None = arg(
        None, "Autocast dtype (--bf16 / --fp16: Trainer's spelling).", unset="the accelerate config's"
    )
    grad_checkpointing: bool = arg(False, "Recompute encoder layers in backward.", "--gradient_checkpointing")
    patch_dropout: float = arg(0.0, "Fraction of image patches dropped in training.")
    torch_compile: bool = arg(
        False,
        "torch.compile the model (inductor). Compiled graphs, SwitchBack layers included, are kept in torch's "
        "on-disk cache (TORCHINDUCTOR_CACHE_DIR), so a resumed run compiles faster.",
    )
    compile_mode: Literal[COMPILE_MODES] | None = arg(
        None,
        "torch.compile mode with --torch_compile. 'reduce-overhead' replays the step's kernels as CUDA graphs: "
        "for steps the CPU cannot launch fast enough (small batches, ViT-H, SwitchBack's extra quantize "
        "launches); on Hopper it also selects the TMA 8-bit GEMM, whose launch setup the graphs hide "
        "(BENCHMARKS.md, Whole training step). Needs --accum_freq 1.",
        unset="default",
    )
    compile_scope: Literal[COMPILE_SCOPES] | None = arg(
        None,
        "What --torch_compile compiles. blocks: each repeated encoder layer compiled once and reused by the others "
        "(accelerate's regional compilation): a much shorter first step at the same step time (BENCHMARKS.md "
        "'Whole training step'). model: the whole model as one graph per tower pass.",
        unset="blocks; model with --compile_mode reduce-overhead",
    )
    compile_cache_dir: str | None = arg(
        None,
        "With --torch_compile: where the compiled graphs and kernels are kept for the next run (one file per torch "
        "version, written by the main process after the first step, loaded by every rank before compiling; on "
        "shared storage it warms up other nodes too; one dir per model and setup, as each run replaces the file). "
        "'none': only torch's per-machine cache.",
        unset="<output_dir>/compile_cache",
    )
    cache_weight_operands: bool = arg(
        False,
        "Quantize each SwitchBack weight once per optimizer step, not in every forward and backward "
        "(KernelOptions.cache_weight_operands): for frozen weights (LoRA) and --accum_freq > 1; measured no "
        "faster on full training steps; 2 bytes of GPU memory per weight value (BENCHMARKS.md, Whole training step).",
    )
    lock_image: bool = arg(False, "Freeze the vision tower and its projection.")
    lock_text: bool = arg(False, "Freeze the text tower and its projection.")


@dataclass
class RunArguments:
    _argument_group_name = "logging, eval, checkpoints"
    output_dir: str = arg("runs/clip_switchback", "Checkpoints, final model, all_results.json.")
    report_to: Literal["tensorboard", "wandb", "none"] = arg("none", "Tracker.")
    project_name: str = arg("clip_switchback", "Tracker project / run name.")
    logging_steps: int = arg(10, "Log training scalars every N steps.")
    log_losses: bool = arg(False, "Also print every logged loss (full precision).")
    spike_monitor: bool = arg(
        False,
        "Log the per-layer RMS(g^2/v) of the optimizer state (rms/max, rms/<layer>), warn when it jumps, and "
        "plot loss and max RMS to <output_dir>/spike_monitor.png (not with DeepSpeed).",
    )
    spike_threshold: float = arg(4.0, "--spike_monitor warns when max RMS exceeds this.")
    eval_steps: int = arg(100, "Zero-shot + retrieval eval every N steps (0: end only).")
    checkpointing_steps: int = arg(0, "save_state every N steps (0: never).", "--save_steps")
    checkpoints_total_limit: int = arg(
        2, "Keep only the newest N checkpoints (0: keep all).", "--save_total_limit"
    )
    resume_from_checkpoint: str | None = arg(
        None,
        "'latest' (in output_dir/checkpoints) or a checkpoint path; once it has loaded, newer checkpoints of "
        "output_dir move to checkpoints/abandoned_after_step_N/.",
        unset="none, start from scratch",
    )
    overwrite_output_dir: bool = arg(
        False,
        "Start afresh in a non-empty --output_dir (a previous run's checkpoints, log, results are removed; "
        "other files are left).",
    )
    allow_resume_mismatch: bool = arg(
        False,
        "Resume although the checkpoint was written under other settings (model, data, batch geometry, world "
        "size, steps, SwitchBack config, optimizer, mixed precision, text length, clipping, patch dropout; never "
        "tower locks or layer-scale, which change the saved parameters).",
    )
    ddp_timeout: float = arg(
        30,
        "Minutes a collective waits for a stuck rank before the run fails (30 as in HF Trainer: torch's own "
        "default for gloo, up from its 10 for NCCL, so a rank writing the model or a checkpoint alone is not "
        "cut off).",
    )
    save_plain: bool = arg(
        False,
        "Save (and push) the final model as a plain CLIPModel: config.json without SwitchBack's "
        "quantization_config, so it reloads without SwitchBack layers even with hf_switchback imported.",
    )
    push_to_hub: bool = arg(False, "Upload the final model with a model card.")
    hub_model_id: str | None = arg(
        None, "Repository id for --push_to_hub, e.g. user/clip-switchback.", unset="none"
    )
    hub_private: bool = arg(False, "Create the Hub repository as private.", "--hub_private_repo")
    hub_token: str | None = arg(
        None,
        "Deprecated: a token on the command line shows in the process list and in launcher errors; set HF_TOKEN "
        "or run `hf auth login`.",
        unset="HF_TOKEN, else the cached login",
    )


@dataclass
class RunClipArguments:
    """run_clip.py / Trainer flags that change nothing here: accepted (so its commands parse), each noted once."""

    _argument_group_name = "accepted from run_clip.py, no effect here"
    do_train: bool = arg(False, "run_clip's switch: this script always trains.")
    do_eval: bool = arg(False, "run_clip's switch: this script always evaluates (--eval_steps).")
    remove_unused_columns: bool = arg(True, "run_clip's switch: only the image and caption columns are read.")
    overwrite_cache: bool = arg(False, "run_clip's switch: nothing is preprocessed into a cache here.")


DATACLASSES = (
    ModelArguments,
    SwitchBackArguments,
    DataArguments,
    OptimizationArguments,
    SpeedArguments,
    RunArguments,
    RunClipArguments,
)
NO_OP_FLAGS = tuple(f.name for f in dataclasses.fields(RunClipArguments))
# What a flag whose default is None means when it is not given (shown in --help as its default).
UNSET_DEFAULTS = {
    f.name: f.metadata["unset"] for dc in DATACLASSES for f in dataclasses.fields(dc) if "unset" in f.metadata
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


class ArgumentParser(HfArgumentParser):
    """HfArgumentParser whose usage errors are one line (`train_clip.py: error: ...`, exit 2) and whose fields
    may carry argparse keywords of their own ("action") and an "unset" text for --help."""

    @staticmethod
    def _parse_dataclass_field(parser, field: dataclasses.Field):
        metadata = {k: v for k, v in field.metadata.items() if k != "unset"}
        if (
            "action" in metadata
        ):  # argparse builds this flag as declared: HfArgumentParser's type mapping is not used
            aliases = metadata.pop("aliases", [])
            parser.add_argument(f"--{field.name}", *aliases, default=field.default, **metadata)
            return
        field = copy.copy(field)
        field.metadata = types.MappingProxyType(metadata)
        HfArgumentParser._parse_dataclass_field(parser, field)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")

    def info(self, message: str) -> None:
        """One `train_clip.py: info: ...` line on stderr (before logging is set up)."""
        sys.stderr.write(f"{self.prog}: info: {message}\n")


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        DATACLASSES,
        prog=PROG,
        description="Contrastive CLIP training with SwitchBack 8-bit linears (run with `accelerate launch`). The "
        "second name of a flag is its name in transformers' run_clip.py / Trainer. A single .json/.yaml argument "
        "is read as a file of flags (field names as keys).",
        formatter_class=HelpFormatter,
    )
    _drop_hyphenated_twins(parser)
    speed = next(g for g in parser._action_groups if g.title == SpeedArguments._argument_group_name)
    for dtype in ("bf16", "fp16"):
        speed.add_argument(
            f"--{dtype}",
            dest="mixed_precision",
            action="store_const",
            const=dtype,
            help=f"Same as --mixed_precision {dtype} (Trainer's flag).",
        )
    return parser


def _drop_hyphenated_twins(parser: argparse.ArgumentParser) -> None:
    """HfArgumentParser also adds --a-b for every --a_b; the script's flags are spelled with underscores only
    (--help lists each flag once, under the names it has always had)."""
    for action in parser._actions:
        twins = [
            o
            for o in action.option_strings
            if "-" in o[2:] and "--" + o[2:].replace("-", "_") in action.option_strings
        ]
        for option in twins:
            action.option_strings.remove(option)
            del parser._option_string_actions[option]
