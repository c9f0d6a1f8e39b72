"""The pieces of examples/train_clip.py that live in hf_switchback.training: checkpoints, data and model setup
from the flags, rank reductions, reporting, the Accelerate runtime checks."""

import json
import math
import os
import types

import pytest
import torch
from train_helpers import tiny_model

from hf_switchback import SwitchBackConfig
from hf_switchback.training import checkpoints, lifecycle, model_setup, runtime, sources
from hf_switchback.training.cli import build_parser


class FakeAccelerator:
    """Single process, rank `process_index`; records save_state paths."""

    def __init__(self, process_index: int = 0):
        self.process_index = process_index
        self.is_main_process = process_index == 0
        self.device = torch.device("cpu")
        self.saved = []

    def save_state(self, path):
        os.makedirs(path, exist_ok=True)
        self.saved.append(path)

    def wait_for_everyone(self):
        pass


def test_checkpoint_dirs_sort_by_step_number_and_ignore_other_names(tmp_path):
    for name in ("step_10", "step_9", "step_100", "step_x", "notes", "step_200"):
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
        if name != "step_200":  # no completion marker: an interrupted save, never listed
            (tmp_path / "checkpoints" / name / checkpoints.MARKER).write_text("{}")
    found = checkpoints.checkpoint_dirs(str(tmp_path))
    assert [p.rsplit("/", 1)[1] for p in found] == ["step_9", "step_10", "step_100"]
    assert checkpoints.checkpoint_dirs(str(tmp_path / "nothing")) == []
    args = types.SimpleNamespace(output_dir=str(tmp_path), resume_from_checkpoint="latest")
    assert checkpoints.resolve_checkpoint(args).endswith("step_100")
    args.resume_from_checkpoint = None
    assert checkpoints.resolve_checkpoint(args) is None


def test_save_checkpoint_writes_the_train_state_and_keeps_the_newest(tmp_path):
    args = types.SimpleNamespace(output_dir=str(tmp_path), checkpoints_total_limit=2)
    accelerator = FakeAccelerator()
    for step in (2, 4, 6):
        checkpoints.save_checkpoint(accelerator, args, {"step": step, "epoch": 0})
    kept = checkpoints.checkpoint_dirs(str(tmp_path))
    assert [p.rsplit("/", 1)[1] for p in kept] == ["step_4", "step_6"]
    assert checkpoints.load_train_state(kept[-1], 0) == {"step": 6, "epoch": 0}
    with pytest.raises(FileNotFoundError, match="number of processes"):
        checkpoints.load_train_state(kept[-1], 1)


def test_train_log_is_cut_back_to_the_resumed_step(tmp_path):
    path = str(tmp_path / "train_log.jsonl")
    for step in (10, 20, 30):
        checkpoints.append_log(FakeAccelerator(), path, {"step": step})
    checkpoints.append_log(FakeAccelerator(process_index=1), path, {"step": 99})  # not the main process
    checkpoints.reset_log(path, keep_until=20)
    with open(path) as f:
        assert [json.loads(line)["step"] for line in f] == [10, 20]
    checkpoints.reset_log(str(tmp_path / "absent.jsonl"), keep_until=0)  # nothing to cut: no error


def test_micro_batch_stream_resumes_mid_epoch_and_rolls_over(monkeypatch):
    epochs = []

    def fake_loader(stream, collate, batch_size, epoch, num_workers):
        epochs.append(epoch)
        return iter([f"e{epoch}b{i}" for i in range(3)])

    monkeypatch.setattr(sources.data_lib, "epoch_loader", fake_loader)
    stream = sources.micro_batch_stream(None, None, batch_size=4, num_workers=0, epoch=2, skip=2)
    assert [next(stream) for _ in range(3)] == [(2, 3, "e2b2"), (3, 1, "e3b0"), (3, 2, "e3b1")]
    assert epochs == [2, 3]

    monkeypatch.setattr(sources.data_lib, "epoch_loader", lambda *a, **k: iter([]))
    with pytest.raises(RuntimeError, match="no full batch of 4"):
        next(sources.micro_batch_stream(None, None, batch_size=4, num_workers=0, epoch=0, skip=0))


