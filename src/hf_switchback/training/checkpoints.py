"""Checkpoints of examples/train_clip.py: accelerate's save_state (model, optimizer, scheduler, RNG of every rank)
plus our data position, and the run's output directory (train_log.jsonl, all_results.json).

Layout: <output_dir>/checkpoints/step_<N>/ holds what `accelerator.save_state` writes, one
train_state_rank<R>.json per rank ({"step", "epoch", "batch_in_epoch", "loss_sum", "num_skipped", ...}) and
checkpoint.json ({"step", "fingerprint", "files": {relative path: size}}), the completion marker. A checkpoint
counts as complete only while every file its marker lists is there with its size.

A checkpoint is never seen half written: every rank writes into .step_<N>.tmp/, the main process writes the
marker last and renames the folder to step_<N>/ (a rename within a directory is atomic). A kill at any
moment leaves either the new complete checkpoint or a temporary folder that `latest` never picks and the next
save removes; the rotation deletes old checkpoints only after the new one is complete, each renamed to a
temporary name first, so a kill during the deletion leaves no step_<N> with missing files. `latest` is decided
on the main process and broadcast, so every rank resumes from the same step (OpenCLIP does the same).

The run fingerprint (model config, data, batch geometry, world size, schedule, SwitchBack config, optimizer,
mixed precision, text length, clipping, patch dropout, tower locks, layer-scale) is stored in the marker and
checked on resume: continuing a checkpoint under other settings silently trains something else. A change of
the trained parameters (locks, layer-scale) is refused even with --allow_resume_mismatch: that state cannot load.

Resuming from step N while <output_dir>/checkpoints holds complete checkpoints after N (a rollback, e.g. past a
loss spike) moves those into checkpoints/abandoned_after_step_<N>/ once step N has loaded (a failed load moves
nothing): nothing is deleted, and a later `latest` continues the resumed run, not the branch it left.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil

logger = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "step_"
MARKER = "checkpoint.json"
# What a finished or interrupted run leaves in its output_dir: a new run there would mix with it.
RUN_FILES = ("checkpoints", "all_results.json", "train_log.jsonl", "model.safetensors")
CLEARED_ON_OVERWRITE = ("checkpoints", "all_results.json", "train_log.jsonl", "spike_monitor.png")
# The fingerprint's group of fields that change which parameters exist or train.
STRUCTURE = "structure"


def checkpoint_dirs(output_dir: str) -> list[str]:
    """The complete step_<N> checkpoints under <output_dir>/checkpoints, oldest (smallest N) first."""
    root = os.path.join(output_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    names = [n for n in os.listdir(root) if re.fullmatch(rf"{CHECKPOINT_PREFIX}\d+", n)]
    names = [n for n in names if not missing_files(os.path.join(root, n))]
    return [os.path.join(root, n) for n in sorted(names, key=lambda n: int(n[len(CHECKPOINT_PREFIX) :]))]


def check_checkpoint(path: str) -> None:
    """Raise ValueError naming the problem when `path` is not a complete checkpoint of this script."""
    if not os.path.isdir(path):
        raise ValueError(f"--resume_from_checkpoint {path!r} is not a directory")
    if os.path.isfile(os.path.join(path, MARKER)):
        missing = missing_files(path)
        if missing:
            raise ValueError(
                f"--resume_from_checkpoint {path!r} is damaged: {', '.join(missing[:3])} (listed by its {MARKER}) "
                "missing or cut short, e.g. by a kill while it was deleted; resume another checkpoint"
            )
        return
    if checkpoint_dirs(path):
        raise ValueError(
            f"--resume_from_checkpoint {path!r} is an output_dir, not a checkpoint: pass "
            f"--output_dir {path} --resume_from_checkpoint latest"
        )
    raise ValueError(
        f"--resume_from_checkpoint {path!r} is not a complete checkpoint (no {MARKER}): an interrupted save, "
        "another tool's folder, or not a checkpoint. Checkpoints are <output_dir>/checkpoints/step_<N>; "
        "'latest' picks the newest complete one"
    )


def missing_files(path: str) -> list[str]:
    """What keeps `path` from being a complete checkpoint: the marker, or the files it lists ("name (why)").
    A marker written before files were listed vouches for the folder as it is."""
    try:
        with open(os.path.join(path, MARKER)) as f:
            listed = json.load(f).get("files") or {}
    except (OSError, ValueError, AttributeError):
        return [MARKER]
    missing = []
    for name, size in listed.items():
        try:
            actual = os.path.getsize(os.path.join(path, name))
        except OSError:
            missing.append(f"{name} (missing)")
            continue
        if actual != size:
            missing.append(f"{name} ({actual} bytes, {size} written)")
    return missing


def resolve_checkpoint(args, accelerator=None) -> str | None:
    """The checkpoint --resume_from_checkpoint names ('latest': the newest complete one in output_dir, decided
    on the main process and broadcast), or None. A named directory must be a complete checkpoint."""
    if not args.resume_from_checkpoint:
        return None
    if args.resume_from_checkpoint != "latest":
        check_checkpoint(args.resume_from_checkpoint)
        return args.resume_from_checkpoint
    choice = [None]
    if accelerator is None or accelerator.is_main_process:
        found = checkpoint_dirs(args.output_dir)
        choice = [found[-1] if found else None]
    if accelerator is not None and accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        broadcast_object_list(choice, from_process=0)
    return choice[0]


def save_checkpoint(accelerator, args, state: dict, fingerprint: dict | None = None) -> str:
    """save_state + every rank's train state + the marker, made visible at once; keeps the newest
    --checkpoints_total_limit complete checkpoints. Returns the checkpoint's path."""
    root = os.path.join(args.output_dir, "checkpoints")
    name = f"{CHECKPOINT_PREFIX}{state['step']}"
    final, tmp = os.path.join(root, name), os.path.join(root, f".{name}.tmp")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
        os.makedirs(tmp)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(tmp)
        # Every rank has its own data position (streams are per rank), so every rank writes its own file.
        _write_json(os.path.join(tmp, f"train_state_rank{accelerator.process_index}.json"), state)
    except Exception as err:
        full = disk_full_error(err, tmp)  # before the cleanup below frees space
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)  # give the space back: the results file still needs some
        if full is not None:
            raise full from err
        raise
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        files = _sync_tree(tmp)
        marker = {"step": state["step"], "fingerprint": fingerprint, "files": files}
        _write_json(os.path.join(tmp, MARKER), marker)
        if os.path.exists(final):  # the same step saved again (a resumed run): the new one replaces it
            # Moved aside in one rename, not deleted in place: a kill during a slow rmtree would leave step_N
            # with its marker but missing files, and `latest` would pick it. _rotate clears the .tmp later.
            os.replace(final, os.path.join(root, f".{name}.old.tmp"))
        os.replace(tmp, final)
        _sync_dir(root)
        _rotate(root, args.checkpoints_total_limit)
    accelerator.wait_for_everyone()
    return final


