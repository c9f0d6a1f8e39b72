"""Block-level SwitchBack paths: several linears of one block run through one SwitchBack op (the fused q/k/v
projection of transformers' CLIP/SigLIP attention, the fused MLP, the packed projection of nn.MultiheadAttention),
and the producers that quantize (LayerNorm, activation) with the encoder layers and MLPs that use them."""

from .attention import is_fused_attention, sync_fused_attention
from .multihead_attention import SwitchBackMultiheadAttention
from .qkv import switchback_qkv

__all__ = ["SwitchBackMultiheadAttention", "is_fused_attention", "switchback_qkv", "sync_fused_attention"]
