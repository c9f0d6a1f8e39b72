"""The model of a train_clip.py run, from its flags: CLIPModel or SiglipModel + processor, the SwitchBack
config, tower locks, patch dropout.

Three routes: --model_name_or_path (pretrained weights and processor), --model_config (random init from a
CLIPConfig or SiglipConfig json), or the embedded default (a CLIP small enough to learn the synthetic set on a
CPU in minutes). The model type comes from the config's `model_type`; any other type is refused, never read as
a CLIP config.
"""

from __future__ import annotations

import json
import logging
import math

import torch
from torch import nn

from ..config import SwitchBackConfig
from . import synthetic
from .runtime import kernel_options
from .sources import SYNTHETIC_IMAGE_SIZE, has_real_data
from .tokenizer import build_word_tokenizer

logger = logging.getLogger(__name__)

DEFAULT_IMAGE_SIZE = (
    SYNTHETIC_IMAGE_SIZE // 2
)  # model input; the generator draws at 2x, the crop brings it down
DEFAULT_TOWER = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4)
# The SwitchBackConfig fields the --<field> flags set (an unset flag keeps the library default).
SWITCHBACK_FLAGS = (
    "weight_scaling",
    "memory_efficient",
    "precision",
    "grad_precision",
    "wgrad_precision",
    "fuse_mlp",
    "fuse_norm",
    "fuse_activation",
    "target_modules",
    "exclude_modules",
    "backend",
    "min_tokens",
)


def default_clip(tokenizer, image_size: int):
    """(CLIPModel, CLIPProcessor) for the embedded default, random init, no download."""
    from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel, CLIPProcessor

    text = dict(
        DEFAULT_TOWER,
        vocab_size=len(tokenizer),
        max_position_embeddings=tokenizer.model_max_length,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision = dict(DEFAULT_TOWER, image_size=image_size, patch_size=image_size // 4)
    config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=64)
    size = {"shortest_edge": image_size}
    image_processor = CLIPImageProcessorPil(size=size, crop_size={"height": image_size, "width": image_size})
    return CLIPModel(config), CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer)


# model_type -> what trains it; the loss follows the type (ClipLoss / SigLipLoss).
MODEL_TYPES = ("clip", "siglip")
# SigLIP's from-scratch init (Zhai et al. 2023): temperature 10 and bias -10, so that the many negatives of a
# batch start near probability 0 instead of flooding the first steps with loss. transformers' own init is 1 / 0.
SIGLIP_INIT_LOGIT_SCALE, SIGLIP_INIT_LOGIT_BIAS = math.log(10.0), -10.0


def model_type(args) -> str:
    """ "clip" or "siglip", from the config that --model_name_or_path / --model_config names ("clip" for the
    embedded default and for a config json without model_type); raise ValueError for any other type."""
    if args.model_name_or_path:
        from transformers import AutoConfig

        kind, source = AutoConfig.from_pretrained(args.model_name_or_path).model_type, args.model_name_or_path
    elif args.model_config:
        with open(args.model_config, encoding="utf-8") as f:
            kind, source = json.load(f).get("model_type", "clip"), args.model_config
    else:
        return "clip"
    if kind in MODEL_TYPES:
        return kind
    hint = ""
    if kind == "siglip2":
        hint = (
            " SigLIP 2 takes NaFlex inputs (variable-length patch sequences with pixel_attention_mask and "
            "spatial_shapes), which this script's fixed-size image pipeline does not produce; apply_switchback "
            "and from_pretrained(..., quantization_config=SwitchBackConfig()) do support Siglip2Model in a "
            "training loop of your own."
        )
    raise ValueError(
        f"{source} is a {kind!r} model; train_clip.py trains {' and '.join(MODEL_TYPES)} models.{hint}"
    )


def init_siglip_logits(model) -> None:
    """SigLIP's from-scratch temperature and bias (log 10, -10), in place."""
    with torch.no_grad():
        model.logit_scale.fill_(SIGLIP_INIT_LOGIT_SCALE)
        model.logit_bias.fill_(SIGLIP_INIT_LOGIT_BIAS)


