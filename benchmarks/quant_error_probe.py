"""Quantization-error probe: run examples/train_clip.py and log, every N optimizer steps, how much each 8-bit
operand loses. This is how the int8 parity gap was traced to the output gradients (BENCHMARKS.md,
Accuracy).

    PYTHONPATH=src python benchmarks/quant_error_probe.py --out diag.jsonl --every 10 -- \
        examples/train_clip.py --model_config examples/configs/clip-vit-b-16.json --grad_precision int8 ...
    PYTHONPATH=src python benchmarks/quant_error_probe.py --out /tmp/d.jsonl --every 2 -- \
        examples/train_clip.py --output_dir /tmp/probe --max_train_steps 4 --min_tokens 0   # CPU smoke

Each line of --out is one recorded step: {"step": s, "<kernel>:<dtype>(<row length>,)": stats} with, over the
calls of that step (all layers of that shape): rel = [mean, max] of |dequant(q) - x| / |x| (Frobenius),
flush = mean fraction of non-zero entries quantized to 0, lost = mean |x where q == 0| / |x|, rowrel_med =
mean of the per-row median relative error. The kernel names say which operand: quantize_rowwise (layer inputs),
quantize_tensorwise / _rowwise (weights), quantize_rowwise_colsum (output gradients), *_transposed (weights in
grad-input), act_quantize_rowwise (fused MLP: fc2's input), gradh_quantize (fused MLP: fc1's output gradient).

--stochastic_int8_grads is an experiment, not a library feature: it replaces the int8 quantize of output
gradients by stochastic rounding in torch ops (slow). It closed part of the int8 gap, fp8 gradients all of it.

How: the probe wraps `hf_switchback.functional.get_kernels` so every kernel set the autograd functions fetch
records its quantize outputs; an optimizer step hook flushes the records. Eager mode only (no --torch_compile).
Caveat: an eval that runs right after a recorded step's optimizer step lands in the next record, so forward
operands (layer inputs, weights) of that step include eval batches (more "calls"); gradient operands do not.
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

import hf_switchback.functional as functional
from hf_switchback.kernels.reference import apply_activation

QUANTIZE_KERNELS = (
    "quantize_rowwise",
    "quantize_rowwise_colsum",
    "quantize_tensorwise",
    "quantize_rowwise_transposed",
    "quantize_tensorwise_transposed",
)


class Recorder:
    def __init__(self, out: str, every: int, stochastic: bool):
        self.out, self.every, self.stochastic = out, every, stochastic
        self.step, self.active, self.stats = 0, True, {}

    def record(self, name: str, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
        if not self.active or x.numel() == 0:
            return
        x, s = x.float(), scale.float()
        deq = q.float() * (s[:, None] if s.dim() == 1 else s)
        zero, norm = q.float() == 0, x.norm().clamp_min(1e-30)
        nonzero = x != 0
        row_rel = (deq - x).norm(dim=1) / x.norm(dim=1).clamp_min(1e-30)
        values = torch.stack(
            [
                (deq - x).norm() / norm,
                (nonzero & zero).float().sum() / nonzero.float().sum().clamp_min(1),
                (x * zero).norm() / norm,
                row_rel.median(),
            ]
        )
        self.stats.setdefault(f"{name}{tuple(x.shape)[1:]}", []).append(values)

    def after_step(self, *_) -> None:
        if self.stats:
            line = {"step": self.step}
            for key, values in self.stats.items():
                t = torch.stack(values).cpu()
                line[key] = {
                    "rel": [round(t[:, 0].mean().item(), 5), round(t[:, 0].max().item(), 5)],
                    "flush": round(t[:, 1].mean().item(), 5),
                    "lost": round(t[:, 2].mean().item(), 5),
                    "rowrel_med": round(t[:, 3].mean().item(), 5),
                    "calls": len(values),
                }
            with open(self.out, "a") as f:
                f.write(json.dumps(line) + "\n")
        self.stats = {}
        self.step += 1
        self.active = self.step % self.every == 0


def stochastic_int8_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise int8 with stochastic rounding: E[dequant(q)] = x, so small entries survive on average."""
    xf = x.float()
    scale = xf.abs().amax(dim=1) / 127.0
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.floor(xf / safe[:, None] + torch.rand_like(xf)).clamp_(-127, 127).to(torch.int8)
    return q, scale


class RecordingKernels:
    """A kernel set whose quantize calls also go to the recorder."""

    def __init__(self, kernels, recorder: Recorder):
        self._kernels, self._recorder = kernels, recorder

    def __getattr__(self, name: str):
        fn, rec = getattr(self._kernels, name), self._recorder
        if name in QUANTIZE_KERNELS:

            def quantize(x, qdtype, *args, **kwargs):
                if rec.stochastic and name == "quantize_rowwise_colsum" and qdtype == torch.int8:
                    out = (*stochastic_int8_rowwise(x), x.sum(dim=0, dtype=torch.float32))
                else:
                    out = fn(x, qdtype, *args, **kwargs)
                source = x.t() if name.endswith("_transposed") else x
                rec.record(f"{name}:{str(qdtype).removeprefix('torch.')}", source, out[0], out[1])
                return out

            return quantize
        if name == "act_quantize_rowwise":

            def act_quantize(h, qdtype, activation, **kwargs):
                out = fn(h, qdtype, activation, **kwargs)
                rec.record(name, apply_activation(h, activation), *out)
                return out

            return act_quantize
        if name == "scaled_matmul_act_backward":

            def matmul_act_backward(*args, **kwargs):
                out = fn(*args, **kwargs)
                if rec.stochastic and args[5] == torch.int8:
                    out = (out[0], out[1], *stochastic_int8_rowwise(out[0]), out[4])
                rec.record("gradh_quantize", out[0], out[2], out[3])
                return out

            return matmul_act_backward
        return fn


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="JSONL file the per-step statistics are appended to")
    parser.add_argument("--every", type=int, default=10, help="record one step in this many")
    parser.add_argument("--stochastic_int8_grads", action="store_true", help="experiment, see above")
    parser.add_argument("script", help="the training script, e.g. examples/train_clip.py")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    args = parser.parse_args()
    recorder = Recorder(args.out, args.every, args.stochastic_int8_grads)
    get_kernels = functional.get_kernels
    functional.get_kernels = lambda *args: RecordingKernels(get_kernels(*args), recorder)
    register_optimizer_step_post_hook(recorder.after_step)
    sys.argv = [args.script, *[a for a in args.script_args if a != "--"]]
    runpy.run_path(args.script, run_name="__main__")


if __name__ == "__main__":
    main()
