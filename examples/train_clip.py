"""Contrastive CLIP (and SigLIP) training with SwitchBack int8/fp8 linears, on Accelerate.

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

    # SigLIP: a SiglipConfig (or a siglip checkpoint) trains with the sigmoid loss, exchanged across ranks:
    accelerate launch examples/train_clip.py --model_config examples/configs/siglip-tiny.json
    accelerate launch examples/train_clip.py --model_name_or_path google/siglip-base-patch16-224 \
        --train_file captions.csv --siglip_dist_impl bidir

    # The synthetic set as webdataset shards, then trained on in streaming mode by 2 CPU processes (gloo):
    python -m hf_switchback.training.synthetic --output_dir shards/ --num_samples 20000
    accelerate launch --config_file accelerate_configs/cpu.yaml examples/train_clip.py \
        --train_shards shards/ --max_train_steps 300 --allow_synthetic_tokenizer

    # Resume exactly where the last checkpoint left off (same step, same data position):
    accelerate launch examples/train_clip.py --output_dir runs/b32 --resume_from_checkpoint latest

    # The paper's stability recipe: StableAdamW, zero-init layer-scale (folded away in the saved model), and
    # the loss-spike monitor (per-layer RMS of g^2/v logged, warnings, <output_dir>/spike_monitor.png):
    accelerate launch examples/train_clip.py --optimizer stableadamw --layer_scale_init 0 --spike_monitor

Batch sizes: --batch_size is per device and per micro-batch; one optimizer step sees
batch_size x accum_freq x num_processes image-text pairs, all of them negatives for each other.
Flag names from transformers' run_clip.py that mean the same here work too (--per_device_train_batch_size,
--learning_rate, --max_steps, --bf16, --config_name, --data_dir, ...: `--help` shows each as its flag's second
name); --do_train, --do_eval, --remove_unused_columns are accepted and change nothing. A single .json or .yaml
argument is read as a file of flags (HfArgumentParser; keys are the field names: lr, batch_size, ...).
Your own data needs a tokenizer (--model_name_or_path or --tokenizer_name_or_path).
"""

from __future__ import annotations

import logging
import os
import sys
import time
import weakref
from functools import partial

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed

from hf_switchback import apply_switchback, precision_summary
from hf_switchback import metrics as metric_modules
from hf_switchback.compile_cache import load_compile_artifacts
from hf_switchback.training import data as data_lib
from hf_switchback.training.checkpoints import (
    append_log,
    clear_previous_run,
    disk_full_error,
    publish_mode,
    reset_log,
    resolve_checkpoint,
    resume_from,
    run_fingerprint,
    save_checkpoint,
    write_results,
)
from hf_switchback.training.cli import build_parser, check_args, parse_args
from hf_switchback.training.evaluation import evaluate
from hf_switchback.training.guard import (
    NonFiniteError,
    NonFiniteGuard,
    check_finite_before_save,
    check_mixed_precision,
    guarded_step,
)
from hf_switchback.training.layer_scale import add_layer_scale, fold_layer_scale, fold_layer_scale_state_dict
from hf_switchback.training.lifecycle import (
    OutputDirBusy,
    OutputDirLock,
    console,
    end_training,
    format_config,
    logit_bias_value,
    logit_scale_value,
    mean_over_ranks,
    peak_memory,
    progress_bar,
    push_model,
    save_final_config,
    setup_logging,
    sum_over_ranks,
    summary_line,
    switchback_results,
    tracker_config,
)
from hf_switchback.training.losses import ClipLoss
from hf_switchback.training.model_setup import (
    add_patch_dropout,
    load_model_and_processor,
    lock_towers,
    switchback_config,
)
from hf_switchback.training.optim import (
    cosine_with_warmup,
    create_optimizer,
    param_groups,
    unstable_parameters,
)
from hf_switchback.training.runtime import (
    check_deepspeed,
    compile_artifacts_path,
    dynamo_plugin,
    process_group_kwargs,
    write_compile_artifacts,
)
from hf_switchback.training.siglip_loss import SigLipLoss
from hf_switchback.training.sources import load_eval_set, load_train_source, micro_batch_stream
from hf_switchback.training.spike_monitor import SpikeMonitor, default_group_name
from hf_switchback.training.step import (
    CLIPForContrastive,
    clamp_logit_scale,
    contrastive_backward,
    export_state_dict,
    logit_scale_to_1d,
)