def load_model_and_processor(args):
    """--model_name_or_path (weights + processor), --model_config (random init), or the embedded default."""
    from transformers import (
        AutoProcessor,
        AutoTokenizer,
        CLIPConfig,
        CLIPImageProcessorPil,
        CLIPModel,
        CLIPProcessor,
        SiglipConfig,
        SiglipImageProcessorPil,
        SiglipModel,
        SiglipProcessor,
    )

    kind = model_type(args)
    if args.model_name_or_path:
        model = (SiglipModel if kind == "siglip" else CLIPModel).from_pretrained(args.model_name_or_path)
        return model, AutoProcessor.from_pretrained(args.model_name_or_path)
    if args.tokenizer_name_or_path:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name_or_path)
        tokenizer.model_max_length = min(tokenizer.model_max_length, args.max_text_length)
    else:
        tokenizer = build_word_tokenizer(synthetic.vocabulary(), model_max_length=16)
        if has_real_data(args):
            logger.warning(
                "training on your data with the synthetic set's word tokenizer: words outside its vocabulary "
                "become <unk>; pass --model_name_or_path or --tokenizer_name_or_path for a real tokenizer"
            )
    if not args.model_config:
        return default_clip(tokenizer, DEFAULT_IMAGE_SIZE)
    config = (SiglipConfig if kind == "siglip" else CLIPConfig).from_json_file(args.model_config)
    if config.text_config.vocab_size < len(tokenizer):
        raise ValueError(
            f"--model_config has text vocab_size {config.text_config.vocab_size} < the tokenizer's {len(tokenizer)}"
        )
    side = config.vision_config.image_size
    if kind == "siglip":
        # SigLIP resizes to the square (no centre crop), normalizes to [-1, 1], and its text tower pools the
        # last position: Collate and evaluation pad every caption to max_length, so that is always one slot.
        model = SiglipModel(config)
        init_siglip_logits(model)
        image_processor = SiglipImageProcessorPil(size={"height": side, "width": side})
        return model, SiglipProcessor(image_processor=image_processor, tokenizer=tokenizer)
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": side}, crop_size={"height": side, "width": side}
    )
    return CLIPModel(config), CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer)


def switchback_config(args) -> SwitchBackConfig:
    """SwitchBackConfig from the --switchback_* flags (unset flags keep the library defaults), with the kernel
    options the run's compile mode calls for."""
    fields = {name: getattr(args, name) for name in SWITCHBACK_FLAGS}
    given = {k: v for k, v in fields.items() if v is not None}
    return SwitchBackConfig(**given, kernel_options=kernel_options(args))


def lock_towers(model, lock_image: bool, lock_text: bool) -> None:
    """Freeze a whole tower and its projection (OpenCLIP's --lock-image / --lock-text, fully locked); SigLIP's
    towers hold their heads, and it has no projections."""
    towers = [("vision_model", "visual_projection")] * lock_image + [
        ("text_model", "text_projection")
    ] * lock_text
    for names in towers:
        for name in names:
            if hasattr(model, name):
                getattr(model, name).requires_grad_(False)


# Patch dropout (Li et al., FLIP; OpenCLIP's `--force-patch-dropout`): during training, keep the class token
# (CLIP; SigLIP has none) and a random subset of (1 - p) of the patch tokens of each image, after position
# embeddings are added, so the encoder runs on fewer tokens (faster, and a regularizer). Eval is untouched.
# HF's CLIPVisionModel has no such option, so this is a forward hook on `vision_model.embeddings` that
# replaces its output; it draws from the global torch RNG (on the embeddings' device), which
# save_state/load_state restore.


class PatchDropout:
    """The forward hook: embeddings (B, prefix + patches, D) -> (B, prefix + kept patches, D) in training."""

    def __init__(self, prob: float, prefix_tokens: int = 1):
        if not 0.0 <= prob < 1.0:
            raise ValueError(f"patch dropout probability must be in [0, 1), got {prob}")
        self.prob, self.prefix_tokens = prob, prefix_tokens  # tokens always kept: CLIP's class token

    def __call__(self, module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        if not module.training or self.prob == 0.0:
            return output
        batch, tokens, dim = output.shape
        prefix = self.prefix_tokens
        patches = tokens - prefix
        keep = max(1, int(patches * (1 - self.prob)))
        # argsort of uniform noise = an independent random subset per sample
        order = torch.rand(batch, patches, device=output.device).argsort(dim=1)[:, :keep] + prefix
        index = torch.cat([torch.arange(prefix, device=order.device).expand(batch, prefix), order], dim=1)
        return output.gather(1, index[..., None].expand(-1, -1, dim))


def add_patch_dropout(model: nn.Module, prob: float):
    """Hook patch dropout into a CLIPModel / CLIPVisionModel / SiglipModel; returns the hook handle (call
    .remove() to undo)."""
    vision = model.vision_model if hasattr(model, "vision_model") else model
    prefix = 1 if hasattr(vision.embeddings, "class_embedding") else 0  # SigLIP: every token is a patch
    return vision.embeddings.register_forward_hook(PatchDropout(prob, prefix_tokens=prefix))