def test_real_data_flags_switch_off_the_synthetic_set():
    parser = build_parser()
    assert not sources.has_real_data(parser.parse_args([]))
    for flag in ("--train_file", "--train_data_dir", "--train_shards", "--dataset_name"):
        assert sources.has_real_data(parser.parse_args([flag, "x"])), flag


def test_switchback_config_keeps_library_defaults_for_unset_flags():
    parser = build_parser()
    assert model_setup.switchback_config(parser.parse_args([])) == SwitchBackConfig()
    config = model_setup.switchback_config(
        parser.parse_args(["--weight_scaling", "row", "--no-memory_efficient", "--min_tokens", "0"])
    )
    assert config == SwitchBackConfig(weight_scaling="row", memory_efficient=False, min_tokens=0)
    # the producers that quantize, on by default, switched off from the command line
    config = model_setup.switchback_config(parser.parse_args(["--no-fuse_norm", "--no-fuse_activation"]))
    assert config == SwitchBackConfig(fuse_norm=False, fuse_activation=False)
    assert set(model_setup.SWITCHBACK_FLAGS) <= set(vars(parser.parse_args([])))
    # a kernel option (not compared between configs): the layers' KernelOptions carry it
    assert not model_setup.switchback_config(parser.parse_args([])).kernel_options.cache_weight_operands
    config = model_setup.switchback_config(parser.parse_args(["--cache_weight_operands"]))
    assert config.kernel_options.cache_weight_operands


def test_lock_towers_freezes_a_tower_with_its_projection():
    model = tiny_model()
    model_setup.lock_towers(model, lock_image=True, lock_text=False)
    frozen = {n.split(".")[0] for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {"vision_model", "visual_projection"}


def test_default_clip_matches_the_tokenizer_and_image_size():
    from hf_switchback.training.synthetic import vocabulary
    from hf_switchback.training.tokenizer import build_word_tokenizer

    tokenizer = build_word_tokenizer(vocabulary(), model_max_length=16)
    clip, processor = model_setup.default_clip(tokenizer, model_setup.DEFAULT_IMAGE_SIZE)
    assert clip.config.text_config.vocab_size == len(tokenizer)
    assert clip.config.vision_config.image_size == model_setup.DEFAULT_IMAGE_SIZE
    assert processor.tokenizer is tokenizer


def test_logit_scale_value_and_no_peak_memory_on_cpu():
    model = tiny_model()
    assert lifecycle.logit_scale_value(model) == pytest.approx(math.exp(model.logit_scale.item()))
    assert lifecycle.peak_memory(FakeAccelerator()) == {}


def test_tracker_config_is_scalars_without_the_token():
    args = build_parser().parse_args(["--hub_token", "hf_secret", "--target_modules", "fc1", "fc2"])
    config = lifecycle.tracker_config(args)
    assert "hub_token" not in config
    assert config["target_modules"] == "['fc1', 'fc2']" and config["batch_size"] == 128
    assert all(isinstance(v, (int, float, str, bool)) for v in config.values())


def test_deepspeed_gets_the_micro_batch_size_and_refuses_accumulation():
    ds_config = {}
    accelerator = types.SimpleNamespace(
        state=types.SimpleNamespace(deepspeed_plugin=types.SimpleNamespace(deepspeed_config=ds_config))
    )
    runtime.check_deepspeed(accelerator, build_parser().parse_args(["--batch_size", "32"]))
    assert ds_config == {"train_micro_batch_size_per_gpu": 32}
    with pytest.raises(ValueError, match="--accum_freq"):
        runtime.check_deepspeed(accelerator, build_parser().parse_args(["--accum_freq", "2"]))


def test_push_model_leaves_the_token_out_of_the_card_and_the_config_out_of_the_metrics(monkeypatch):
    from hf_switchback import hub

    sent = {}
    monkeypatch.setattr(hub, "push_to_hub", lambda model, processor, repo_id, **kw: sent.update(kw) or "url")
    args = build_parser().parse_args(["--push_to_hub", "--hub_model_id", "u/m", "--hub_token", "hf_secret"])
    config = SwitchBackConfig()
    lifecycle.push_model(None, None, args, config, {"zero_shot_top1": 0.5, "switchback": config.to_dict()})
    assert sent["metrics"] == {"zero_shot_top1": 0.5}
    assert "hub_token" not in sent["training_args"] and sent["token"] == "hf_secret"
    assert sent["switchback_config"] is config
