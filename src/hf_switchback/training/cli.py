"""The command line of examples/train_clip.py: `parse_args(parser, argv)` (flags, or one .json/.yaml file of
them) and `check_args(parser, args)`, the one validation pass over the parsed values and the files they name.

Everything a run can be refused for is found here, before any model, data set or output dir is created: each
problem is one line `train_clip.py: error: <problem and fix>` on stderr and exit code 2. The flags themselves are
declared in training/arguments.py.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import math
import os
import warnings

from . import synthetic
from .arguments import NO_OP_FLAGS, ArgumentParser, build_parser
from .checkpoints import check_checkpoint, check_output_dir
from .data import CAPTION_COLUMNS, IMAGE_COLUMNS, check_json_array_encoding, expand_shards
from .model_setup import SWITCHBACK_FLAGS, model_type, switchback_config
from .sources import has_real_data

__all__ = ["build_parser", "check_args", "parse_args"]

ARGUMENT_FILES = (".json", ".yaml", ".yml")
# An Adam step moves a weight by about lr: far above 1 nothing trains, and near float32's limit the optimizer
# itself overflows. The bound only catches typos (3e38 for 3e-8), not bad choices.
MAX_LR = 1e10
# Files up to this size are read whole to count their rows (batch size vs data set size); larger ones are not.
MAX_COUNTED_BYTES = 16 * 2**20
# (flag, lowest, highest): a None bound is open; every bound is inclusive.
RANGES = (
    ("min_tokens", 0, None),
    ("eval_steps", 0, None),
    ("checkpointing_steps", 0, None),
    ("checkpoints_total_limit", 0, None),
    ("warmup_steps", 0, None),
    ("num_workers", 0, None),
    ("weight_decay", 0.0, None),
    ("max_text_length", 1, None),
    ("grad_clip_norm", 0.0, None),
    ("min_lr_ratio", 0.0, 1.0),
    ("shuffle_buffer", 1, None),
    ("eval_batch_size", 1, None),
    ("max_train_samples", 1, None),
    ("synthetic_train_samples", 1, None),
    ("max_image_pixels", 0, None),
    ("max_nonfinite_steps", 0, None),
)


def parse_args(parser: ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """The flat namespace of every flag. A single .json/.yaml argument is a file of {field name: value}, read by
    HfArgumentParser's parse_json_file / parse_yaml_file."""
    if argv is not None and len(argv) == 1 and argv[0].lower().endswith(ARGUMENT_FILES):
        path = argv[0]
        if not os.path.isfile(path):
            parser.error(f"argument file {path!r} does not exist: pass an existing .json/.yaml file of flags")
        read = parser.parse_json_file if path.lower().endswith(".json") else parser.parse_yaml_file
        try:
            parsed = read(path)
        except (ValueError, TypeError) as err:  # unknown keys, or a value the dataclass refuses
            parser.error(
                f"argument file {path!r}: {err} (keys are the flags' field names, e.g. lr, batch_size)"
            )
        values = {k: v for dc in parsed for k, v in vars(dc).items()}
        return argparse.Namespace(**{**vars(parser.parse_args([])), **values})
    return parser.parse_args(argv)


def check_args(parser: ArgumentParser, args) -> None:
    """Reject bad flags, combinations and named files before anything is loaded or created."""
    _check_types(parser, args)
    _check_loading_script(parser, args)
    _check_combinations(parser, args)
    _check_ranges(parser, args)
    _check_data_files(parser, args)
    _check_tokenizer(parser, args)
    if args.backend == "triton":
        from ..kernels.backends import triton_unavailable_reason

        reason = triton_unavailable_reason()
        if reason is not None:
            parser.error(f"--backend triton but {reason}: use --backend auto (or torch) on this machine")
    try:
        check_output_dir(args.output_dir, args.resume_from_checkpoint, args.overwrite_output_dir)
        if args.resume_from_checkpoint not in (None, "latest"):
            check_checkpoint(args.resume_from_checkpoint)
    except ValueError as err:
        parser.error(str(err))
    check_hub_token(parser, args)
    _check_targets(parser, args)  # last of the checks: it builds the model's skeleton
    _note_no_ops(parser, args)


