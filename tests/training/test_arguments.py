"""train_clip.py's arguments: the HfArgumentParser dataclasses (flags, aliases, .json/.yaml files), run_clip.py's
command, and the one validation pass: every bad input is one `train_clip.py: error:` line, exit code 2, and no
output dir."""

import json
import os
import subprocess
import sys

import pytest
import torch
from train_helpers import SCRIPT, clean_env, write_tiny_model_config

from hf_switchback.training import cli
from hf_switchback.training.arguments import DATACLASSES, NO_OP_FLAGS, build_parser

# transformers' examples/pytorch/contrastive-image-text/README.md, its documented run_clip.py command, as argv after
# the shell ($PWD/data expanded, the quotes of --per_device_train_batch_size="64" removed)
RUN_CLIP_EXAMPLE = [
    "--output_dir", "./clip-roberta-finetuned", "--model_name_or_path", "./clip-roberta",
    "--data_dir", "/data", "--dataset_name", "ydshieh/coco_dataset_script", "--dataset_config_name=2017",
    "--image_column", "image_path", "--caption_column", "caption", "--remove_unused_columns=False",
    "--do_train", "--do_eval", "--per_device_train_batch_size=64", "--per_device_eval_batch_size=64",
    "--learning_rate=5e-5", "--warmup_steps=0", "--weight_decay", "0.1", "--overwrite_output_dir",
]  # fmt: skip


def check(argv, tmp_path):
    """parse + check_args as main() does, with --output_dir under tmp_path unless argv names one."""
    if "--output_dir" not in argv and not (len(argv) == 1 and argv[0].endswith((".json", ".yaml"))):
        argv = [*argv, "--output_dir", str(tmp_path / "run")]
    parser = build_parser()
    args = cli.parse_args(parser, argv)
    cli.check_args(parser, args)
    return args


def fails(argv, tmp_path, capsys) -> str:
    """The one error line of a refused run; asserts exit code 2 and that no output dir was created."""
    with pytest.raises(SystemExit) as exc:
        check(argv, tmp_path)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("train_clip.py: error:")]
    assert len(lines) == 1 and err.strip().endswith(lines[0]), err
    assert not (tmp_path / "run").exists()
    return lines[0]


def write_csv(path, header="image,caption", rows=4):
    path.write_text("\n".join([header] + [f"img{i}.png,caption {i}" for i in range(rows)]) + "\n")
    return str(path)


NUMERIC = [
    (["--lr", "-1"], "--lr must be a number > 0"),
    (["--lr", "3e38", "--warmup_steps", "0"], "--lr must be a number > 0 and < 1e+10"),
    (["--lr", "nan"], "--lr must be"),
    (["--min_tokens", "-1"], "--min_tokens must be >= 0"),
    (["--eval_steps", "-5"], "--eval_steps must be >= 0"),
    (["--checkpointing_steps", "-3"], "--checkpointing_steps must be >= 0"),
    (["--checkpoints_total_limit", "-1"], "--checkpoints_total_limit must be >= 0"),
    (["--warmup_steps", "-10"], "--warmup_steps must be >= 0"),
    (["--num_workers", "-1"], "--num_workers must be >= 0"),
    (["--weight_decay", "-1"], "--weight_decay must be >= 0"),
    (["--max_text_length", "0"], "--max_text_length must be >= 1"),
    (["--grad_clip_norm", "-1"], "--grad_clip_norm must be >= 0"),
    (["--grad_clip_norm", "inf"], "--grad_clip_norm must be >= 0"),
    (["--beta1", "1.0"], "--beta1 (Adam) must be in [0, 1)"),
    (["--adam_beta2", "-0.1"], "--beta2 (Adam) must be in [0, 1)"),
    (["--eps", "0"], "--eps (Adam) must be a number > 0"),
    (["--min_lr_ratio", "2"], "--min_lr_ratio must be in [0.0, 1.0]"),
    (["--max_train_samples", "0"], "--max_train_samples must be >= 1"),
    (["--synthetic_train_samples", "10", "--batch_size", "16"], "--batch_size 16 is larger than the 10"),
    (["--max_train_samples", "8", "--batch_size", "16"], "--batch_size 16 is larger than the 8"),
    (["--target_modules", "nothing_like_this"], "no nn.Linear matched target_modules=('nothing_like_this',)"),
    (
        ["--exclude_modules", "q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"],
        "--target_modules / --exclude_modules",
    ),
]