def _rotate(root: str, keep: int | None) -> None:
    """Drop complete checkpoints beyond the newest `keep`, and temporary folders of killed saves."""
    for entry in os.listdir(root):
        if entry.startswith(".") and entry.endswith(".tmp"):
            shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
    if keep:
        for old in checkpoint_dirs(os.path.dirname(root))[:-keep]:
            # renamed first: a kill during rmtree must leave a .tmp folder, not a step_N missing files
            doomed = os.path.join(root, f".{os.path.basename(old)}.old.tmp")
            shutil.rmtree(doomed, ignore_errors=True)
            os.replace(old, doomed)
            shutil.rmtree(doomed, ignore_errors=True)


def _write_json(path: str, data) -> None:
    with open(path, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())


def _sync_tree(path: str) -> dict[str, int]:
    """fsync every file under `path` (the marker must not reach the disk before the data it vouches for) and
    give it the umask's mode; returns {relative path: size} for the marker."""
    mode = umask_mode()
    files = {}
    for folder, _dirs, names in os.walk(path):
        for name in names:
            file = os.path.join(folder, name)
            with open(file, "rb") as f:
                os.fsync(f.fileno())
            os.chmod(file, mode)
            files[os.path.relpath(file, path)] = os.path.getsize(file)
    return files