def _check_types(parser, args) -> None:
    """Choices and number types again: a .json/.yaml file of flags does not pass through argparse."""
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if value is None or action.dest == "help":
            continue
        flag = action.option_strings[0]
        if action.choices is not None and value not in action.choices:
            parser.error(
                f"{flag}: invalid choice {value!r} (choose from {', '.join(map(str, action.choices))})"
            )
        if action.type in (int, float):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not ok or (action.type is int and not float(value).is_integer()):
                parser.error(f"{flag}: expected {action.type.__name__}, got {value!r}")
            setattr(args, action.dest, action.type(value))


def _check_combinations(parser, args) -> None:
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
    if args.compile_mode is not None and not args.torch_compile:
        parser.error("--compile_mode needs --torch_compile")
    if args.compile_scope is not None and not args.torch_compile:
        parser.error("--compile_scope needs --torch_compile")
    if args.compile_cache_dir is not None and not args.torch_compile:
        parser.error("--compile_cache_dir needs --torch_compile")
    if args.compile_cache_dir and os.path.isfile(args.compile_cache_dir):
        parser.error(f"--compile_cache_dir {args.compile_cache_dir!r} is a file: pass a directory (or none)")
    if args.compile_scope == "blocks" and args.compile_mode == "reduce-overhead" and args.grad_checkpointing:
        # a recomputed layer replays its CUDA graph while the first replay's outputs are still needed
        parser.error(
            "--compile_scope blocks with --compile_mode reduce-overhead cannot recompute layers "
            "(--gradient_checkpointing): use --compile_scope model"
        )
    if args.compile_mode == "reduce-overhead" and args.accum_freq > 1:
        # the cached-feature passes keep outputs of one replay while the next replay overwrites them
        parser.error("--compile_mode reduce-overhead (CUDA graphs) needs --accum_freq 1")
    tracker_module = {"tensorboard": "tensorboard", "wandb": "wandb"}.get(args.report_to)
    if tracker_module and importlib.util.find_spec(tracker_module) is None:
        parser.error(f"--report_to {args.report_to} needs `pip install {tracker_module}`")
    if "{}" not in args.zeroshot_templates:
        parser.error("--zeroshot_templates: every template needs a {} for the class name")
    if args.push_to_hub and not args.hub_model_id:
        parser.error("--push_to_hub needs --hub_model_id")


