"""Shared by the training tests and the worker scripts they launch (no package: imported by path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# tests/ holds helpers.py; worker processes that import this file by path do not have it on sys.path
sys.path.insert(0, os.path.join(REPO, "tests"))
import helpers  # noqa: E402
from helpers import free_port, tiny_clip_config  # noqa: E402

SCRIPT = os.path.join(REPO, "examples", "train_clip.py")
CPU_CONFIG = os.path.join(REPO, "accelerate_configs", "cpu.yaml")
VOCAB = 64  # >= the synthetic word tokenizer's size


def tiny_config(hidden: int = 32, layers: int = 1, image_size: int = 32, eos: int = 3, pad: int = 0):
    """helpers.tiny_clip_config with the synthetic word tokenizer's special ids (bos 2) and vocabulary."""
    return tiny_clip_config(
        layers=layers, hidden=hidden, image_size=image_size, bos=2, eos=eos, pad=pad, vocab=VOCAB
    )


def tiny_siglip_config(hidden: int = 32, layers: int = 1, image_size: int = 32):
    """SiglipConfig of tiny_config's size, same vocabulary and special ids (fixed_batch fits both)."""
    from transformers import SiglipConfig

    tower = dict(
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=2
    )
    text = dict(
        tower, vocab_size=VOCAB, max_position_embeddings=16, bos_token_id=2, eos_token_id=3, pad_token_id=0
    )
    return SiglipConfig(text_config=text, vision_config=dict(tower, image_size=image_size, patch_size=8))


def tiny_model(seed: int = 0, switchback: bool = False, siglip: bool = False):
    import torch
    from transformers import CLIPModel, SiglipModel

    from hf_switchback import SwitchBackConfig, apply_switchback

    torch.manual_seed(seed)
    model = SiglipModel(tiny_siglip_config()).float() if siglip else CLIPModel(tiny_config()).float()
    if switchback:
        apply_switchback(model, SwitchBackConfig(backend="torch"))
    return model


def fixed_batch(n: int, seed: int = 1) -> dict:
    """n random (pixels, token ids) pairs; every sequence ends with eos (id 3) then padding (id 0)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    pixel_values = torch.randn(n, 3, 32, 32, generator=g)
    input_ids = torch.randint(4, VOCAB, (n, 12), generator=g)
    lengths = torch.randint(3, 11, (n,), generator=g)
    positions = torch.arange(12)[None]
    input_ids[positions == lengths[:, None]] = 3
    input_ids[positions > lengths[:, None]] = 0
    input_ids[:, 0] = 2
    return {
        "pixel_values": pixel_values,
        "input_ids": input_ids,
        "attention_mask": (positions <= lengths[:, None]).long(),
    }


def write_tiny_model_config(path: str) -> str:
    tiny_config().to_json_file(path)
    return path


def write_tiny_siglip_config(path: str) -> str:
    tiny_siglip_config().to_json_file(path)
    return path


def clean_env() -> dict:
    """Subprocess env: offline, single-threaded BLAS/OMP (2 processes on 2 cores), this venv first on PATH (and
    PYTHONPATH kept, so a checkout run with PYTHONPATH=src launches its own package)."""
    keep = ("PATH", "PYTHONPATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "SYSTEMROOT", "USER")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        WANDB_MODE="disabled",
    )
    return env


def launch_command(launcher: list[str], args: list[str]) -> list[str]:
    """`accelerate launch <launcher flags> <script and its args>`, one CPU thread per process."""
    accelerate = [sys.executable, "-m", "accelerate.commands.launch"]
    return [*accelerate, *launcher, "--num_cpu_threads_per_process", "1", *args]


def launch(
    args: list[str], num_processes: int = 1, timeout: int = 300, cwd: str = REPO
) -> subprocess.CompletedProcess:
    """accelerate launch on the CPU (gloo when num_processes > 1); raises with the output on failure."""
    if num_processes > 1:
        launcher = [
            "--config_file",
            CPU_CONFIG,
            "--num_processes",
            str(num_processes),
            "--main_process_port",
            str(free_port()),
        ]
    else:
        launcher = [
            "--cpu",
            "--num_processes",
            "1",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
        ]
    cmd = launch_command(launcher, args)
    proc = subprocess.run(cmd, env=clean_env(), cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)}\nexit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def logged_losses(output: str) -> dict[int, float]:
    """{step: loss} from the `step N loss X` lines that --log_losses prints."""
    losses = {}
    for line in output.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] == "step" and parts[2] == "loss":
            losses[int(parts[1])] = float(parts[3])
    return losses


def read_results(output_dir: str) -> dict:
    with open(os.path.join(output_dir, "all_results.json")) as f:
        return json.load(f)


def load_script(name: str = "train_clip"):
    """examples/train_clip.py as a module (its training_function runs in this process: ~1 s against ~12 s for
    a launch that imports torch, transformers and bitsandbytes again)."""
    return helpers.load_script(SCRIPT, name)


def run_in_process(script, argv: list[str]) -> dict:
    """Parse and check `argv` with the script's parser, run training_function, return its results."""
    from accelerate.state import AcceleratorState

    parser = script.build_parser()
    args = parser.parse_args(argv)
    script.check_args(parser, args)
    AcceleratorState._reset_state(True)  # other tests' Accelerator(cpu=True) must not leak in
    try:
        return script.training_function(args)
    finally:
        AcceleratorState._reset_state(True)
