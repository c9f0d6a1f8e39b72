"""Contrastive CLIP training with SwitchBack int8/fp8 linears, on Accelerate.

With no arguments it trains a small CLIP (random init, SwitchBack on) on a generated data set of captioned
coloured shapes, with a tokenizer built locally — nothing is downloaded — and reports zero-shot accuracy and
retrieval recall as it learns (a few minutes on a laptop CPU):

    accelerate launch examples/train_clip.py

Real models and data:

    accelerate launch --config_file accelerate_configs/multi_gpu.yaml examples/train_clip.py \\
        --model_name_or_path openai/clip-vit-base-patch32 \\
        --train_shards "/data/laion/*.tar" --max_train_steps 20000 \\
        --batch_size 256 --accum_freq 4 --mixed_precision bf16 --output_dir runs/b32

    # CSV/JSON (image path + caption columns), imagefolder + metadata.csv, or a Hub data set:
    accelerate launch examples/train_clip.py --model_name_or_path openai/clip-vit-base-patch32 \
        --train_file captions.csv --image_column path --caption_column text
    accelerate launch examples/train_clip.py --model_config my_clip_config.json \
        --tokenizer_name_or_path openai/clip-vit-base-patch32 --train_data_dir images/
    accelerate launch examples/train_clip.py --model_name_or_path openai/clip-vit-base-patch32 \
        --dataset_name user/captions --streaming --max_train_steps 1000

    # The synthetic set as webdataset shards, then trained on in streaming mode by 2 CPU processes (gloo):
    python -m hf_switchback.training.synthetic --output_dir shards/ --num_samples 20000
    accelerate launch --config_file accelerate_configs/cpu.yaml examples/train_clip.py \
        --train_shards shards/ --max_train_steps 300

    # Resume exactly where the last checkpoint left off (same step, same data position):
    accelerate launch examples/train_clip.py --output_dir runs/b32 --resume_from_checkpoint latest

    # The paper's stability recipe: StableAdamW, zero-init layer-scale (folded away in the saved model), and
    # the loss-spike monitor (per-layer RMS of g^2/v logged, warnings, <output_dir>/spike_monitor.png):
    accelerate launch examples/train_clip.py --optimizer stableadamw --layer_scale_init 0 --spike_monitor

Batch sizes: --batch_size is per device and per micro-batch; one optimizer step sees
batch_size x accum_freq x num_processes image-text pairs, all of them negatives for each other.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import os
import re
import shutil
import time
import weakref

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, TorchDynamoPlugin, set_seed
from tqdm.auto import tqdm

from hf_switchback import SwitchBackConfig, apply_switchback
from hf_switchback.config import BACKENDS, GRAD_PRECISIONS, PRECISIONS, WEIGHT_SCALINGS
from hf_switchback.training import data as data_lib
from hf_switchback.training import synthetic
from hf_switchback.training.evaluation import evaluate
from hf_switchback.training.layer_scale import add_layer_scale, fold_layer_scale, fold_layer_scale_state_dict
from hf_switchback.training.losses import ClipLoss
from hf_switchback.training.optim import cosine_with_warmup, param_groups
from hf_switchback.training.optimizers import OPTIMIZER_CHOICES, create_optimizer, unstable_parameters
from hf_switchback.training.patch_dropout import add_patch_dropout
from hf_switchback.training.spike_monitor import SpikeMonitor, default_group_name
from hf_switchback.training.step import (
    CLIPForContrastive,
    clamp_logit_scale,
    contrastive_backward,
    export_state_dict,
    logit_scale_to_1d,
)
from hf_switchback.training.teardown import end_training
from hf_switchback.training.tokenizer import build_word_tokenizer
from hf_switchback.training.transforms import train_transform_for

logger = logging.getLogger("train_clip")

# ---------------------------------------------------------------------------------------------------------------
# The embedded default: a CLIP small enough to learn the shapes set on a CPU in minutes.
# ---------------------------------------------------------------------------------------------------------------
DEFAULT_IMAGE_SIZE = 32  # model input; the generator draws at 2x and the crop/resize brings it down
DEFAULT_TOWER = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4)
CHECKPOINT_PREFIX = "step_"


def default_clip(tokenizer, image_size: int):
    """(CLIPModel, CLIPProcessor) for the embedded default, random init, no download."""
    from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel, CLIPProcessor

    text = dict(
        DEFAULT_TOWER,
        vocab_size=len(tokenizer),
        max_position_embeddings=tokenizer.model_max_length,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision = dict(DEFAULT_TOWER, image_size=image_size, patch_size=image_size // 4)
    config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=64)
    size = {"shortest_edge": image_size}
    image_processor = CLIPImageProcessorPil(size=size, crop_size={"height": image_size, "width": image_size})
    return CLIPModel(config), CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer)


def load_model_and_processor(args):
    """--model_name_or_path (weights + processor), --model_config (random init), or the embedded default."""
    from transformers import (
        AutoProcessor,
        AutoTokenizer,
        CLIPConfig,
        CLIPImageProcessorPil,
        CLIPModel,
        CLIPProcessor,
    )

    if args.model_name_or_path:
        clip = CLIPModel.from_pretrained(args.model_name_or_path)
        return clip, AutoProcessor.from_pretrained(args.model_name_or_path)
    if args.tokenizer_name_or_path:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name_or_path)
        tokenizer.model_max_length = min(tokenizer.model_max_length, args.max_text_length)
    else:
        tokenizer = build_word_tokenizer(synthetic.vocabulary(), model_max_length=16)
        if has_real_data(args):
            logger.warning(
                "training on your data with the synthetic set's word tokenizer: words outside its vocabulary "
                "become <unk>; pass --model_name_or_path or --tokenizer_name_or_path for a real tokenizer"
            )
    if not args.model_config:
        return default_clip(tokenizer, DEFAULT_IMAGE_SIZE)
    config = CLIPConfig.from_json_file(args.model_config)
    if config.text_config.vocab_size < len(tokenizer):
        raise ValueError(
            f"--model_config has text vocab_size {config.text_config.vocab_size} < the tokenizer's {len(tokenizer)}"
        )
    side = config.vision_config.image_size
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": side}, crop_size={"height": side, "width": side}
    )
    return CLIPModel(config), CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer)


def switchback_config(args) -> SwitchBackConfig:
    """SwitchBackConfig from the --switchback_* flags; unset flags keep the library defaults."""
    fields = {
        "weight_scaling": args.weight_scaling,
        "memory_efficient": args.memory_efficient,
        "precision": args.precision,
        "grad_precision": args.grad_precision,
        "fuse_mlp": args.fuse_mlp,
        "target_modules": args.target_modules,
        "exclude_modules": args.exclude_modules,
        "backend": args.backend,
        "min_tokens": args.min_tokens,
    }
    return SwitchBackConfig(**{k: v for k, v in fields.items() if v is not None})


def load_train_source(args) -> data_lib.DataSource:
    return data_lib.load_source(
        synthetic_samples=None if has_real_data(args) else args.synthetic_train_samples,
        synthetic_image_size=2 * DEFAULT_IMAGE_SIZE,
        train_file=args.train_file,
        data_dir=args.train_data_dir,
        shards=args.train_shards,
        dataset_name=args.dataset_name,
        dataset_config=args.dataset_config_name,
        split=args.train_split,
        streaming=args.streaming,
        image_column=args.image_column,
        caption_column=args.caption_column,
        seed=args.seed,
    )


def load_eval_set(args, train_source):
    """(images, captions, labels|None), class names, templates. Synthetic: held-out distinct combinations."""
    if not has_real_data(args):
        data = synthetic.SyntheticShapes(
            args.max_eval_samples, image_size=2 * DEFAULT_IMAGE_SIZE, split="eval"
        )
        source = data_lib.DataSource(data, "image", "caption", streaming=False, label_column="label")
        eval_set = data_lib.load_eval_samples(source, args.max_eval_samples)
        return eval_set, synthetic.zeroshot_classnames(), synthetic.ZEROSHOT_TEMPLATES
    if args.validation_file or args.validation_shards or args.validation_split:
        source = data_lib.load_source(
            train_file=args.validation_file,
            shards=args.validation_shards,
            dataset_name=args.dataset_name if args.validation_split else None,
            dataset_config=args.dataset_config_name,
            split=args.validation_split or "validation",
            streaming=args.streaming,
            image_column=args.image_column,
            caption_column=args.caption_column,
        )
    else:
        logger.warning("no validation data given: evaluating on the first training samples (not held out)")
        source = train_source
    classnames = None
    if args.zeroshot_label_column:
        if args.zeroshot_label_column not in data_lib.columns_of(source.dataset):
            raise ValueError(
                f"--zeroshot_label_column {args.zeroshot_label_column!r} is not a column of the eval data"
            )
        source.label_column = args.zeroshot_label_column
        feature = (getattr(source.dataset, "features", None) or {}).get(args.zeroshot_label_column)
        classnames = (
            args.zeroshot_classnames.split(",")
            if args.zeroshot_classnames
            else getattr(feature, "names", None)
        )
        if not classnames:
            raise ValueError(
                f"--zeroshot_label_column {args.zeroshot_label_column!r} is not a ClassLabel: pass --zeroshot_classnames"
            )
    templates = tuple(args.zeroshot_templates.split("|"))
    return data_lib.load_eval_samples(source, args.max_eval_samples), classnames, templates


def has_real_data(args) -> bool:
    return any((args.train_file, args.train_data_dir, args.train_shards, args.dataset_name))


def lock_towers(model, lock_image: bool, lock_text: bool) -> None:
    """Freeze a whole tower and its projection (OpenCLIP's --lock-image / --lock-text, fully locked)."""
    towers = [("vision_model", "visual_projection")] * lock_image + [
        ("text_model", "text_projection")
    ] * lock_text
    for names in towers:
        for name in names:
            getattr(model, name).requires_grad_(False)


def check_deepspeed(accelerator, args) -> None:
    """DeepSpeed owns accumulation and clipping; our loader is not prepared, so give it the micro-batch size."""
    if args.accum_freq > 1:
        raise ValueError(
            "--accum_freq > 1 needs no_sync between the cached-feature passes, which DeepSpeed does not offer: "
            "use DDP or FSDP2 (accelerate_configs/multi_gpu.yaml, fsdp2.yaml), or --accum_freq 1"
        )
    if args.spike_monitor:
        raise ValueError(
            "--spike_monitor reads the optimizer's second-moment state, which lives inside DeepSpeed's engine "
            "(partitioned, flattened): use DDP or FSDP2 (accelerate_configs/multi_gpu.yaml, fsdp2.yaml)"
        )
    ds_config = accelerator.state.deepspeed_plugin.deepspeed_config
    ds_config["train_micro_batch_size_per_gpu"] = args.batch_size


def micro_batch_stream(stream, collate, args, epoch: int, skip: int):
    """Endless (epoch, batches consumed in epoch, batch); skips the first `skip` batches of `epoch`."""
    while True:
        loader = data_lib.epoch_loader(stream, collate, args.batch_size, epoch, num_workers=args.num_workers)
        seen = 0
        for seen, batch in enumerate(loader, start=1):
            if seen > skip:
                yield epoch, seen, batch
        if seen == 0:
            raise RuntimeError(
                f"epoch {epoch} produced no full batch of {args.batch_size} on this rank: too little data "
                "(or every sample unreadable) for this batch size and number of processes"
            )
        epoch, skip = epoch + 1, 0


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints: accelerate's save_state (model, optimizer, scheduler, RNG of every rank) + our data position.
# ---------------------------------------------------------------------------------------------------------------
def checkpoint_dirs(output_dir: str) -> list[str]:
    root = os.path.join(output_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    names = [n for n in os.listdir(root) if re.fullmatch(rf"{CHECKPOINT_PREFIX}\d+", n)]
    return [os.path.join(root, n) for n in sorted(names, key=lambda n: int(n[len(CHECKPOINT_PREFIX) :]))]


def resolve_checkpoint(args) -> str | None:
    if not args.resume_from_checkpoint:
        return None
    if args.resume_from_checkpoint == "latest":
        found = checkpoint_dirs(args.output_dir)
        return found[-1] if found else None
    return args.resume_from_checkpoint


def save_checkpoint(accelerator, args, state: dict) -> None:
    path = os.path.join(args.output_dir, "checkpoints", f"{CHECKPOINT_PREFIX}{state['step']}")
    accelerator.save_state(path)
    # Every rank has its own data position (streams are per rank), so every rank writes its own file.
    with open(os.path.join(path, f"train_state_rank{accelerator.process_index}.json"), "w") as f:
        json.dump(state, f)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process and args.checkpoints_total_limit:
        for old in checkpoint_dirs(args.output_dir)[: -args.checkpoints_total_limit]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def load_train_state(path: str, rank: int) -> dict:
    file = os.path.join(path, f"train_state_rank{rank}.json")
    if not os.path.exists(file):
        raise FileNotFoundError(
            f"{file} is missing: was the checkpoint written with this number of processes?"
        )
    with open(file) as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")


def dynamo_plugin(args) -> TorchDynamoPlugin | None:
    """accelerate's torch.compile settings; with CUDA graphs on Hopper, the TMA 8-bit GEMM too."""
    if not args.torch_compile:
        return None
    mode = args.compile_mode or "default"
    if mode == "reduce-overhead" and args.switchback == "on" and tma_gemm_available():
        # Alone the TMA GEMM is 10-15% faster than the portable one, but its host-side setup made launch-bound
        # steps slower; replayed as a CUDA graph that setup is gone (ViT-B/16: 102.6 vs 106.9 ms/step).
        from hf_switchback.kernels import matmul

        matmul.USE_TMA = True
        logger.info("CUDA graphs: using the Hopper TMA 8-bit GEMM (hf_switchback.kernels.matmul.USE_TMA)")
    return TorchDynamoPlugin(backend="inductor", mode=mode)


def tma_gemm_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def training_function(args):
    report_to = None if args.report_to == "none" else args.report_to
    accelerator = Accelerator(
        # A multi-process launch on a machine without CUDA (CI, laptops): gloo on the CPU, not a GPU backend.
        cpu=not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1,
        mixed_precision=args.mixed_precision,
        log_with=report_to,
        project_dir=args.output_dir,
        # our scheduler counts optimizer steps, not steps x processes
        step_scheduler_with_optimizer=False,
        dynamo_plugin=dynamo_plugin(args),
    )
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    if not accelerator.is_main_process:
        logging.getLogger().setLevel(logging.WARNING)
    if (
        accelerator.distributed_type == DistributedType.MULTI_CPU
        and os.environ.get("ACCELERATE_USE_FSDP") == "true"
    ):
        # accelerate 1.x turns FSDP on only for GPU-like devices; a CPU launch of fsdp2.yaml is DDP over gloo
        logger.warning("FSDP config on the CPU: accelerate runs this as plain DDP (gloo), not FSDP2")
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        check_deepspeed(accelerator, args)  # before anything is loaded: it can refuse the run
    set_seed(args.seed)
    os.makedirs(args.output_dir, exist_ok=True)

    # Model + SwitchBack
    clip, processor = load_model_and_processor(args)
    tokenizer, image_processor = processor.tokenizer, processor.image_processor
    lock_towers(clip, args.lock_image, args.lock_text)
    sb_config = None
    if args.switchback == "on":
        sb_config = switchback_config(args)
        apply_switchback(clip, sb_config)
    if args.grad_checkpointing:
        clip.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.patch_dropout > 0:
        add_patch_dropout(clip, args.patch_dropout)
    if args.layer_scale_init is not None:
        # New Parameters: before the optimizer and prepare. Locked towers get none (a frozen zero-init scale
        # would switch their layers off for good).
        for tower, locked in (("vision_model", args.lock_image), ("text_model", args.lock_text)):
            if not locked:
                add_layer_scale(getattr(clip, tower), args.layer_scale_init)
    max_text_length = min(args.max_text_length, clip.config.text_config.max_position_embeddings)
    image_size = clip.config.vision_config.image_size

    # Data: every rank reads its own share; batches are moved to the device by hand (not prepared), so
    # accelerate does not re-shard an already-sharded stream.
    train_source = load_train_source(args)
    stream = data_lib.CaptionStream(
        train_source,
        train_transform_for(image_processor, image_size, scale=(args.crop_scale_min, 1.0)),
        seed=args.seed,
        rank=accelerator.process_index,
        world_size=accelerator.num_processes,
        shuffle_buffer=args.shuffle_buffer,
    )
    collate = data_lib.Collate(tokenizer, max_text_length)
    eval_set, classnames, templates = load_eval_set(args, train_source)

    global_batch = args.batch_size * args.accum_freq * accelerator.num_processes
    if args.max_train_steps is None:
        per_rank = len(train_source.dataset) // accelerator.num_processes
        steps_per_epoch = max(1, per_rank // (args.batch_size * args.accum_freq))
        args.max_train_steps = args.num_train_epochs * steps_per_epoch
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, args.max_train_steps // 20)

    # What accelerate wraps: forward returns (image features, text features, exp(logit_scale)), OpenCLIP-style.
    # logit_scale becomes shape (1,) (FSDP2 and ZeRO-3 shard along dim 0; 0-d is refused), on every backend so
    # checkpoints are the same everywhere; the saved model gets the 0-d shape back (export_state_dict).
    logit_scale_to_1d(clip)
    model = CLIPForContrastive(clip)
    optimizer = create_optimizer(
        args.optimizer,
        param_groups(model, args.weight_decay),
        lr=args.lr,
        betas=(args.beta1, args.beta2),
        eps=args.eps,
        # 8-bit variants: the embedding tables keep fp32 states (bitsandbytes' advice for sparse gradients)
        keep_32bit=unstable_parameters(model) if "8bit" in args.optimizer else (),
    )
    scheduler = cosine_with_warmup(optimizer, warmup, args.max_train_steps, args.min_lr_ratio)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    clip = accelerator.unwrap_model(model).clip  # the CLIPModel: clamping, logging, saving
    loss_fn = ClipLoss(local_loss=args.local_loss, gather_with_grad=args.gather_with_grad)
    monitor = None
    if args.spike_monitor:
        # Parameter names as prepared: the monitor drops DDP's "module." / compile's "_orig_mod.", we drop the
        # wrapper's "clip." so the groups read text_model.layers.3, vision_model.embeddings, logit_scale, ...
        monitor = SpikeMonitor(
            model,
            optimizer,
            threshold=args.spike_threshold,
            group_fn=lambda name: default_group_name(name.removeprefix("clip.")),
        )

    # Resume: weights, optimizer, scheduler, RNG from save_state; step and data position from our json.
    state = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "loss_sum": 0.0, "num_skipped": 0}
    checkpoint = resolve_checkpoint(args)
    if checkpoint:
        accelerator.print(f"resuming from {checkpoint}")
        accelerator.load_state(checkpoint)
        state = load_train_state(checkpoint, accelerator.process_index)
    elif args.resume_from_checkpoint:
        accelerator.print(f"no checkpoint found in {args.output_dir}/checkpoints: starting from scratch")

    if report_to:
        accelerator.init_trackers(args.project_name, config=tracker_config(args))
    accelerator.print(
        f"training {args.max_train_steps} steps, global batch {global_batch} "
        f"({args.batch_size} x accum {args.accum_freq} x {accelerator.num_processes} processes, "
        f"{accelerator.distributed_type.value} on {accelerator.device.type}), "
        f"SwitchBack: {sb_config if sb_config else 'off'}"
    )

    def run_eval(step: int) -> dict:
        metrics = evaluate(
            model,
            tokenizer,
            image_processor,
            eval_set,
            classnames=classnames,
            templates=templates,
            max_length=max_text_length,
            device=accelerator.device,
        )
        accelerator.log({f"eval/{k}": v for k, v in metrics.items()}, step=step)
        accelerator.print(f"step {step}: " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(metrics.items())))
        append_log(accelerator, log_path, {"step": step, **metrics})
        return metrics

    batches = micro_batch_stream(stream, collate, args, state["epoch"], state["batch_in_epoch"])
    model.train()
    progress = tqdm(
        total=args.max_train_steps, initial=state["step"], disable=not accelerator.is_local_main_process
    )
    start_step, train_time = state["step"], 0.0  # train_time leaves evals and checkpoints out
    # Steady-state throughput leaves the first steps of this launch out (compile, autotune, allocator warm-up).
    steady_from = start_step + min(10, (args.max_train_steps - start_step) // 3)
    steady_time, window = 0.0, {"steps": 0, "time": 0.0}
    log_path = os.path.join(args.output_dir, "train_log.jsonl")
    if accelerator.is_main_process:
        reset_log(log_path, keep_until=state["step"])  # fresh run: empty; resumed: up to the checkpoint
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats(accelerator.device)
    while state["step"] < args.max_train_steps:
        t0 = time.perf_counter()
        micro_batches = []
        for _ in range(args.accum_freq):
            state["epoch"], state["batch_in_epoch"], batch = next(batches)
            state["num_skipped"] += int(batch["num_skipped"])
            micro_batches.append(
                {k: batch[k].to(accelerator.device) for k in ("pixel_values", "input_ids", "attention_mask")}
            )

        if args.compile_mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()  # the last step's graph outputs are no longer read
        loss = contrastive_backward(model, loss_fn, micro_batches, accelerator)
        grad_norm = None
        if args.grad_clip_norm and args.grad_clip_norm > 0:
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.grad_clip_norm)
        optimizer.step()
        # reads this step's gradients and updated second moments: after step(), before zero_grad()
        spike_metrics = monitor.update(state["step"] + 1, loss.item()) if monitor else {}
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        clamp_logit_scale(clip)

        state["step"] += 1
        loss_value = loss.item()
        state["loss_sum"] += loss_value
        step_time = time.perf_counter() - t0  # loss.item() above waited for the GPU
        train_time += step_time
        if state["step"] > steady_from:
            steady_time += step_time
        window["steps"] += 1
        window["time"] += step_time
        samples_per_s = global_batch * (state["step"] - start_step) / max(train_time, 1e-9)
        progress.update(1)
        progress.set_postfix(loss=f"{loss_value:.3f}", samples_per_s=f"{samples_per_s:.0f}")
        if state["step"] % args.logging_steps == 0 or state["step"] == args.max_train_steps:
            logs = {
                "train/loss": mean_over_ranks(accelerator, loss_value),
                "train/lr": scheduler.get_last_lr()[0],
                "train/logit_scale": logit_scale_value(clip),
                "train/samples_per_second": samples_per_s,
                "train/epoch": state["epoch"],
                "train/skipped_samples": sum_over_ranks(accelerator, state["num_skipped"]),
            }
            if grad_norm is not None:
                logs["train/grad_norm"] = float(grad_norm)
            logs.update(spike_metrics)  # rms/max, rms/<layer> (this rank's values)
            accelerator.log(logs, step=state["step"])
            # throughput of the steps since the last log line (the tracker's is the running mean)
            window_samples_per_s = global_batch * window["steps"] / max(window["time"], 1e-9)
            window = {"steps": 0, "time": 0.0}
            append_log(
                accelerator,
                log_path,
                {
                    "step": state["step"],
                    "epoch": state["epoch"],
                    "loss": logs["train/loss"],
                    "lr": logs["train/lr"],
                    "logit_scale": logs["train/logit_scale"],
                    "samples_per_s": window_samples_per_s,
                },
            )
            if args.log_losses:
                accelerator.print(f"step {state['step']} loss {logs['train/loss']:.8f}")
        if args.eval_steps and state["step"] % args.eval_steps == 0 and state["step"] < args.max_train_steps:
            run_eval(state["step"])
        if args.checkpointing_steps and state["step"] % args.checkpointing_steps == 0:
            save_checkpoint(accelerator, args, state)
    progress.close()

    # Final eval, model, results
    metrics = run_eval(state["step"])
    steps_run = state["step"] - start_step
    if "zero_shot_top1" not in metrics:
        logger.warning("no zero-shot classes (see --zeroshot_label_column): zero_shot_top1 is null")
    steady_steps = state["step"] - max(steady_from, start_step)
    results = {
        "zero_shot_top1": None,
        **metrics,
        "train_loss": mean_over_ranks(accelerator, state["loss_sum"]) / max(1, state["step"]),
        "train_samples_per_second": global_batch * steps_run / max(train_time, 1e-9),
        # steps after `steady_from` of this launch only; null when the run was too short to have any
        "train_samples_per_second_steady": global_batch * steady_steps / steady_time
        if steady_steps > 0
        else None,
        "steady_from_step": steady_from,
        "global_batch_size": global_batch,
        "num_processes": accelerator.num_processes,
        "distributed_type": accelerator.distributed_type.value,
        **peak_memory(accelerator),
        "train_steps": state["step"],
        "train_skipped_samples": sum_over_ranks(accelerator, state["num_skipped"]),
        "eval_samples": len(eval_set[0]),
    }
    if monitor:
        results["spike_monitor_warnings"] = len(monitor.warnings)
    accelerator.wait_for_everyone()
    # get_state_dict gathers sharded (FSDP/ZeRO-3) weights on every rank (a collective), but under ZeRO-3 only
    # the main process receives them (None elsewhere: the 2-GPU ZeRO-3 run crashed on it), and only it writes.
    gathered = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        # drop the wrapper's "clip." prefix; logit_scale back to CLIPModel's 0-d shape
        state_dict = export_state_dict({k.removeprefix("clip."): v for k, v in gathered.items()})
        # layer-scale folded into out_proj / fc2: the checkpoint is a plain CLIPModel with the same outputs
        state_dict = fold_layer_scale_state_dict(state_dict)
        clip.save_pretrained(args.output_dir, state_dict=state_dict, save_function=accelerator.save)
        processor.save_pretrained(args.output_dir)
        with open(os.path.join(args.output_dir, "all_results.json"), "w") as f:
            json.dump(results, f, indent=2)
        accelerator.print(json.dumps(results, indent=2))
        if monitor:
            monitor.save_plot(os.path.join(args.output_dir, "spike_monitor.png"))
        if args.push_to_hub:
            if args.layer_scale_init is not None:
                fold_layer_scale(clip)  # training is over: upload a plain CLIPModel
            if not hasattr(clip.logit_scale, "full_tensor"):  # (FSDP-sharded models are not pushed as is)
                clip.logit_scale = torch.nn.Parameter(clip.logit_scale.detach().reshape(()))
            push(clip, processor, args, sb_config, results)
    # the prepared model goes before the process group (training/teardown.py: else exit can hang under DDP)
    model_ref, model, monitor = weakref.ref(model), None, None
    end_training(accelerator, model_ref)
    return results


def append_log(accelerator, path: str, record: dict) -> None:
    """One JSON line per logging step / eval in <output_dir>/train_log.jsonl (main process; appends on resume)."""
    if accelerator.is_main_process:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def reset_log(path: str, keep_until: int) -> None:
    """Drop the lines of train_log.jsonl after step `keep_until` (a resumed run writes them again)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        kept = [line for line in f if line.strip() and json.loads(line)["step"] <= keep_until]
    with open(path, "w") as f:
        f.writelines(kept)


def peak_memory(accelerator) -> dict:
    """Peak CUDA memory of this launch, GiB: the largest rank's, and every rank's; empty without CUDA."""
    if accelerator.device.type != "cuda":
        return {}
    stats = torch.tensor(
        [
            torch.cuda.max_memory_allocated(accelerator.device),
            torch.cuda.max_memory_reserved(accelerator.device),
        ],
        dtype=torch.float64,
        device=accelerator.device,
    )
    per_rank = accelerator.gather(stats[None]).cpu() / 2**30  # (num_processes, 2)
    return {
        "peak_memory_allocated_gib": round(per_rank[:, 0].max().item(), 3),
        "peak_memory_reserved_gib": round(per_rank[:, 1].max().item(), 3),
        "peak_memory_allocated_gib_per_rank": [round(v, 3) for v in per_rank[:, 0].tolist()],
    }


def mean_over_ranks(accelerator, value: float) -> float:
    return accelerator.reduce(torch.tensor(float(value), device=accelerator.device), reduction="mean").item()


def sum_over_ranks(accelerator, value: int) -> int:
    return int(accelerator.reduce(torch.tensor(value, device=accelerator.device), reduction="sum").item())


def logit_scale_value(clip) -> float:
    scale = clip.logit_scale.detach()
    if hasattr(scale, "full_tensor"):  # FSDP2 keeps it as a (sharded) DTensor between forwards
        scale = scale.full_tensor()
    return scale.exp().item()


def push(model, processor, args, sb_config, metrics) -> None:
    from hf_switchback.hub import push_to_hub  # imported here: only --push_to_hub needs it

    url = push_to_hub(
        model,
        processor,
        args.hub_model_id,
        switchback_config=sb_config,
        training_args={k: v for k, v in vars(args).items() if k != "hub_token"},  # never publish the token
        metrics=metrics,
        private=args.hub_private,
        token=args.hub_token,
    )
    logger.info("pushed to %s", url)


def tracker_config(args) -> dict:
    # trackers accept scalars only; the Hub token stays out of the logs
    config = {k: v for k, v in vars(args).items() if k != "hub_token"}
    return {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in config.items()}


# ---------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------
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
        given = [
            f"--{k}"
            for k in (
                "weight_scaling",
                "memory_efficient",
                "precision",
                "grad_precision",
                "fuse_mlp",
                "target_modules",
                "exclude_modules",
                "backend",
                "min_tokens",
            )
            if getattr(args, k) is not None
        ]
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


def main():
    parser = build_parser()
    args = parser.parse_args()
    check_args(parser, args)
    training_function(args)


if __name__ == "__main__":
    main()