@pytest.mark.parametrize("argv, message", NUMERIC, ids=[" ".join(a) for a, _ in NUMERIC])
def test_bad_values_are_one_line_before_anything_exists(argv, message, tmp_path, capsys):
    assert message in fails(argv, tmp_path, capsys)


def test_default_arguments_pass(tmp_path):
    args = check([], tmp_path)
    assert args.lr == 2e-3 and args.batch_size == 128 and not (tmp_path / "run").exists()
    check(["--checkpoints_total_limit", "0", "--warmup_steps", "0", "--min_tokens", "0"], tmp_path)


def test_compile_cache_dir_defaults_to_the_output_dir_and_none_turns_it_off(tmp_path, capsys):
    from hf_switchback.training.runtime import compile_artifacts_path

    version = torch.__version__.replace("+", "_")
    plain = check([], tmp_path)
    assert compile_artifacts_path(plain) is None  # no --torch_compile: nothing compiled, nothing kept
    default = check(["--torch_compile"], tmp_path)
    expected = os.path.join(
        str(tmp_path / "run"), "compile_cache", f"torch_compile_artifacts_torch{version}.bin"
    )
    assert compile_artifacts_path(default) == expected
    shared = check(["--torch_compile", "--compile_cache_dir", str(tmp_path / "shared")], tmp_path)
    assert compile_artifacts_path(shared).startswith(str(tmp_path / "shared") + os.sep)
    assert compile_artifacts_path(check(["--torch_compile", "--compile_cache_dir", "none"], tmp_path)) is None
    assert "--compile_cache_dir needs --torch_compile" in fails(
        ["--compile_cache_dir", "x"], tmp_path, capsys
    )
    a_file = tmp_path / "cache.bin"
    a_file.write_bytes(b"")
    argv = ["--torch_compile", "--compile_cache_dir", str(a_file)]
    assert f"--compile_cache_dir {str(a_file)!r} is a file" in fails(argv, tmp_path, capsys)


def test_files_columns_and_sizes_are_checked_from_the_header(tmp_path, capsys):
    tok = ["--allow_synthetic_tokenizer"]
    err = fails(["--train_file", str(tmp_path / "missing.csv"), *tok], tmp_path, capsys)
    assert "--train_file" in err and "is not a file" in err
    csv = write_csv(tmp_path / "train.csv", header="path,text")
    err = fails(
        ["--train_file", csv, "--image_column", "path", "--caption_column", "caption", *tok], tmp_path, capsys
    )
    assert "has no column 'caption' (its columns: path, text): pass --caption_column" in err
    err = fails(["--train_file", csv, *tok], tmp_path, capsys)
    assert "has none of the image columns" in err and "pass --image_column" in err
    ok = ["--train_file", csv, "--image_column", "path", "--caption_column", "text", *tok]
    err = fails([*ok, "--batch_size", "8"], tmp_path, capsys)
    assert "--batch_size 8 is larger than the 4 training samples" in err
    check([*ok, "--batch_size", "4"], tmp_path)
    err = fails(
        [*ok, "--batch_size", "4", "--validation_file", csv, "--zeroshot_label_column", "label"],
        tmp_path,
        capsys,
    )
    assert "--zeroshot_label_column 'label' is not a column of --validation_file" in err
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("".join(json.dumps({"jpg": f"{i}.png", "txt": "a"}) + "\n" for i in range(4)))
    check(["--train_file", str(jsonl), "--batch_size", "4", *tok], tmp_path)
    jsonl.write_text('["jpg", "txt"]\n')
    assert "the first line is not a JSON object" in fails(
        ["--train_file", str(jsonl), *tok], tmp_path, capsys
    )
    (tmp_path / "bom.csv").write_text("\ufeffimage,caption\na.png,x\n", encoding="utf-8")
    check(
        ["--train_file", str(tmp_path / "bom.csv"), "--batch_size", "1", "--image_column", "image", *tok],
        tmp_path,
    )
    err = fails(["--train_data_dir", str(tmp_path / "nope"), *tok], tmp_path, capsys)
    assert "is not a directory" in err
    err = fails(["--train_shards", str(tmp_path / "*.tar"), "--max_train_steps", "1", *tok], tmp_path, capsys)
    assert "no webdataset shards match" in err
    err = fails(["--model_config", str(tmp_path / "none.json")], tmp_path, capsys)
    assert "--model_config" in err


