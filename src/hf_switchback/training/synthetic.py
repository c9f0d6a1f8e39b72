"""The embedded default data set: coloured shapes with captions, generated on the fly, no downloads.

Every sample is a pure function of (seed, index), so a run is reproducible, resumable at any position, and
the same on every rank. Captions name colour, shape, size and position ("a small red circle at the top left");
some attributes are randomly left out so the text tower also sees short phrases like "a red circle", which are
the zero-shot class prompts.

Write the set as webdataset shards (the large-scale input path, exercised for real by the tests):

    python -m hf_switchback.training.synthetic --output_dir shards/ --num_samples 10000 --samples_per_shard 1000
"""

from __future__ import annotations

import argparse
import io
import itertools
import logging
import os
import random
import tarfile
from dataclasses import dataclass

from PIL import Image, ImageDraw

logger = logging.getLogger(__name__)

COLORS = {
    "red": (220, 40, 40),
    "green": (40, 190, 60),
    "blue": (50, 80, 230),
    "yellow": (235, 220, 40),
    "purple": (150, 60, 200),
    "orange": (245, 140, 20),
    "white": (245, 245, 245),
    "cyan": (40, 220, 220),
}
SHAPES = ("circle", "square", "triangle", "cross")
SIZES = ("small", "large")
# (phrase, (x, y) centre as a fraction of the image side)
POSITIONS = {
    "at the top left": (0.25, 0.25),
    "at the top": (0.5, 0.25),
    "at the top right": (0.75, 0.25),
    "on the left": (0.25, 0.5),
    "in the center": (0.5, 0.5),
    "on the right": (0.75, 0.5),
    "at the bottom left": (0.25, 0.75),
    "at the bottom": (0.5, 0.75),
    "at the bottom right": (0.75, 0.75),
}
# Zero-shot classes: colour x shape (32 classes, chance 1/32), prompted the way short captions read.
ZEROSHOT_TEMPLATES = ("a {}",)


def zeroshot_classnames() -> list[str]:
    return [f"{c} {s}" for c in COLORS for s in SHAPES]


def vocabulary() -> list[str]:
    """Every word a caption or prompt can contain (the tokenizer is built from this)."""
    words = {"a"} | set(COLORS) | set(SHAPES) | set(SIZES)
    for phrase in POSITIONS:
        words |= set(phrase.split())
    for template in ZEROSHOT_TEMPLATES:
        words |= set(template.replace("{}", "").split())
    return sorted(words)


@dataclass(frozen=True)
class ShapeSpec:
    color: str
    shape: str
    size: str
    position: str

    @property
    def label(self) -> int:
        """Index into zeroshot_classnames()."""
        return list(COLORS).index(self.color) * len(SHAPES) + SHAPES.index(self.shape)

    def caption(self, rng: random.Random | None = None) -> str:
        """The full caption, or (with rng) one with size and/or position randomly dropped."""
        size, position = self.size + " ", " " + self.position
        if rng is not None:
            size = size if rng.random() < 0.6 else ""
            position = position if rng.random() < 0.6 else ""
        return f"a {size}{self.color} {self.shape}{position}"


def all_specs() -> list[ShapeSpec]:
    return [ShapeSpec(*combo) for combo in itertools.product(COLORS, SHAPES, SIZES, POSITIONS)]


def render(spec: ShapeSpec, image_size: int, rng: random.Random) -> Image.Image:
    """Draw one shape on a plain dark background with small jitter in place, size and tint."""
    bg = rng.randint(10, 70)
    img = Image.new("RGB", (image_size, image_size), (bg, bg, bg + rng.randint(-10, 10)))
    draw = ImageDraw.Draw(img)
    fx, fy = POSITIONS[spec.position]
    cx = (fx + rng.uniform(-0.06, 0.06)) * image_size
    cy = (fy + rng.uniform(-0.06, 0.06)) * image_size
    r = (0.18 if spec.size == "large" else 0.09) * image_size * rng.uniform(0.85, 1.15)
    color = tuple(max(0, min(255, c + rng.randint(-20, 20))) for c in COLORS[spec.color])
    if spec.shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=color)
    elif spec.shape == "square":
        draw.rectangle([cx - r, cy - r, cx + r, cy + r], fill=color)
    elif spec.shape == "triangle":
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=color)
    else:  # cross
        w = r / 2.5
        draw.rectangle([cx - r, cy - w, cx + r, cy + w], fill=color)
        draw.rectangle([cx - w, cy - r, cx + w, cy + r], fill=color)
    return img


