"""Checkpoints that survive a kill, one run per output_dir, resume guards, the command-line checks around them."""

import json
import logging
import os
import warnings
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from torch import nn

from hf_switchback.training import checkpoints as ckpt
from hf_switchback.training import cli
from hf_switchback.training.runtime import process_group_kwargs


def _complete(root, step, fingerprint=None):
    path = root / "checkpoints" / f"step_{step}"
    path.mkdir(parents=True)
    (path / "optimizer.bin").write_bytes(b"x" * 10)
    (path / ckpt.MARKER).write_text(json.dumps({"step": step, "fingerprint": fingerprint}))
    return path


def test_latest_is_the_newest_complete_checkpoint(tmp_path):
    _complete(tmp_path, 2)
    killed = (
        tmp_path / "checkpoints" / "step_4"
    )  # a save killed before this change: 0-byte optimizer, no marker
    killed.mkdir()
    (killed / "optimizer.bin").write_bytes(b"")
    (tmp_path / "checkpoints" / ".step_6.tmp").mkdir()  # a save killed now
    args = SimpleNamespace(output_dir=str(tmp_path), resume_from_checkpoint="latest")
    assert ckpt.resolve_checkpoint(args) == str(tmp_path / "checkpoints" / "step_2")
    with pytest.raises(ValueError, match=r"is not a complete checkpoint \(no checkpoint.json\)"):
        ckpt.check_checkpoint(str(killed))


def _prepared(tmp_path):
    accelerator = Accelerator(cpu=True)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    args = SimpleNamespace(output_dir=str(tmp_path), checkpoints_total_limit=2)
    return accelerator, model, optimizer, args


def test_save_is_atomic_and_rotation_keeps_complete_ones(tmp_path, monkeypatch):
    accelerator, _, _, args = _prepared(tmp_path)
    for step in (1, 2, 3):
        path = ckpt.save_checkpoint(accelerator, args, {"step": step}, fingerprint={"world_size": 1})
        folder = tmp_path / "checkpoints" / f"step_{step}"
        marker = json.loads((folder / ckpt.MARKER).read_text())
        assert (marker["step"], marker["fingerprint"]) == (step, {"world_size": 1})
        # the marker lists every file beside it, with its size
        assert marker["files"] == {
            f.name: f.stat().st_size for f in folder.iterdir() if f.name != ckpt.MARKER
        }
    assert path.endswith("step_3")
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_2", "step_3"]
    assert json.loads((tmp_path / "checkpoints" / "step_3" / "train_state_rank0.json").read_text()) == {
        "step": 3
    }

    real_save_state = accelerator.save_state

    def killed_midway(folder):  # the process dies while accelerate writes the optimizer
        real_save_state(folder)
        open(os.path.join(folder, "optimizer.bin"), "w").close()
        raise KeyboardInterrupt("kill -9")

    monkeypatch.setattr(accelerator, "save_state", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(accelerator, args, {"step": 4})
    assert ckpt.checkpoint_dirs(str(tmp_path))[-1].endswith("step_3")  # not the broken step_4
    assert sorted(os.listdir(tmp_path / "checkpoints")) == [".step_4.tmp", "step_2", "step_3"]
    monkeypatch.setattr(accelerator, "save_state", real_save_state)
    ckpt.save_checkpoint(accelerator, args, {"step": 5})  # the next save clears the leftovers
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_3", "step_5"]


def test_saving_a_step_again_never_leaves_a_marked_incomplete_checkpoint(tmp_path, monkeypatch):
    """A resumed run saves step N again: the old step_N leaves in one rename, never by a deletion a kill could
    interrupt half-way (that left step_N with its marker but without its files)."""
    accelerator, _, _, args = _prepared(tmp_path)
    ckpt.save_checkpoint(accelerator, args, {"step": 2})
    ckpt.save_checkpoint(accelerator, args, {"step": 4})
    import shutil

    real_rmtree = shutil.rmtree

    def killed_while_deleting(path, *a, **kw):
        if os.path.basename(str(path)) == "step_4":  # an in-place delete of the old step_4 dies mid-way
            os.remove(os.path.join(path, "optimizer.bin"))
            raise RuntimeError("killed while deleting")
        return real_rmtree(path, *a, **kw)

    monkeypatch.setattr(ckpt.shutil, "rmtree", killed_while_deleting)
    path = ckpt.save_checkpoint(accelerator, args, {"step": 4, "again": True})
    ckpt.check_checkpoint(path)
    assert (tmp_path / "checkpoints" / "step_4" / "optimizer.bin").exists()
    assert json.loads((tmp_path / "checkpoints" / "step_4" / "train_state_rank0.json").read_text())["again"]


def test_reset_log_writes_aside_then_renames(tmp_path, monkeypatch):
    log = tmp_path / "train_log.jsonl"
    log.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)))
    replaced = []
    real_replace = os.replace
    monkeypatch.setattr(ckpt.os, "replace", lambda a, b: (replaced.append((a, b)), real_replace(a, b)))
    ckpt.reset_log(str(log), keep_until=2)
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2]
    assert replaced == [(f"{log}.tmp", str(log))]


