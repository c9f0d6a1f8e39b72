"""Block-level SwitchBack paths: several linears of one block run through one SwitchBack op (the fused q/k/v
projection of transformers' CLIP/SigLIP attention, the packed projection of nn.MultiheadAttention)."""

from .attention import is_fused_attention, sync_fused_attention
from .multihead_attention import SwitchBackMultiheadAttention
from .qkv import switchback_qkv

__all__ = ["SwitchBackMultiheadAttention", "is_fused_attention", "switchback_qkv", "sync_fused_attention"]
