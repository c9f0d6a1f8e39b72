"""Image transforms in PIL + torch (torchvision is not a dependency).

Training: random resized crop (OpenCLIP's scale range), no flip (captions say "left" and "right"), then the
processor's mean/std. The crop is drawn from a generator seeded by (seed, epoch, sample key), not from the
global RNG: augmentation is then identical whichever worker or rank decodes the sample, and skipping batches
on resume cannot shift the randomness of the batches after them.
Eval: the model's own image processor (resize shortest edge, center crop, normalize).
"""

from __future__ import annotations

import math
import random

import torch
from PIL import Image


class RandomResizedCrop:
    """Crop a random area fraction in `scale` with aspect ratio in `ratio`, resize to size x size (bicubic)."""

    def __init__(self, size: int, scale=(0.9, 1.0), ratio=(3 / 4, 4 / 3)):
        self.size, self.scale, self.ratio = size, scale, ratio

    def __call__(self, image: Image.Image, rng: random.Random) -> Image.Image:
        width, height = image.size
        area = width * height
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for _ in range(10):
            target_area = area * rng.uniform(*self.scale)
            aspect = math.exp(rng.uniform(*log_ratio))
            w = round(math.sqrt(target_area * aspect))
            h = round(math.sqrt(target_area / aspect))
            if 0 < w <= width and 0 < h <= height:
                left, top = rng.randint(0, width - w), rng.randint(0, height - h)
                return image.resize((self.size, self.size), Image.BICUBIC, box=(left, top, left + w, top + h))
        # Fallback as in the usual implementations: the largest center crop of valid aspect ratio.
        side = min(width, height)
        left, top = (width - side) // 2, (height - side) // 2
        return image.resize((self.size, self.size), Image.BICUBIC, box=(left, top, left + side, top + side))


class TrainTransform:
    """PIL image (any mode) + per-sample generator -> float32 (3, size, size), normalized."""

    def __init__(self, size: int, mean, std, scale=(0.9, 1.0)):
        self.crop = RandomResizedCrop(size, scale=scale)
        self.mean = torch.tensor(mean, dtype=torch.float32).view(3, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(3, 1, 1)

    def __call__(self, image: Image.Image, rng: random.Random) -> torch.Tensor:
        image = self.crop(image.convert("RGB"), rng)
        pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
        pixels = pixels.view(image.size[1], image.size[0], 3).permute(2, 0, 1).float().div_(255)
        return (pixels - self.mean) / self.std


def train_transform_for(image_processor, image_size: int, scale=(0.9, 1.0)) -> TrainTransform:
    """A TrainTransform with the normalization constants of a CLIP image processor."""
    return TrainTransform(image_size, image_processor.image_mean, image_processor.image_std, scale=scale)


def sample_rng(seed: int, epoch: int, key: str) -> random.Random:
    """The augmentation generator of one sample in one epoch (stable across processes)."""
    return random.Random(f"{seed}-{epoch}-{key}")