def test_named_directory_must_be_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="is not a directory"):
        ckpt.check_checkpoint(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="is not a complete checkpoint"):
        ckpt.check_checkpoint(str(tmp_path))
    _complete(tmp_path, 3)
    with pytest.raises(ValueError, match=r"is an output_dir, not a checkpoint: pass --output_dir .* latest"):
        ckpt.check_checkpoint(str(tmp_path))
    ckpt.check_checkpoint(str(tmp_path / "checkpoints" / "step_3"))


def _args(tmp_path, **kw):
    parser = cli.build_parser()
    argv = ["--output_dir", str(tmp_path / "run")]
    for key, value in kw.items():
        argv += [f"--{key}"] + ([] if value is True else [str(value)])
    return parser, parser.parse_args(argv)


def _check_fails(parser, args, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.check_args(parser, args)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_output_dir_with_a_previous_run_is_refused(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    cli.check_args(*_args(tmp_path))  # empty: fine
    (tmp_path / "run" / "all_results.json").write_text("{}")
    err = _check_fails(*_args(tmp_path), capsys)
    assert "holds a previous run (all_results.json)" in err and "--overwrite_output_dir" in err
    cli.check_args(*_args(tmp_path, overwrite_output_dir=True))
    (tmp_path / "file").write_text("")
    parser, args = _args(tmp_path)
    args.output_dir = str(tmp_path / "file")
    assert "is a file, not a directory" in _check_fails(parser, args, capsys)
    err = _check_fails(*_args(tmp_path, resume_from_checkpoint=tmp_path), capsys)
    assert "is not a complete checkpoint" in err  # not accelerate's FileNotFoundError pytorch_model.bin


def test_latest_without_a_checkpoint_in_a_used_output_dir_is_refused_like_a_fresh_run(tmp_path, capsys):
    """`latest` finding no checkpoint starts from scratch: in an output_dir holding a run, that would write over
    its results and model, so it needs --overwrite_output_dir as a fresh run does."""
    cli.check_args(*_args(tmp_path, resume_from_checkpoint="latest"))  # missing: starts fresh
    (tmp_path / "run").mkdir()
    cli.check_args(*_args(tmp_path, resume_from_checkpoint="latest"))  # empty: starts fresh
    (tmp_path / "run" / "model.safetensors").write_text("old")
    (tmp_path / "run" / "all_results.json").write_text("{}")
    err = _check_fails(*_args(tmp_path, resume_from_checkpoint="latest"), capsys)
    assert "holds no complete checkpoint" in err and "(all_results.json, model.safetensors)" in err
    assert "--overwrite_output_dir" in err
    (tmp_path / "run" / "checkpoints" / ".step_4.tmp").mkdir(parents=True)  # a first save that was killed
    err = _check_fails(*_args(tmp_path, resume_from_checkpoint="latest"), capsys)
    assert "(checkpoints, all_results.json, model.safetensors)" in err
    cli.check_args(*_args(tmp_path, resume_from_checkpoint="latest", overwrite_output_dir=True))
    _complete(tmp_path / "run", 2)  # a checkpoint to continue: resuming is what was asked
    cli.check_args(*_args(tmp_path, resume_from_checkpoint="latest"))


def test_resuming_an_older_step_moves_the_newer_checkpoints_aside(tmp_path):
    """A rollback to step 2 while step_4 and step_6 exist: a later `latest` (after a crash) must continue the
    run resumed from step 2, not the abandoned one; nothing is deleted."""
    for step in (2, 4, 6):
        _complete(tmp_path, step)
    root = tmp_path / "checkpoints"
    assert ckpt.set_aside_newer_checkpoints(str(tmp_path), str(root / "step_6")) is None  # nothing newer
    target = ckpt.set_aside_newer_checkpoints(str(tmp_path), str(root / "step_2"))
    assert target == str(root / "abandoned_after_step_2")
    assert sorted(os.listdir(target)) == ["step_4", "step_6"]
    assert (root / "abandoned_after_step_2" / "step_6" / ckpt.MARKER).is_file()
    args = SimpleNamespace(output_dir=str(tmp_path), resume_from_checkpoint="latest")
    assert ckpt.resolve_checkpoint(args) == str(root / "step_2")
    # the resumed branch got to step 4, then the user rolls back to step 2 again: the earlier folder stays
    _complete(tmp_path, 4)
    assert ckpt.set_aside_newer_checkpoints(str(tmp_path), str(root / "step_2")).endswith("step_2.1")
    assert sorted(os.listdir(root)) == ["abandoned_after_step_2", "abandoned_after_step_2.1", "step_2"]
    # a checkpoint from elsewhere counts by its step
    other = _complete(tmp_path / "elsewhere", 1)
    ckpt.set_aside_newer_checkpoints(str(tmp_path), str(other))
    assert ckpt.checkpoint_dirs(str(tmp_path)) == [] and os.listdir(root / "abandoned_after_step_1") == [
        "step_2"
    ]


def test_overwrite_clears_the_previous_runs_checkpoints_log_and_results(tmp_path):
    _complete(tmp_path, 6)
    for name in ("train_log.jsonl", "all_results.json", "model.safetensors"):
        (tmp_path / name).write_text("old")
    ckpt.clear_previous_run(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]  # replaced only when the new one is written


def _fingerprint_args(**changes):
    args = SimpleNamespace(
        train_file=None, train_data_dir=None, train_shards="/d/*.tar", dataset_name=None, dataset_config_name=None,
        synthetic_train_samples=100, train_split="train", seed=0, batch_size=8, accum_freq=2, max_train_steps=6,
        optimizer="adamw", lr=1e-3, beta1=0.9, beta2=0.98, eps=1e-6, weight_decay=0.1, warmup_steps=None,
        min_lr_ratio=0.0, grad_clip_norm=1.0, patch_dropout=0.0, lock_image=False, lock_text=False,
        layer_scale_init=None,
    )  # fmt: skip
    return SimpleNamespace(**{**vars(args), **changes})


def _refusal(checkpoint, fingerprint, *fields) -> str:
    """check_fingerprint's error message, which must name every one of `fields`."""
    with pytest.raises(ValueError) as exc:
        ckpt.check_fingerprint(str(checkpoint), fingerprint)
    for field in fields:
        assert field in str(exc.value), field
    return str(exc.value)


def test_fingerprint_mismatch_names_the_changed_fields(tmp_path, caplog):
    args = _fingerprint_args()
    config = {"text_config": {"hidden_size": 32, "transformers_version": "5.0"}, "_name_or_path": "a", 0: "x"}
    saved = ckpt.run_fingerprint(args, config, world_size=2)
    assert saved["global_batch"] == 32 and saved["data"] == "train_shards=/d/*.tar"
    path = _complete(tmp_path, 2, saved)
    moved = {"text_config": {"hidden_size": 32, "transformers_version": "5.9"}, "_name_or_path": "b", 0: "x"}
    assert ckpt.check_fingerprint(str(path), ckpt.run_fingerprint(args, moved, world_size=2)) == []
    args.batch_size = 4
    now = ckpt.run_fingerprint(args, {"text_config": {"hidden_size": 64}}, world_size=1)
    message = _refusal(path, now, "model_config", "global_batch: 32 in the checkpoint, 8 now", "batch_size")
    assert "world_size: 2" in message
    assert "--allow_resume_mismatch" in message and "accum_freq" not in message
    with caplog.at_level(logging.WARNING):
        assert len(ckpt.check_fingerprint(str(path), now, allow_mismatch=True)) == 4
    assert "changed settings" in caplog.text


def test_fingerprint_covers_switchback_and_optimizer_and_old_checkpoints_still_resume(tmp_path):
    from hf_switchback import KernelOptions, SwitchBackConfig

    config = {"text_config": {"hidden_size": 32}}
    int8 = SwitchBackConfig(backend="torch")
    saved = ckpt.run_fingerprint(_fingerprint_args(), config, 1, int8)
    path = _complete(tmp_path, 2, saved)
    # other kernel options compute the same result: not a change
    same = SwitchBackConfig(backend="torch", kernel_options=KernelOptions(use_tma=True, fp8_gemm="triton"))
    assert ckpt.check_fingerprint(str(path), ckpt.run_fingerprint(_fingerprint_args(), config, 1, same)) == []
    fp8 = SwitchBackConfig(backend="torch", precision="fp8", weight_scaling="row")
    now = ckpt.run_fingerprint(
        _fingerprint_args(optimizer="stableadamw", lr=5e-4, warmup_steps=10), config, 1, fp8
    )
    message = _refusal(
        path,
        now,
        "switchback.precision: 'int8' in the checkpoint, 'fp8' now",
        "switchback.weight_scaling",
        "optimizer.name: 'adamw' in the checkpoint, 'stableadamw' now",
        "optimizer.lr",
        "schedule.warmup_steps",
    )
    assert "beta1" not in message and "grad_precision" not in message
    off = ckpt.run_fingerprint(_fingerprint_args(), config, 1, None)
    with pytest.raises(
        ValueError, match=r"switchback: \{.*'precision': 'int8'.*\} in the checkpoint, None now"
    ):
        ckpt.check_fingerprint(str(path), off)
    # a checkpoint written before these fields were recorded: unknown, not a mismatch
    old = {k: v for k, v in saved.items() if k not in ("switchback", "optimizer", "schedule")}
    assert ckpt.check_fingerprint(str(_complete(tmp_path / "old", 2, old)), now) == []
    partly = {**saved, "optimizer": {"name": "adamw"}}  # a nested field it lacks is unknown too
    assert ckpt.check_fingerprint(str(_complete(tmp_path / "partly", 2, partly)), ckpt.run_fingerprint(
        _fingerprint_args(lr=5e-4), config, 1, int8)) == []  # fmt: skip


def test_fingerprint_covers_precision_text_length_clipping_dropout_and_refuses_structure_always(tmp_path):
    config = {"text_config": {"hidden_size": 32}}
    saved = ckpt.run_fingerprint(_fingerprint_args(), config, 1, mixed_precision="no", max_text_length=16)
    path = _complete(tmp_path, 2, saved)
    changed = ckpt.run_fingerprint(
        _fingerprint_args(grad_clip_norm=0.0, patch_dropout=0.5),
        config,
        1,
        mixed_precision="bf16",
        max_text_length=8,
    )
    _refusal(
        path,
        changed,
        "mixed_precision: 'no' in the checkpoint, 'bf16' now",
        "max_text_length: 16 in the checkpoint, 8 now",
        "grad_clip_norm: 1.0 in the checkpoint, 0.0 now",
        "patch_dropout: 0.0 in the checkpoint, 0.5 now",
    )
    assert (
        len(ckpt.check_fingerprint(str(path), changed, allow_mismatch=True)) == 4
    )  # these may be overridden
    for flag, value in (("lock_image", True), ("lock_text", True), ("layer_scale_init", 0.0)):
        other = ckpt.run_fingerprint(
            _fingerprint_args(**{flag: value}), config, 1, mixed_precision="no", max_text_length=16
        )
        with pytest.raises(ValueError, match=rf"other trained parameters .*structure\.{flag}: "):
            ckpt.check_fingerprint(
                str(path), other, allow_mismatch=True
            )  # these never: the state cannot load


def test_a_marker_vouches_only_for_the_files_it_lists(tmp_path):
    """A kill during a deletion, or a truncation, leaves step_N with its marker but not its files: neither
    `latest` nor an explicit resume may take it. A marker that lists no files (older checkpoints) still counts."""
    old = _complete(tmp_path, 2)
    path = _complete(tmp_path, 4)
    (path / "model.safetensors").write_bytes(b"w" * 8)
    (path / ckpt.MARKER).write_text(
        json.dumps({"step": 4, "files": {"optimizer.bin": 10, "model.safetensors": 8}})
    )
    assert ckpt.checkpoint_dirs(str(tmp_path))[-1] == str(path)
    (path / "model.safetensors").unlink()
    assert ckpt.checkpoint_dirs(str(tmp_path)) == [str(old)]
    with pytest.raises(ValueError, match=r"is damaged: model.safetensors \(missing\)"):
        ckpt.check_checkpoint(str(path))
    (path / "model.safetensors").write_bytes(b"w" * 3)  # cut short
    assert ckpt.missing_files(str(path)) == ["model.safetensors (3 bytes, 8 written)"]


def test_rotation_renames_before_deleting_so_a_kill_leaves_no_damaged_checkpoint(tmp_path, monkeypatch):
    accelerator, _, _, args = _prepared(tmp_path)
    args.checkpoints_total_limit = 1
    ckpt.save_checkpoint(accelerator, args, {"step": 1})
    real_rmtree = ckpt.shutil.rmtree

    def killed_while_deleting(path, *a, **kw):
        if os.path.exists(os.path.join(path, "optimizer.bin")):  # dies half-way through an old checkpoint
            os.remove(os.path.join(path, "optimizer.bin"))
            raise KeyboardInterrupt("kill -9")
        return real_rmtree(path, *a, **kw)

    monkeypatch.setattr(ckpt.shutil, "rmtree", killed_while_deleting)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(accelerator, args, {"step": 2})
    monkeypatch.setattr(ckpt.shutil, "rmtree", real_rmtree)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == [".step_1.old.tmp", "step_2"]
    assert ckpt.checkpoint_dirs(str(tmp_path)) == [str(tmp_path / "checkpoints" / "step_2")]
    ckpt.save_checkpoint(accelerator, args, {"step": 3})  # the leftover goes with the next save
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_3"]


def test_a_full_disk_during_a_save_is_named_and_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    import errno

    accelerator, _, _, args = _prepared(tmp_path)
    good = ckpt.save_checkpoint(accelerator, args, {"step": 1})

    def full(folder):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(accelerator, "save_state", full)
    with pytest.raises(ckpt.DiskFullError, match=r"no space left on device while writing .*\.step_2\.tmp"):
        ckpt.save_checkpoint(accelerator, args, {"step": 2})
    assert ckpt.checkpoint_dirs(str(tmp_path)) == [good]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_1"]  # the partial save is gone
    # torch.save's own report of ENOSPC carries no errno: recognised when the file system is full
    torch_error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")
    statvfs = SimpleNamespace(f_bavail=0, f_frsize=4096)
    monkeypatch.setattr(ckpt.os, "statvfs", lambda path: statvfs)
    assert isinstance(ckpt.disk_full_error(torch_error, str(tmp_path)), ckpt.DiskFullError)
    statvfs.f_bavail = 1 << 20
    assert ckpt.disk_full_error(torch_error, str(tmp_path)) is None
    assert ckpt.disk_full_error(ValueError("other"), str(tmp_path)) is None
    # anywhere else (the log, the final model): the file the OSError names
    raw = OSError(errno.ENOSPC, "No space left on device", "/out/train_log.jsonl")
    assert "while writing /out/train_log.jsonl" in str(ckpt.disk_full_error(raw, "/out"))


def test_checkpoint_files_get_the_umasks_mode(tmp_path):
    accelerator, _, _, args = _prepared(tmp_path)
    old = os.umask(0o027)
    try:
        path = ckpt.save_checkpoint(accelerator, args, {"step": 1})
    finally:
        os.umask(old)
    modes = {name: os.stat(os.path.join(path, name)).st_mode & 0o777 for name in os.listdir(path)}
    assert modes.pop("model.safetensors") == 0o640  # safetensors alone would give 0600
    assert set(modes.values()) == {0o640}


def test_damaged_log_lines_are_dropped_on_resume(tmp_path):
    log = tmp_path / "train_log.jsonl"
    log.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')  # killed mid-line
    ckpt.reset_log(str(log), keep_until=2)
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2]


def test_hub_token_flag_is_deprecated_moved_to_the_environment_and_never_echoed(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "")  # recorded, so the token check_args puts there is gone after the test
    monkeypatch.delenv("HF_TOKEN")
    parser, args = _args(tmp_path, hub_token="hf_do_not_echo")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli.check_args(parser, args)
    assert [w.category for w in caught] == [FutureWarning]
    assert "deprecated" in str(caught[0].message) and "hf_do_not_echo" not in str(caught[0].message)
    assert args.hub_token is None and os.environ["HF_TOKEN"] == "hf_do_not_echo"


def test_push_to_hub_without_a_token_fails_before_training(tmp_path, monkeypatch, capsys):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no_token"))
    err = _check_fails(*_args(tmp_path, push_to_hub=True, hub_model_id="me/clip"), capsys)
    assert "--push_to_hub needs a Hub token: set HF_TOKEN" in err


def test_ddp_timeout_always_reaches_the_process_group():
    for minutes in (10, 30, 2.5):  # 10 min equals accelerate's NCCL default, which it would otherwise drop
        handler = process_group_kwargs(minutes)
        assert handler.to_kwargs() == {"timeout": handler.timeout}
        assert handler.timeout.total_seconds() == minutes * 60


def test_the_output_dir_lock_refuses_a_second_writer_naming_it_and_is_free_once_released(tmp_path):
    import socket

    from hf_switchback.training.lifecycle import OutputDirBusy, OutputDirLock

    with OutputDirLock(str(tmp_path / "run")):
        with pytest.raises(OutputDirBusy, match=rf"another training process \(pid {os.getpid()} on host "):
            OutputDirLock(str(tmp_path / "run")).acquire()
        assert socket.gethostname() in (tmp_path / "run" / ".train.lock").read_text()
    with OutputDirLock(str(tmp_path / "run")):  # released: free again, nothing to clean up
        pass
