"""SwitchBack under FSDP2 (torch.distributed.fsdp.fully_shard) on the CPU: 2 processes, gloo.

Both ranks feed the same full batch (CLIP's loss is batch-global), so FSDP's averaged gradients must equal
the single-process ones. Tolerance 1e-5 absolute, fp32.
"""

import os
import subprocess
import sys

import pytest
import torch
from helpers import free_port

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_fsdp2_worker.py")
TOL = 1e-5


def max_error(got: dict, ref: dict) -> float:
    assert got.keys() == ref.keys()
    return max((got[n] - ref[n]).abs().max().item() for n in ref)


@pytest.mark.slow
# apply_switchback before / after fully_shard; fuse_qkv: q/k/v of each attention block as one op; wgrad: the
# weight-gradient GEMM's format (fp8: its gradients must still arrive as the sharded fp32 parameters' own)
@pytest.mark.parametrize(
    "order, fuse_qkv, wgrad",
    [
        ("before", False, "16bit"),
        ("after", False, "16bit"),
        ("before", True, "16bit"),
        ("after", True, "16bit"),
        ("after", False, "fp8"),
    ],
)
def test_fsdp2_matches_single_process(tmp_path, order, fuse_qkv, wgrad):
    out = tmp_path / "fsdp2.pt"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    cmd += ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    cmd += [WORKER, "--out", str(out), "--order", order, "--wgrad_precision", wgrad]
    cmd += ["--fuse_qkv"] if fuse_qkv else []
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    result = torch.load(out)
    checks = result["checks"]
    assert checks["n_switchback"] == checks["n_ref_switchback"] == 24  # 2 towers x 2 layers x 6 linears
    assert checks["n_fused_qkv"] == (4 if fuse_qkv else 0)
    assert checks["all_dtensor"]  # from_linear kept FSDP's sharded DTensor Parameters
    assert checks["grads_in_param_dtype"]  # sharded gradients in the parameters' dtype (fp8 wgrad too)
    assert checks["removed"] and checks["removed_dtensor"]  # remove_switchback works on the sharded model

    ref_loss, ref_grads, ref_params = result["ref"]
    loss, grads, params = result["fsdp"]
    assert abs(loss - ref_loss) <= TOL
    assert max_error(grads, ref_grads) <= TOL
    assert max_error(params, ref_params) <= TOL
    # after remove_switchback (and the step) the sharded model runs plain fp32 linears like the reference
    assert abs(checks["loss_after_remove"] - checks["ref_loss_after_remove"]) <= TOL
