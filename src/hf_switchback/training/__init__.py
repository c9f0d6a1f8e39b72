"""What examples/train_clip.py is made of (importable, tested).

The algorithms: losses, step (the contrastive step, accum_freq), optim / optimizers, layer_scale, spike_monitor,
patch_dropout, evaluation, data / synthetic / transforms / tokenizer. The script's plumbing, one job each:
arguments (the flags, as HfArgumentParser dataclasses), cli (parsing and the one validation pass), model_setup,
sources (its data), checkpoints, metrics (rank reductions), runtime (torch.compile, DeepSpeed), reporting
(tracker, Hub), console (output above the progress bar), teardown.

Submodules are imported on use (`from hf_switchback.training.data import CaptionStream`); only the names
users reach for first are re-exported here, and they import nothing heavier than torch.
"""

from .losses import ClipLoss, gather_features
from .siglip_loss import SigLipLoss

__all__ = ["ClipLoss", "SigLipLoss", "gather_features"]