def _check_ranges(parser, args) -> None:
    for name in ("batch_size", "accum_freq", "logging_steps", "num_train_epochs", "max_eval_samples"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.max_train_steps is not None and args.max_train_steps < 1:
        parser.error(f"--max_train_steps must be >= 1, got {args.max_train_steps}")
    for name, low, high in RANGES:
        value = getattr(args, name)
        if value is None:
            continue
        if not math.isfinite(value) or value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"in [{low}, {high}]"
            parser.error(f"--{name} must be {bound}, got {value}")
    if not (math.isfinite(args.lr) and 0 < args.lr < MAX_LR):
        parser.error(
            f"--lr must be a number > 0 and < {MAX_LR:g} (CLIP trains at 1e-4 to 5e-3), got {args.lr}"
        )
    for name in ("beta1", "beta2"):
        if not 0.0 <= getattr(args, name) < 1.0:
            parser.error(f"--{name} (Adam) must be in [0, 1), got {getattr(args, name)}")
    if not (math.isfinite(args.eps) and args.eps > 0):
        parser.error(f"--eps (Adam) must be a number > 0, e.g. 1e-6, got {args.eps}")
    if not 0.0 <= args.patch_dropout < 1.0:
        parser.error(f"--patch_dropout must be in [0, 1), got {args.patch_dropout}")
    if args.layer_scale_init is not None and not math.isfinite(args.layer_scale_init):
        parser.error(f"--layer_scale_init must be a finite number, got {args.layer_scale_init}")
    if not (math.isfinite(args.spike_threshold) and args.spike_threshold > 0):
        parser.error(f"--spike_threshold must be > 0, got {args.spike_threshold}")
    if not 0.0 < args.crop_scale_min <= 1.0:
        parser.error(f"--crop_scale_min must be in (0, 1], got {args.crop_scale_min}")
    if not args.ddp_timeout > 0:
        parser.error(f"--ddp_timeout must be > 0 minutes, got {args.ddp_timeout}")
    if not has_real_data(args) and args.max_eval_samples > len(synthetic.all_specs()):
        parser.error(
            f"--max_eval_samples: the synthetic eval set has {len(synthetic.all_specs())} distinct samples"
        )


def _check_loading_script(parser, args) -> None:
    """run_clip.py's COCO example: a datasets loading script that reads the images from --data_dir."""
    if args.dataset_name and (args.dataset_name.endswith(".py") or args.train_data_dir):
        parser.error(
            f"--dataset_name {args.dataset_name} with --data_dir is a datasets loading script (run_clip.py's "
            "COCO example), which this script does not run: write the image paths and captions to a CSV and "
            "pass --train_file captions.csv --image_column <path column> --caption_column <caption column>"
        )


def _note_no_ops(parser, args) -> None:
    """run_clip.py's flags that change nothing here: one info line each (main process only)."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    defaults = vars(parser.parse_args([]))
    for name in NO_OP_FLAGS:
        if getattr(args, name) != defaults[name]:
            action = next(a for a in parser._actions if a.dest == name)
            parser.info(f"--{name} has no effect here ({action.help})")


def _check_data_files(parser, args) -> None:
    """Named files exist, CSV/JSONL headers hold the columns, and a rank gets at least one batch."""
    for flag in ("model_config", "train_file", "validation_file"):
        path = getattr(args, flag)
        if path and not os.path.isfile(path):
            parser.error(f"--{flag} {path!r} is not a file: check the path")
    if args.train_data_dir and not os.path.isdir(args.train_data_dir):
        parser.error(f"--train_data_dir {args.train_data_dir!r} is not a directory: check the path")
    for flag in ("train_shards", "validation_shards"):
        if getattr(args, flag):
            try:
                expand_shards(getattr(args, flag))
            except FileNotFoundError as err:
                parser.error(f"--{flag}: {err}: check the glob, list or folder")
    rows = None
    for flag in ("train_file", "validation_file"):
        if getattr(args, flag):
            counted = _check_columns(parser, args, flag)
            rows = counted if flag == "train_file" else rows
    if not has_real_data(args):
        rows = args.synthetic_train_samples
    if rows is not None:
        rows = min(rows, args.max_train_samples or rows)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if rows // world < args.batch_size:
            parser.error(
                f"--batch_size {args.batch_size} is larger than the {rows} training samples give each of {world} "
                f"process(es) ({rows // world}): lower --batch_size or use more data"
            )


def _check_columns(parser, args, flag: str) -> int | None:
    """Check the image/caption columns from the header only; return the row count when the file is small."""
    path = getattr(args, flag)
    ext = path.rsplit(".", 1)[-1].lower()
    if ext not in ("csv", "tsv", "json", "jsonl"):
        parser.error(f"--{flag} {path!r} must be .csv, .tsv, .json or .jsonl")
    if ext == "json":
        try:  # a bad byte fails datasets' whole-file parse later, after the model has loaded
            check_json_array_encoding(path)
        except ValueError as err:
            parser.error(f"--{flag}: {err}")
        return None  # one JSON document: its keys are known only after reading all of it
    delimiter = "\t" if ext == "tsv" else ","
    # utf-8-sig: a spreadsheet's byte-order mark is not part of the first column's name
    with open(path, encoding="utf-8-sig", errors="replace", newline="") as f:
        if ext == "jsonl":
            try:
                first = json.loads(f.readline() or "{}")
            except json.JSONDecodeError:
                first = None
            if not isinstance(first, dict):
                parser.error(f"--{flag} {path!r}: the first line is not a JSON object")
            columns = list(first)
        else:
            columns = next(csv.reader(f, delimiter=delimiter), [])
    for what, wanted, candidates in (
        ("image", args.image_column, IMAGE_COLUMNS),
        ("caption", args.caption_column, CAPTION_COLUMNS),
    ):
        if wanted is not None and wanted not in columns:
            parser.error(f"--{flag} {path!r} has no column {wanted!r} (its columns: {', '.join(columns)}): "
                         f"pass --{what}_column with one of them")  # fmt: skip
        if wanted is None and not any(c in columns for c in candidates):
            parser.error(f"--{flag} {path!r} has none of the {what} columns {', '.join(candidates)} (its "
                         f"columns: {', '.join(columns)}): pass --{what}_column")  # fmt: skip
    label = args.zeroshot_label_column
    if flag == "validation_file" and label and label not in columns:
        parser.error(f"--zeroshot_label_column {label!r} is not a column of --validation_file {path!r} (its columns: "
                     f"{', '.join(columns)})")  # fmt: skip
    if os.path.getsize(path) > MAX_COUNTED_BYTES:
        return None
    with open(path, encoding="utf-8-sig", errors="replace", newline="") as f:
        if ext == "jsonl":
            return sum(1 for line in f if line.strip())
        return max(0, sum(1 for _ in csv.reader(f, delimiter=delimiter)) - 1)


def _check_tokenizer(parser, args) -> None:
    if has_real_data(args) and not (
        args.model_name_or_path or args.tokenizer_name_or_path or args.allow_synthetic_tokenizer
    ):
        parser.error(
            "your own data needs a real tokenizer (the synthetic set's 28-word one turns other words into <unk>): "
            "pass --tokenizer_name_or_path (e.g. openai/clip-vit-base-patch32), --model_name_or_path, or "
            "--allow_synthetic_tokenizer to train with it anyway"
        )


def _check_targets(parser, args) -> None:
    """The SwitchBack config is valid and its --target_modules match linears of the model, checked on a
    meta-device copy (no memory, no weights read). A Hub id is not fetched here: it is checked at load."""
    if args.switchback == "off" or (args.model_name_or_path and not os.path.isdir(args.model_name_or_path)):
        return
    try:
        config = switchback_config(args)
    except (ValueError, TypeError) as err:
        parser.error(str(err))
    from ..convert import find_targets

    try:
        model = meta_model(args)
    except (OSError, ValueError) as err:
        parser.error(f"cannot build the model from its config: {err}")
    try:
        find_targets(model, config)
    except ValueError as err:
        parser.error(f"--target_modules / --exclude_modules: {err}".replace("SwitchBackConfig(target_modules=[...])",
                                                                             "--target_modules"))  # fmt: skip


def meta_model(args):
    """The run's model, built from its config on the meta device (module names and shapes only)."""
    import torch
    from transformers import AutoConfig, CLIPConfig, CLIPModel, SiglipConfig, SiglipModel

    from .model_setup import DEFAULT_IMAGE_SIZE, default_clip
    from .tokenizer import build_word_tokenizer

    kind = model_type(args)
    with torch.device("meta"):
        if args.model_name_or_path:
            config = AutoConfig.from_pretrained(args.model_name_or_path)
        elif args.model_config:
            config = (SiglipConfig if kind == "siglip" else CLIPConfig).from_json_file(args.model_config)
        else:
            tokenizer = build_word_tokenizer(synthetic.vocabulary(), model_max_length=16)
            return default_clip(tokenizer, DEFAULT_IMAGE_SIZE)[0]
        return (SiglipModel if kind == "siglip" else CLIPModel)(config)


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
