"""The model of a train_clip.py run, from its flags: CLIPModel + processor, the SwitchBack config, tower locks.

Three routes: --model_name_or_path (pretrained weights and processor), --model_config (random init from a
CLIPConfig json), or the embedded default (a CLIP small enough to learn the synthetic set on a CPU in minutes).
"""

from __future__ import annotations

import logging

from ..config import SwitchBackConfig
from . import synthetic
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
    "fuse_mlp",
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


def load_model_and_processor(args):
    """--model_name_or_path (weights + processor), --model_config (random init), or the embedded default."""
    from transformers import (
        AutoProcessor,
        AutoTokenizer,
        CLIPConfig,
        CLIPImageProcessorPil,
        CLIPModel,
        CLIPProcessor,
    )

    if args.model_name_or_path:
        clip = CLIPModel.from_pretrained(args.model_name_or_path)
        return clip, AutoProcessor.from_pretrained(args.model_name_or_path)
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
    config = CLIPConfig.from_json_file(args.model_config)
    if config.text_config.vocab_size < len(tokenizer):
        raise ValueError(
            f"--model_config has text vocab_size {config.text_config.vocab_size} < the tokenizer's {len(tokenizer)}"
        )
    side = config.vision_config.image_size
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": side}, crop_size={"height": side, "width": side}
    )
    return CLIPModel(config), CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer)


def switchback_config(args) -> SwitchBackConfig:
    """SwitchBackConfig from the --switchback_* flags; unset flags keep the library defaults."""
    fields = {name: getattr(args, name) for name in SWITCHBACK_FLAGS}
    return SwitchBackConfig(**{k: v for k, v in fields.items() if v is not None})


def lock_towers(model, lock_image: bool, lock_text: bool) -> None:
    """Freeze a whole tower and its projection (OpenCLIP's --lock-image / --lock-text, fully locked)."""
    towers = [("vision_model", "visual_projection")] * lock_image + [
        ("text_model", "text_projection")
    ] * lock_text
    for names in towers:
        for name in names:
            getattr(model, name).requires_grad_(False)
