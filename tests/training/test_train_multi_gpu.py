"""What the multi-GPU paths need, checked on the CPU: the 1-D logit_scale (FSDP2 / ZeRO-3), pure-bf16 weights
without autocast (DeepSpeed bf16), and train_log.jsonl / steady throughput / plain-loadable model after resume."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import torch
from train_helpers import (
    REPO,
    SCRIPT,
    clean_env,
    fixed_batch,
    free_port,
    launch,
    launch_command,
    read_results,
    tiny_model,
    write_tiny_model_config,
)

from hf_switchback.training.lifecycle import STILL_REFERENCED
from hf_switchback.training.losses import ClipLoss
from hf_switchback.training.step import CLIPForContrastive, export_state_dict, logit_scale_to_1d


def test_logit_scale_1d_same_loss_and_plain_checkpoint(tmp_path):
    from transformers import CLIPModel

    batch = fixed_batch(8)
    inputs = {k: batch[k] for k in ("input_ids", "pixel_values", "attention_mask")}
    model = CLIPForContrastive(tiny_model())
    before = ClipLoss()(*model(**inputs))
    logit_scale_to_1d(model.clip)
    logit_scale_to_1d(model.clip)  # idempotent
    assert model.clip.logit_scale.shape == (1,)
    assert torch.equal(ClipLoss()(*model(**inputs)), before)
    assert model.clip(**inputs).logits_per_image.shape == (8, 8)  # CLIPModel's own forward broadcasts too

    state_dict = export_state_dict(model.clip.state_dict())
    assert state_dict["logit_scale"].shape == ()
    model.clip.save_pretrained(tmp_path, state_dict=state_dict)
    plain = CLIPModel.from_pretrained(tmp_path)
    assert plain.logit_scale.shape == ()
    assert torch.equal(plain.logit_scale, model.clip.logit_scale.detach().reshape(()))


def test_switchback_pure_bf16_weights_without_autocast():
    """DeepSpeed bf16 casts the module to bf16 and runs no autocast: SwitchBack must train in that mode too."""
    batch = fixed_batch(8)
    inputs = {k: batch[k] for k in ("input_ids", "pixel_values", "attention_mask")}
    losses, grads = {}, {}
    for switchback in (False, True):
        model = CLIPForContrastive(tiny_model(switchback=switchback)).to(torch.bfloat16)
        logit_scale_to_1d(model.clip)
        bf16_inputs = {**inputs, "pixel_values": inputs["pixel_values"].to(torch.bfloat16)}
        assert not torch.is_autocast_enabled("cpu")
        image, text, scale = model(**bf16_inputs)
        assert image.dtype == text.dtype == scale.dtype == torch.bfloat16
        loss = ClipLoss()(image, text, scale)
        loss.backward()
        losses[switchback] = loss.float().item()
        grads[switchback] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        for name, grad in grads[switchback].items():
            assert grad.dtype == torch.bfloat16 and torch.isfinite(grad).all(), name
    assert grads[True].keys() == grads[False].keys()
    # bf16 resolves a loss of ~4 to 1/32 (0.8%); int8 adds ~1% noise on this tiny model: 2.5% is 3 bf16 steps
    assert abs(losses[True] - losses[False]) <= 0.025 * losses[False], losses
    name = "clip.vision_model.encoder.layers.0.mlp.fc1.weight"
    cos = torch.nn.functional.cosine_similarity(
        grads[True][name].float().flatten(), grads[False][name].float().flatten(), dim=0
    )
    assert cos > 0.95, cos


def test_two_rank_log_resume_and_plain_load(tmp_path):
    """2 gloo ranks: train_log.jsonl records, steady throughput, resume from `latest`, plain CLIPModel load."""
    from transformers import CLIPModel

    out = tmp_path / "run"
    args = [
        "examples/train_clip.py",
        "--model_config",
        write_tiny_model_config(str(tmp_path / "tiny.json")),
        "--output_dir",
        str(out),
        "--batch_size",
        "8",
        "--max_train_steps",
        "6",
        "--checkpointing_steps",
        "3",
        "--logging_steps",
        "1",
        "--eval_steps",
        "3",
        "--max_eval_samples",
        "16",
        "--num_workers",
        "0",
        "--synthetic_train_samples",
        "256",
    ]
    proc = launch(args, num_processes=2)
    # both ranks freed the DDP model before the process group (else exit can hang: training/lifecycle.py)
    assert STILL_REFERENCED not in proc.stderr, proc.stderr[-3000:]
    with open(out / "train_log.jsonl") as f:
        first = [json.loads(line) for line in f]
    train = [r for r in first if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert set(train[0]) == {"step", "epoch", "loss", "lr", "logit_scale", "samples_per_s"}
    evals = [r for r in first if "loss" not in r]
    assert [r["step"] for r in evals] == [3, 6] and "image_to_text_R@1" in evals[0]
    results = read_results(str(out))
    assert results["train_samples_per_second_steady"] > 0 and results["steady_from_step"] == 2
    assert results["num_processes"] == 2 and results["global_batch_size"] == 16

    shutil.rmtree(out / "checkpoints" / "step_6")
    os.remove(out / "model.safetensors")
    launch([*args, "--resume_from_checkpoint", "latest"], num_processes=2)
    with open(out / "train_log.jsonl") as f:
        second = [json.loads(line) for line in f]
    assert [r["step"] for r in second] == [
        r["step"] for r in first
    ]  # lines after step 3 rewritten, not doubled
    for a, b in zip(first, second, strict=True):
        if "loss" in a:
            assert abs(a["loss"] - b["loss"]) < 1e-5, (a, b)
    plain = CLIPModel.from_pretrained(out)
    assert plain.logit_scale.shape == ()


def test_multi_node_config_as_two_machines_on_one_host(tmp_path):
    """accelerate_configs/multi_node.yaml as its header says to run it: the same command on each "node" with its
    machine_rank (two processes on this host, gloo, static rendezvous on localhost); the losses equal a
    1-process run of the same global batch (2 ranks x 8 hold the samples of 1 rank x 16)."""
    from transformers import CLIPModel

    model_config = write_tiny_model_config(str(tmp_path / "tiny.json"))

    def args(out: Path, batch: int) -> list[str]:
        return [
            SCRIPT,
            "--model_config", model_config,
            "--output_dir", str(out),
            "--batch_size", str(batch),
            "--max_train_steps", "3",
            "--logging_steps", "1",
            "--eval_steps", "0",
            "--max_eval_samples", "16",
            "--num_workers", "0",
            "--synthetic_train_samples", "96",
            "--report_to", "none",
        ]  # fmt: skip

    port = str(free_port())
    nodes = []
    for machine_rank in ("0", "1"):
        launcher = [
            "--config_file", os.path.join(REPO, "accelerate_configs", "multi_node.yaml"),
            # the per-node edits the config's header asks for
            "--machine_rank", machine_rank, "--main_process_ip", "127.0.0.1", "--main_process_port", port,
            "--num_machines", "2", "--num_processes", "2", "--mixed_precision", "no",
        ]  # fmt: skip
        cmd = launch_command(launcher, args(tmp_path / "nodes", 8))
        log = open(tmp_path / f"node{machine_rank}.log", "w")  # noqa: SIM115 - closed below
        nodes.append((subprocess.Popen(cmd, env=clean_env(), cwd=REPO, stdout=log, stderr=log), log))
    try:
        for proc, _ in nodes:
            proc.wait(timeout=300)
    finally:  # a hung node must not outlive the test
        for proc, log in nodes:
            proc.kill()
            log.close()
    for machine_rank, (proc, _) in enumerate(nodes):
        text = (tmp_path / f"node{machine_rank}.log").read_text()
        assert proc.returncode == 0, text[-6000:]
    results = read_results(str(tmp_path / "nodes"))
    assert results["num_processes"] == 2 and results["global_batch_size"] == 16

    launch(args(tmp_path / "single", 16))

    def losses(out: Path) -> list[float]:
        with open(out / "train_log.jsonl") as f:
            return [r["loss"] for r in map(json.loads, f) if "loss" in r]

    two_nodes, one_process = losses(tmp_path / "nodes"), losses(tmp_path / "single")
    assert len(two_nodes) == len(one_process) == 3
    # step 1: same weights, same samples, fp32: equal to rounding. Later steps: the all-reduce sums gradients in
    # another order than one process, and after an update a weight can round to another int8 step, which the
    # next step carries on (seen at step 3 of a loss of ~2.83: 3.5e-4 on one host, 3.1e-3 on another, each the
    # same in every run there; step 2 within 2e-5). A wrong global batch would differ at step 1 already; twice or
    # half the update (a wrong gradient average; one process with --lr doubled or halved) moves step 2 from
    # 3.686 to 3.368 / 3.762.
    assert abs(two_nodes[0] - one_process[0]) < 1e-5, (two_nodes, one_process)
    assert abs(two_nodes[1] - one_process[1]) < 1e-3, (two_nodes, one_process)
    assert abs(two_nodes[2] - one_process[2]) < 5e-3 * abs(one_process[2]), (two_nodes, one_process)
    assert CLIPModel.from_pretrained(tmp_path / "nodes").logit_scale.shape == ()