logger = logging.getLogger("train_clip")


def training_function(args):
    """Train as `args` say; the main process holds the output directory's lock throughout (lifecycle.py)."""
    if int(os.environ.get("RANK", "0")) != 0:
        return _train(args)
    with OutputDirLock(args.output_dir):
        return _train(args)


def _train(args):
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
        kwargs_handlers=[process_group_kwargs(args.ddp_timeout)],
    )
    setup_logging(accelerator.is_main_process)  # through tqdm.write: log lines never land on the progress bar
    if (
        accelerator.distributed_type == DistributedType.MULTI_CPU
        and os.environ.get("ACCELERATE_USE_FSDP") == "true"
    ):
        # accelerate 1.x turns FSDP on only for GPU-like devices; a CPU launch of fsdp2.yaml is DDP over gloo
        logger.warning("FSDP config on the CPU: accelerate runs this as plain DDP (gloo), not FSDP2")
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        check_deepspeed(accelerator, args)  # before anything is loaded: it can refuse the run
    check_mixed_precision(accelerator)
    set_seed(args.seed)
    os.makedirs(args.output_dir, exist_ok=True)
    accelerator.print(f"output directory: {os.path.abspath(args.output_dir)}")
    checkpoint = resolve_checkpoint(args, accelerator)  # None: a fresh run (`latest` may have found none)
    if args.overwrite_output_dir and not checkpoint and accelerator.is_main_process:
        clear_previous_run(args.output_dir)  # its checkpoints must not become this run's `latest`
    accelerator.wait_for_everyone()
    # The previous run's compiled graphs and kernels, into this machine's torch.compile caches before anything
    # compiles (every rank: other nodes have caches of their own)
    compile_artifacts = compile_artifacts_path(args)
    if compile_artifacts:
        load_compile_artifacts(compile_artifacts)

    # Model + SwitchBack
    clip, processor = load_model_and_processor(args)
    tokenizer, image_processor = processor.tokenizer, processor.image_processor
    siglip = clip.config.model_type == "siglip"  # sigmoid loss, (1,)-shaped logit_scale and logit_bias
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
        data_lib.train_transform_for(image_processor, image_size, scale=(args.crop_scale_min, 1.0)),
        seed=args.seed,
        rank=accelerator.process_index,
        world_size=accelerator.num_processes,
        shuffle_buffer=args.shuffle_buffer,
        max_image_pixels=args.max_image_pixels or None,  # the eval data gets the same cap (sources.py)
    )
    collate = data_lib.Collate(tokenizer, max_text_length)
    eval_set, classnames, templates = load_eval_set(args, train_source)

    global_batch = args.batch_size * args.accum_freq * accelerator.num_processes
    if args.max_train_steps is None:
        per_rank = len(train_source.dataset) // accelerator.num_processes
        steps_per_epoch = max(1, per_rank // (args.batch_size * args.accum_freq))
        args.max_train_steps = args.num_train_epochs * steps_per_epoch
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, args.max_train_steps // 20)
    fingerprint = run_fingerprint(
        args,
        clip.config.to_dict(),
        accelerator.num_processes,
        sb_config,
        mixed_precision=accelerator.mixed_precision,
        max_text_length=max_text_length,
    )

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
    if siglip:
        loss_fn = SigLipLoss(dist_impl=args.siglip_dist_impl)
    else:
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
    guard = NonFiniteGuard(args.max_nonfinite_steps)
    if checkpoint:  # newer checkpoints of output_dir are moved aside: `latest` must continue this branch
        state = resume_from(accelerator, args, checkpoint, fingerprint)
        guard.load_state_dict(state)  # skipped-step count of the launches before
    elif args.resume_from_checkpoint:
        accelerator.print(f"no checkpoint found in {args.output_dir}/checkpoints: starting from scratch")

    if report_to:
        accelerator.init_trackers(args.project_name, config=tracker_config(args))
    accelerator.print(
        f"training {args.max_train_steps} steps, global batch {global_batch} "
        f"({args.batch_size} x accum {args.accum_freq} x {accelerator.num_processes} processes, "
        f"{accelerator.distributed_type.value} on {accelerator.device.type}), "
        + (f"SwitchBack {sb_config.variant}:\n{format_config(sb_config)}" if sb_config else "SwitchBack: off")
    )
    if sb_config:
        accelerator.print(precision_summary(clip, accelerator.device))

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
            batch_size=args.eval_batch_size,
        )
        accelerator.log({f"eval/{k}": v for k, v in metrics.items()}, step=step)
        console(accelerator, f"step {step}: " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(metrics.items())))
        append_log(accelerator, log_path, {"step": step, **metrics})
        return metrics

    batches = micro_batch_stream(
        stream, collate, args.batch_size, args.num_workers, state["epoch"], state["batch_in_epoch"]
    )
    model.train()
    progress = progress_bar(
        args.max_train_steps, state["step"], args.logging_steps, disable=not accelerator.is_local_main_process
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
        # A NaN/inf loss or gradient norm: no update at all (training/guard.py); the step is not counted. The
        # spike monitor reads the step's gradients and new second moments: after step(), before zero_grad().
        read_monitor = partial(monitor.update, state["step"] + 1, loss) if monitor else None
        applied, grad_norm, spike_metrics = guarded_step(
            accelerator,
            model,
            optimizer,
            scheduler,
            loss,
            guard,
            state["step"] + 1,
            args.grad_clip_norm,
            read_monitor,
        )
        if not applied:
            continue
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
        if state["step"] == start_step + 1:  # everything the training step compiles is compiled by now
            write_compile_artifacts(accelerator, compile_artifacts)
        samples_per_s = global_batch * (state["step"] - start_step) / max(train_time, 1e-9)
        progress.update(1)
        progress.set_postfix(loss=f"{loss_value:.3f}", samples_per_s=f"{samples_per_s:.0f}")
        if state["step"] % args.logging_steps == 0 or state["step"] == args.max_train_steps:
            logs = {
                "train/loss": mean_over_ranks(accelerator, loss_value),
                "train/lr": scheduler.get_last_lr()[0],
                "train/logit_scale": logit_scale_value(clip),
                **({"train/logit_bias": logit_bias_value(clip)} if siglip else {}),
                "train/samples_per_second": samples_per_s,
                "train/epoch": state["epoch"],
                "train/skipped_samples": sum_over_ranks(accelerator, state["num_skipped"]),
            }
            logs["train/grad_norm"] = grad_norm
            logs["train/nonfinite_skipped_steps"] = guard.skipped
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
                console(accelerator, f"step {state['step']} loss {logs['train/loss']:.8f}")
        if args.eval_steps and state["step"] % args.eval_steps == 0 and state["step"] < args.max_train_steps:
            run_eval(state["step"])
        if args.checkpointing_steps and state["step"] % args.checkpointing_steps == 0:
            check_finite_before_save(model, "a checkpoint", accelerator)  # never rotate good ones out for it
            save_checkpoint(accelerator, args, {**state, **guard.state_dict()}, fingerprint)
    progress.close()

    # Final eval, model, results
    metrics = run_eval(state["step"])
    steps_run = state["step"] - start_step
    if "zero_shot_top1" not in metrics:
        logger.warning("no zero-shot classes (see --zeroshot_label_column): zero_shot_top1 is null")
    steady_steps = state["step"] - max(steady_from, start_step)
    results = {
        "status": "completed",
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
        "nonfinite_skipped_steps": guard.skipped,  # every launch of the run (kept in checkpoints)
        "last_nonfinite_step": guard.last_skipped_step,
        "eval_samples": len(eval_set[0]),
        # what ran: the model type and its loss, autocast dtype ("no", "bf16", "fp16") and the SwitchBack config
        # (null: --switchback off)
        "model_type": clip.config.model_type,
        "loss_fn": f"siglip/{args.siglip_dist_impl}" if siglip else "clip",
        "mixed_precision": accelerator.mixed_precision,
        "switchback": switchback_results(sb_config),  # with the kernel options that ran
    }
    if monitor:
        results["spike_monitor_warnings"] = len(monitor.warnings)
    accelerator.wait_for_everyone()
    check_finite_before_save(model, "the final model", accelerator)
    # get_state_dict gathers sharded (FSDP/ZeRO-3) weights on every rank (a collective), but under ZeRO-3 only
    # the main process receives them (None elsewhere: the 2-GPU ZeRO-3 run crashed on it), and only it writes.
    gathered = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        # drop the wrapper's "clip." prefix; logit_scale back to CLIPModel's 0-d shape (SigLIP's stays (1,))
        state_dict = {k.removeprefix("clip."): v for k, v in gathered.items()}
        state_dict = export_state_dict(state_dict, scalar_logit_scale=not siglip)
        # layer-scale folded into out_proj / fc2: the checkpoint is a plain CLIPModel with the same outputs
        state_dict = fold_layer_scale_state_dict(state_dict)
        # a full disk here is reported by main() (disk_full_error), with status failed
        clip.save_pretrained(args.output_dir, state_dict=state_dict, save_function=accelerator.save)
        save_final_config(args.output_dir, args, sb_config)
        processor.save_pretrained(args.output_dir)
        publish_mode(args.output_dir)
        write_results(args.output_dir, results)
        # the final eval alone, as evaluate.save writes it (examples/evaluate_clip.py writes the same for any model)
        metric_modules.save(os.path.join(args.output_dir, "eval_results.json"), metrics)
        accelerator.print(summary_line(results))
        saved = ["the model, processor, all_results.json, eval_results.json, train_log.jsonl"]
        if monitor:
            monitor.save_plot(os.path.join(args.output_dir, "spike_monitor.png"))
            saved.append("spike_monitor.png")
        if args.checkpointing_steps:
            saved.append("checkpoints/")
        accelerator.print(f"saved {', '.join(saved)} in {os.path.abspath(args.output_dir)}")
        if args.push_to_hub:
            if args.layer_scale_init is not None:
                fold_layer_scale(clip)  # training is over: upload a plain CLIPModel
            if not siglip and not hasattr(
                clip.logit_scale, "full_tensor"
            ):  # (FSDP-sharded: not pushed as is)
                clip.logit_scale = torch.nn.Parameter(clip.logit_scale.detach().reshape(()))
            push_model(clip, processor, args, sb_config, results)
    # the prepared model goes before the process group (training/lifecycle.py: else exit can hang under DDP)
    model_ref, model, monitor = weakref.ref(model), None, None
    end_training(accelerator, model_ref)
    return results


def main():
    parser = build_parser()
    args = parse_args(parser, sys.argv[1:])
    check_args(parser, args)  # every refusal happens here: nothing is loaded or created before it
    try:
        training_function(args)
    except OutputDirBusy as err:  # the other process's results are not ours to write
        sys.exit(f"training refused: {err}")
    except Exception as err:
        # NonFiniteError: every rank at the same step (the decision is reduced); a full disk: wherever it struck
        failure = err if isinstance(err, NonFiniteError) else disk_full_error(err, args.output_dir)
        if failure is None:
            raise
        if int(os.environ.get("RANK", "0")) == 0:
            try:  # the model files of an earlier run are kept
                write_results(args.output_dir, {"status": "failed", "error": str(failure)})
            except OSError as write_err:  # a disk still full
                logger.error("could not write all_results.json: %s", write_err)
        sys.exit(f"training failed: {failure}")


if __name__ == "__main__":
    main()
