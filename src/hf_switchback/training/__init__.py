"""What examples/train_clip.py is made of: losses, data, eval, optimization helpers (importable, tested).

Submodules are imported on use (`from hf_switchback.training.data import CaptionStream`); only the names
users reach for first are re-exported here, and they import nothing heavier than torch.
"""

from .losses import ClipLoss, gather_features
from .siglip_loss import SigLipLoss

__all__ = ["ClipLoss", "SigLipLoss", "gather_features"]