class SyntheticShapes:
    """Map-style data set of `num_samples` {"image": PIL, "caption": str, "label": int, "__key__": str}.

    split="train": random attributes, captions with random omissions. split="eval": distinct attribute
    combinations (so retrieval has exactly one right answer per query), full captions, other jitter seeds.
    """

    def __init__(self, num_samples: int, image_size: int = 64, seed: int = 0, split: str = "train"):
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        specs = all_specs()
        if split == "eval" and num_samples > len(specs):
            raise ValueError(
                f"the eval split has at most {len(specs)} distinct samples, asked for {num_samples}"
            )
        self.num_samples, self.image_size, self.seed, self.split = num_samples, image_size, seed, split
        self._eval_specs = (
            random.Random(f"eval-{seed}").sample(specs, num_samples) if split == "eval" else None
        )

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < self.num_samples:
            raise IndexError(index)
        # String seeds hash with sha512 inside `random`: stable across processes and Python runs.
        rng = random.Random(f"{self.split}-{self.seed}-{index}")
        if self._eval_specs is not None:
            spec, caption = self._eval_specs[index], self._eval_specs[index].caption()
        else:
            spec = ShapeSpec(
                rng.choice(list(COLORS)), rng.choice(SHAPES), rng.choice(SIZES), rng.choice(list(POSITIONS))
            )
            caption = spec.caption(rng)
        image = render(spec, self.image_size, rng)
        return {
            "image": image,
            "caption": caption,
            "label": spec.label,
            "__key__": f"{self.split}{index:08d}",
        }


def write_webdataset_shards(
    output_dir: str,
    num_samples: int,
    samples_per_shard: int = 1000,
    image_size: int = 64,
    seed: int = 0,
    split: str = "train",
) -> list[str]:
    """Write samples as `shard-000000.tar`, ... with members `<key>.png` and `<key>.txt` (webdataset layout)."""
    os.makedirs(output_dir, exist_ok=True)
    data = SyntheticShapes(num_samples, image_size=image_size, seed=seed, split=split)
    paths = []
    for shard, start in enumerate(range(0, num_samples, samples_per_shard)):
        path = os.path.join(output_dir, f"shard-{shard:06d}.tar")
        with tarfile.open(path, "w") as tar:
            for index in range(start, min(start + samples_per_shard, num_samples)):
                sample = data[index]
                buf = io.BytesIO()
                sample["image"].save(buf, format="PNG")
                _add_member(tar, f"{sample['__key__']}.png", buf.getvalue())
                _add_member(tar, f"{sample['__key__']}.txt", sample["caption"].encode())
        paths.append(path)
    logger.info("wrote %d samples in %d shards to %s", num_samples, len(paths), output_dir)
    return paths


def _add_member(tar: tarfile.TarFile, name: str, payload: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(payload)
    tar.addfile(info, io.BytesIO(payload))


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Write the synthetic coloured-shapes set as webdataset shards."
    )
    parser.add_argument("--output_dir", required=True, help="Folder for shard-NNNNNN.tar files.")
    parser.add_argument("--num_samples", type=int, default=10_000, help="Samples to write.")
    parser.add_argument("--samples_per_shard", type=int, default=1000, help="Samples per tar shard.")
    parser.add_argument("--image_size", type=int, default=64, help="Side of the generated square images, px.")
    parser.add_argument(
        "--seed", type=int, default=0, help="Seed of the generator (same seed, same samples)."
    )
    parser.add_argument("--split", choices=("train", "eval"), default="train", help="Which synthetic split.")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    write_webdataset_shards(
        args.output_dir, args.num_samples, args.samples_per_shard, args.image_size, args.seed, args.split
    )


if __name__ == "__main__":
    main()