def test_own_data_needs_a_tokenizer_or_the_explicit_flag(tmp_path, capsys):
    csv = write_csv(tmp_path / "train.csv")
    err = fails(["--train_file", csv, "--batch_size", "2"], tmp_path, capsys)
    assert "--tokenizer_name_or_path" in err and "--allow_synthetic_tokenizer" in err
    check(["--train_file", csv, "--batch_size", "2", "--allow_synthetic_tokenizer"], tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_triton_backend_without_cuda(tmp_path, capsys):
    err = fails(["--backend", "triton"], tmp_path, capsys)
    assert "--backend triton but" in err and "--backend auto" in err


def test_target_modules_are_matched_on_the_configs_model(tmp_path, capsys):
    config = write_tiny_model_config(str(tmp_path / "config.json"))
    check(["--model_config", config, "--target_modules", "fc1"], tmp_path)
    err = fails(["--model_config", config, "--target_modules", "mlp.fc3"], tmp_path, capsys)
    assert "The model has 14 linear layers" in err  # 1 layer a tower: 6 each, plus the two projections
    pretrained = tmp_path / "pretrained"
    pretrained.mkdir()
    os.replace(config, pretrained / "config.json")  # a local checkpoint's config: no weights are read
    err = fails(["--model_name_or_path", str(pretrained), "--target_modules", "mlp.fc3"], tmp_path, capsys)
    assert "The model has 14 linear layers" in err


def test_output_dir_follows_trainers_rule(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    check([], tmp_path)  # empty: fine
    (out / ".train.lock").write_text("")  # hidden entries do not make it a used dir
    check([], tmp_path)
    (out / "config.json").write_text("{}")  # the user's own file, not a run of ours
    with pytest.raises(SystemExit) as exc:
        check([], tmp_path)
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1
    assert (
        "is not empty (config.json) and holds no run of this script" in err
        and "--overwrite_output_dir" in err
    )
    check(["--overwrite_output_dir"], tmp_path)
    (out / "all_results.json").write_text("{}")  # a finished run without checkpoints: resume is no way out
    with pytest.raises(SystemExit):
        check([], tmp_path)
    err = capsys.readouterr().err
    assert "holds a previous run (all_results.json)" in err and "--resume_from_checkpoint" not in err
    step = out / "checkpoints" / "step_2"
    step.mkdir(parents=True)
    (step / "checkpoint.json").write_text("{}")
    with pytest.raises(SystemExit):
        check([], tmp_path)
    assert "--resume_from_checkpoint latest to continue it" in capsys.readouterr().err


def test_every_flag_has_help_and_enums_have_choices():
    parser = build_parser()
    for action in parser._actions:
        assert action.help and action.help.strip(), action.option_strings
    for flag in (
        "--precision",
        "--backend",
        "--optimizer",
        "--report_to",
        "--switchback",
        "--mixed_precision",
    ):
        action = next(a for a in parser._actions if flag in a.option_strings)
        assert action.choices, flag
    assert "0: keep all" in next(a.help for a in parser._actions if a.dest == "checkpoints_total_limit")
    # one field per flag: every dataclass field is an argparse destination
    dests = {a.dest for a in parser._actions}
    assert {f for dc in DATACLASSES for f in dc.__dataclass_fields__} <= dests


def test_switch_flags_keep_their_spelling():
    parser = build_parser()
    args = parser.parse_args(
        ["--no-memory_efficient", "--fuse_mlp", "--no-local_loss", "--no-gather_with_grad"]
    )
    assert (args.memory_efficient, args.fuse_mlp, args.local_loss, args.gather_with_grad) == (
        False,
        True,
        False,
        False,
    )
    assert parser.parse_args([]).memory_efficient is None  # unset: SwitchBackConfig's default
    args = parser.parse_args(
        ["--lock_image", "--streaming", "--target_modules", "fc1", "fc2", "--config_name", "c"]
    )
    assert args.lock_image is True and args.streaming is True and args.target_modules == ["fc1", "fc2"]
    assert args.model_config == "c"


def test_run_clip_example_command(tmp_path, capsys, monkeypatch):
    """transformers' documented run_clip.py command: its data set is a loading script reading --data_dir, which
    this script does not run: one line saying what to do instead. Without it, the rest maps to our flags."""
    monkeypatch.chdir(tmp_path)  # its relative --output_dir
    err = fails(RUN_CLIP_EXAMPLE, tmp_path, capsys)
    assert "--dataset_name ydshieh/coco_dataset_script with --data_dir is a datasets loading script" in err
    assert "--train_file captions.csv" in err
    assert not (tmp_path / "clip-roberta-finetuned").exists()
    args = build_parser().parse_args(RUN_CLIP_EXAMPLE)
    assert (args.train_data_dir, args.dataset_name, args.dataset_config_name) == (
        "/data",
        "ydshieh/coco_dataset_script",
        "2017",
    )
    assert (args.batch_size, args.eval_batch_size, args.lr, args.warmup_steps, args.weight_decay) == (
        64,
        64,
        5e-5,
        0,
        0.1,
    )
    assert (args.image_column, args.caption_column, args.model_name_or_path) == (
        "image_path",
        "caption",
        "./clip-roberta",
    )
    assert args.overwrite_output_dir and args.output_dir == "./clip-roberta-finetuned"
    assert (args.do_train, args.do_eval, args.remove_unused_columns) == (True, True, False)


def test_run_clip_no_ops_are_noted_once(tmp_path, capsys):
    check(["--do_train", "--do_eval", "--remove_unused_columns", "false"], tmp_path)
    err = capsys.readouterr().err.splitlines()
    for name in ("do_train", "do_eval", "remove_unused_columns"):
        assert sum(line.startswith(f"train_clip.py: info: --{name} has no effect") for line in err) == 1, err
    assert set(NO_OP_FLAGS) >= {"do_train", "do_eval", "remove_unused_columns"}


def test_max_train_samples_limits_the_training_data(tmp_path):
    from hf_switchback.training.checkpoints import data_description
    from hf_switchback.training.sources import load_train_source

    csv = write_csv(tmp_path / "train.csv", rows=10)
    args = check(
        ["--train_file", csv, "--max_train_samples", "3", "--batch_size", "2", "--allow_synthetic_tokenizer"],
        tmp_path,
    )
    assert len(load_train_source(args).dataset) == 3
    assert "max_train_samples=3" in data_description(args)  # a resume with other data is refused
    args = check(["--max_train_samples", "300", "--batch_size", "2"], tmp_path)
    assert len(load_train_source(args).dataset) == 300 and data_description(args) == "synthetic(300)"


@pytest.mark.parametrize("ext", ["json", "yaml"])
def test_a_single_json_or_yaml_argument_is_a_file_of_flags(ext, tmp_path, capsys):
    values = {
        "lr": 1e-4,
        "batch_size": 16,
        "target_modules": ["fc1"],
        "precision": "int8",
        "output_dir": str(tmp_path / "run"),
    }
    path = tmp_path / f"args.{ext}"
    if ext == "json":
        path.write_text(json.dumps(values))
    else:
        path.write_text("\n".join(f"{k}: {json.dumps(v)}" for k, v in values.items()))
    args = check([str(path)], tmp_path)
    assert (args.lr, args.batch_size, args.target_modules, args.precision) == (1e-4, 16, ["fc1"], "int8")
    assert args.eps == 1e-6 and args.local_loss is True  # the rest keeps the flags' defaults
    path.write_text(json.dumps({**values, "precision": "int4"}) if ext == "json" else "precision: int4\n")
    assert "--precision: invalid choice 'int4'" in fails([str(path)], tmp_path, capsys)
    path.write_text(json.dumps({"no_such_flag": 1}) if ext == "json" else "no_such_flag: 1\n")
    assert "no_such_flag" in fails([str(path)], tmp_path, capsys)
    path.write_text(json.dumps({"lr": "fast"}) if ext == "json" else "lr: fast\n")
    assert "--lr: expected float, got 'fast'" in fails([str(path)], tmp_path, capsys)


def test_the_script_refuses_in_one_line_with_exit_code_2(tmp_path):
    """A real process: stderr is the one error line (no usage, no traceback) and nothing was created."""
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--min_tokens", "-1", "--output_dir", str(out)],
        env=clean_env(), capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip() == "train_clip.py: error: --min_tokens must be >= 0, got -1", proc.stderr
    assert not out.exists()


# Every flag and alias the script had before its arguments became dataclasses (users' commands keep working).
FORMER_FLAGS = """--accum_freq --adam_beta1 --adam_beta2 --adam_epsilon --allow_resume_mismatch --backend --batch_size
--beta1 --beta2 --bf16 --caption_column --checkpointing_steps --checkpoints_total_limit --compile_mode --crop_scale_min
--dataloader_num_workers --dataset_config_name --dataset_name --ddp_timeout --eps --eval_steps --exclude_modules --fp16
--fuse_mlp --gather_with_grad --grad_checkpointing --grad_clip_norm --grad_precision --gradient_checkpointing --help
--hub_model_id --hub_private --hub_private_repo --hub_token --image_column --layer_scale_init --learning_rate
--local_loss --lock_image --lock_text --log_losses --logging_steps --lr --max_eval_samples --max_grad_norm
--max_image_pixels --max_nonfinite_steps --max_seq_length --max_steps --max_text_length --max_train_steps
--memory_efficient --min_lr_ratio --min_tokens --mixed_precision --model_config --model_name_or_path --no-fuse_mlp
--no-gather_with_grad --no-local_loss --no-memory_efficient --num_train_epochs --num_workers --optimizer --output_dir
--overwrite_output_dir --patch_dropout --per_device_train_batch_size --precision --project_name --push_to_hub
--report_to --resume_from_checkpoint --save_steps --save_total_limit --seed --shuffle_buffer --siglip_dist_impl
--spike_monitor --spike_threshold --streaming --switchback --synthetic_train_samples --target_modules --tokenizer_name
--tokenizer_name_or_path --torch_compile --train_data_dir --train_file --train_shards --train_split --validation_file
--validation_shards --validation_split --warmup_steps --weight_decay --weight_scaling --zeroshot_classnames
--zeroshot_label_column --zeroshot_templates""".split()  # noqa: SIM905 (a block reads better than 100 lines)


def test_former_flags_are_all_accepted_and_hyphenated_twins_are_not():
    options = {o for a in build_parser()._actions for o in a.option_strings}
    assert len(FORMER_FLAGS) == 100 and set(FORMER_FLAGS) <= options
    assert "--model-name-or-path" not in options and "--no-remove-unused-columns" not in options


def test_a_json_array_train_file_that_is_not_utf8_is_refused_before_anything_loads(tmp_path, capsys):
    path = tmp_path / "train.json"
    path.write_bytes(b'[\n  {"image": "0.png", "caption": "caf\xe9"}\n]\n')
    line = fails(["--train_file", str(path)], tmp_path, capsys)
    assert "--train_file" in line and "line 2" in line and "iconv" in line