def umask_mode() -> int:
    """The mode open() gives a new file under this process's umask. safetensors creates its files 0600,
    so a published model would be unreadable to the serving user while every other output is not."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


class DiskFullError(OSError):
    """A save ran out of space; the message names the path."""


def disk_full_error(err: BaseException, path: str) -> DiskFullError | None:
    """A DiskFullError naming `path` when `err` is a write that failed for lack of space there, else None.

    torch.save reports ENOSPC as "RuntimeError: [enforce fail at inline_container.cc] . unexpected pos ...",
    with no errno, so a RuntimeError counts when the file system has no space left."""
    if isinstance(err, DiskFullError):
        return err
    full = isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)
    if full and err.filename:
        path = err.filename
    if not full and isinstance(err, RuntimeError) and "unexpected pos" in str(err):
        try:
            stat = os.statvfs(path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path)))
            full = stat.f_bavail * stat.f_frsize < 1 << 20
        except OSError:
            full = False
    if not full:
        return None
    return DiskFullError(errno.ENOSPC, f"no space left on device while writing {path}: free space and resume")


def _sync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_train_state(path: str, rank: int) -> dict:
    file = os.path.join(path, f"train_state_rank{rank}.json")
    if not os.path.exists(file):
        raise FileNotFoundError(
            f"{file} is missing: was the checkpoint written with this number of processes?"
        )
    with open(file) as f:
        return json.load(f)


def checkpoint_step(path: str) -> int:
    """The step a complete checkpoint was written at (its marker's)."""
    with open(os.path.join(path, MARKER)) as f:
        return int(json.load(f)["step"])


def set_aside_newer_checkpoints(output_dir: str, checkpoint: str) -> str | None:
    """Move the complete checkpoints of output_dir after `checkpoint`'s step into
    checkpoints/abandoned_after_step_<N>/ (main process only): the run resumed from step N is a new branch, and a
    later `latest` must continue it, not the one it abandoned. Returns the folder, or None when none is newer."""
    step = checkpoint_step(checkpoint)
    newer = [
        path
        for path in checkpoint_dirs(output_dir)
        if checkpoint_step(path) > step and not os.path.samefile(path, checkpoint)
    ]
    if not newer:
        return None
    root = os.path.join(output_dir, "checkpoints")
    target = base = os.path.join(root, f"abandoned_after_step_{step}")
    for n in range(1, 1000):  # an earlier rollback to the same step keeps its folder
        if not os.path.exists(target):
            break
        target = f"{base}.{n}"
    os.makedirs(target)
    for path in newer:  # renames within one file system: nothing is copied or deleted
        os.replace(path, os.path.join(target, os.path.basename(path)))
    _sync_dir(root)
    logger.warning(
        "resuming from step %d: moved the newer checkpoints (%s) to %s, so that `latest` continues this run",
        step,
        ", ".join(os.path.basename(p) for p in newer),
        target,
    )
    return target


def resume_from(accelerator, args, checkpoint: str, fingerprint: dict) -> dict:
    """Check the fingerprint, load accelerate's state, then set newer checkpoints aside; return this rank's
    train state ({"step", "epoch", ...}). A load that fails leaves output_dir's checkpoints where they were."""
    accelerator.print(f"resuming from {checkpoint}")
    check_fingerprint(checkpoint, fingerprint, args.allow_resume_mismatch)
    accelerator.load_state(checkpoint)
    state = load_train_state(checkpoint, accelerator.process_index)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        set_aside_newer_checkpoints(args.output_dir, checkpoint)
    accelerator.wait_for_everyone()
    return state


# ---------------------------------------------------------------------------------------------------------------
# Run fingerprint: what must not change between a checkpoint and the run that resumes it.
# ---------------------------------------------------------------------------------------------------------------
def config_digest(config: dict) -> str:
    """sha256 (16 hex) of a model config dict, without the keys that change with no effect on the model."""

    def clean(value):
        if isinstance(value, dict):
            return {
                str(k): clean(v)
                for k, v in value.items()
                if not str(k).startswith("_") and k != "transformers_version"
            }
        return value

    text = json.dumps(clean(config), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def data_description(args) -> str:
    """The training data as the flags name it (synthetic: its size), for the fingerprint."""
    flags = ("train_file", "train_data_dir", "train_shards", "dataset_name", "dataset_config_name")
    given = [f"{k}={getattr(args, k)}" for k in flags if getattr(args, k, None)]
    limit = getattr(args, "max_train_samples", None)  # set only when given: older checkpoints still match
    if not given:
        return f"synthetic({min(args.synthetic_train_samples, limit or args.synthetic_train_samples)})"
    given += [f"split={args.train_split}"] * bool(args.dataset_name or args.train_data_dir)
    return ", ".join(given + [f"max_train_samples={limit}"] * bool(limit))


def run_fingerprint(
    args,
    model_config: dict,
    world_size: int,
    switchback=None,
    *,
    mixed_precision: str | None = None,
    max_text_length: int | None = None,
) -> dict:
    """The settings a checkpoint is only valid under; args.max_train_steps must be resolved already.
    `switchback`: the run's SwitchBackConfig (None: --switchback off); its kernel options are left out (they
    compute the same result). `mixed_precision`, `max_text_length`: what the run uses (accelerate's resolved
    autocast dtype, the text length after the model's cap)."""
    return {
        # what changes the set of trained parameters: the optimizer state would not fit (never overridable)
        STRUCTURE: {
            "lock_image": args.lock_image,
            "lock_text": args.lock_text,
            "layer_scale_init": args.layer_scale_init,
        },
        "mixed_precision": mixed_precision,
        "max_text_length": max_text_length,
        "grad_clip_norm": args.grad_clip_norm,
        "patch_dropout": args.patch_dropout,
        "model_config": config_digest(model_config),
        "data": data_description(args),
        "seed": args.seed,
        "global_batch": args.batch_size * args.accum_freq * world_size,
        "batch_size": args.batch_size,
        "accum_freq": args.accum_freq,
        "world_size": world_size,
        "max_train_steps": args.max_train_steps,
        "switchback": switchback.to_dict() if switchback is not None else None,
        # the optimizer and scheduler states resume as saved (lr and betas included): other flags would not apply
        "optimizer": {
            "name": args.optimizer,
            "lr": args.lr,
            "beta1": args.beta1,
            "beta2": args.beta2,
            "eps": args.eps,
            "weight_decay": args.weight_decay,
        },
        "schedule": {"warmup_steps": args.warmup_steps, "min_lr_ratio": args.min_lr_ratio},
    }


def _differences(saved: dict, current: dict, prefix: str = "") -> list[str]:
    """ "key: old in the checkpoint, new now" per changed field, nested dicts by dotted key. A key the checkpoint
    lacks (written before it was recorded) is unknown, not a change."""
    changed = []
    for key, value in current.items():
        if key not in saved:
            continue
        if isinstance(value, dict) and isinstance(saved[key], dict):
            changed += _differences(saved[key], value, f"{prefix}{key}.")
        elif saved[key] != value:
            changed.append(f"{prefix}{key}: {saved[key]!r} in the checkpoint, {value!r} now")
    return changed


def check_fingerprint(checkpoint: str, current: dict, allow_mismatch: bool = False) -> list[str]:
    """Compare the checkpoint's fingerprint with this run's; raise ValueError naming every changed field
    unless `allow_mismatch` (then warn). Returns the differences."""
    with open(os.path.join(checkpoint, MARKER)) as f:
        saved = json.load(f).get("fingerprint") or {}
    # through JSON as the checkpoint was: tuples become lists, int keys strings
    changed = _differences(saved, json.loads(json.dumps(current)))
    structural = [c for c in changed if c.startswith(f"{STRUCTURE}.")]
    if structural:
        raise ValueError(
            f"{checkpoint} holds other trained parameters than this run ({'; '.join(structural)}): its weights "
            "and optimizer state cannot load. Use the checkpoint's settings, or another --output_dir"
        )
    if changed and not allow_mismatch:
        raise ValueError(
            f"{checkpoint} was written by a run with other settings ({'; '.join(changed)}): resuming it would not "
            "continue that run. Use the original settings, another --output_dir, or --allow_resume_mismatch to "
            "resume anyway"
        )
    if changed:
        logger.warning("resuming %s with changed settings (--allow_resume_mismatch): %s", checkpoint, changed)
    return changed


# ---------------------------------------------------------------------------------------------------------------
# The output directory: one run per directory, results and log
# ---------------------------------------------------------------------------------------------------------------
def check_output_dir(output_dir: str, resume: str | None, overwrite: bool) -> None:
    """Refuse an output_dir that is a file, or that is not empty (Trainer's rule), unless resuming or overwriting.

    `resume` is --resume_from_checkpoint: "latest" with no complete checkpoint to pick starts from scratch,
    so it is held to the rule of a fresh run (it would write over the previous run's results and model). Resuming
    is suggested only where there is a checkpoint to resume. Hidden entries (a lock file) do not count."""
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ValueError(f"--output_dir {output_dir!r} is a file, not a directory")
    resuming = bool(resume) and (resume != "latest" or bool(checkpoint_dirs(output_dir)))
    if resuming or overwrite or not os.path.isdir(output_dir):
        return
    entries = sorted(name for name in os.listdir(output_dir) if not name.startswith("."))
    if not entries:
        return
    found = [name for name in RUN_FILES if name in entries]
    if not found:
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise ValueError(
            f"--output_dir {output_dir!r} is not empty ({shown}) and holds no run of this script: pass "
            "--overwrite_output_dir to train into it anyway (files of the same name are replaced), or another "
            "--output_dir"
        )
    if resume == "latest":
        raise ValueError(
            f"--resume_from_checkpoint latest: {os.path.join(output_dir, 'checkpoints')} holds no complete "
            f"checkpoint, but --output_dir {output_dir!r} holds a previous run ({', '.join(found)}) that "
            "starting from scratch would overwrite: pass --overwrite_output_dir to replace it, or another "
            "--output_dir"
        )
    resume_hint = "--resume_from_checkpoint latest to continue it, " if checkpoint_dirs(output_dir) else ""
    raise ValueError(
        f"--output_dir {output_dir!r} holds a previous run ({', '.join(found)}): pass {resume_hint}"
        "--overwrite_output_dir to replace it, or another --output_dir"
    )


def clear_previous_run(output_dir: str) -> None:
    """--overwrite_output_dir: remove the previous run's checkpoints, log and results (main process only), so
    that neither `latest` nor a reader of the results can mistake them for this run's. The old model files
    stay until the new ones replace them."""
    for name in CLEARED_ON_OVERWRITE:
        path = os.path.join(output_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)


def publish_mode(output_dir: str) -> None:
    """Give the final model's safetensors files the umask's mode (safetensors writes them 0600)."""
    mode = umask_mode()
    for name in os.listdir(output_dir):
        if name.endswith(".safetensors"):
            os.chmod(os.path.join(output_dir, name), mode)


def write_results(output_dir: str, results: dict) -> None:
    """all_results.json, replaced at once (a reader never sees half a file)."""
    path = os.path.join(output_dir, "all_results.json")
    with open(path + ".tmp", "w") as f:
        json.dump(results, f, indent=2)
    os.replace(path + ".tmp", path)


def append_log(accelerator, path: str, record: dict) -> None:
    """One JSON line per logging step / eval in <output_dir>/train_log.jsonl (main process; appends on resume)."""
    if accelerator.is_main_process:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def reset_log(path: str, keep_until: int) -> None:
    """Drop the lines of train_log.jsonl after step `keep_until` (a resumed run writes them again), and lines
    that do not parse (a kill while a line was written leaves half of one)."""
    if not os.path.exists(path):
        return
    kept, damaged = [], 0
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
                step = int(record["step"])
            except (ValueError, KeyError, TypeError):
                damaged += line.strip() != ""
                continue
            if step <= keep_until:
                kept.append(json.dumps(record) + "\n")
    if damaged:
        logger.warning("%s: dropped %d damaged line(s)", path, damaged)
    tmp = f"{path}.tmp"  # a kill mid-write must not truncate the log: write aside, then rename
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)
