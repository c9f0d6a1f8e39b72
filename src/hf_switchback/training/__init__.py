"""What examples/train_clip.py is made of (importable, tested), by what a reader looks for:

- flags: arguments (HfArgumentParser dataclasses), cli (parsing and the one validation pass);
- data: data (loading, decoding, augmentation, batches), shards (the webdataset tar reader), sources (a run's
  data from its flags), synthetic (the embedded default set), tokenizer (the word-level tokenizer it needs);
- model: model_setup (model, processor, SwitchBack config, tower locks, patch dropout), layer_scale, runtime
  (torch.compile, DeepSpeed, collective timeout);
- step and loss: step (the contrastive step, accum_freq), losses (CLIP), siglip_loss (SigLIP), optim
  (parameter groups, optimizers, schedule), guard (non-finite steps), spike_monitor;
- checkpoints and resume: checkpoints; evaluation: evaluation (zero-shot, retrieval);
- run lifecycle and logging: lifecycle (output directory lock, console, rank reductions, tracker and Hub,
  teardown).

Submodules are imported on use (`from hf_switchback.training.data import CaptionStream`); only the names
users reach for first are re-exported here, and they import nothing heavier than torch.
"""

from .losses import ClipLoss, gather_features
from .siglip_loss import SigLipLoss

__all__ = ["ClipLoss", "SigLipLoss", "gather_features"]
