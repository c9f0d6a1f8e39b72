"""The graded-shapes task: captioned shapes rendered in torch, in batches, on any device.

Difficulty is graded (14 colours, some close: green / lime / teal; 10 shapes; three sizes, tiny ones a few pixels
wide; jittered position and tint; pixel noise), so the loss falls steadily rather than in one drop; a batch is a
pure function of (seed, step); the eval set can be as large as wanted. Tasks are subsets of colours and shapes:
PRETRAIN and the shifted FINETUNE (new colours, 4 new shapes, new words), and ALL for training from scratch.
Zero-shot classes are colour x shape; image->caption retrieval looks for the one full caption of each image.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from hf_switchback.training import synthetic

COLORS = {
    # the pretraining colours: the default set's eight
    **synthetic.COLORS,
    # the fine-tuning colours: new words, several close to a pretraining colour
    "pink": (250, 120, 190),
    "brown": (140, 85, 35),
    "lime": (160, 245, 30),
    "navy": (30, 30, 140),
    "teal": (20, 140, 130),
    "olive": (130, 130, 20),
}
SHAPES = ("circle", "square", "triangle", "cross", "diamond", "ring", "frame", "bar", "pillar", "saltire")
# radius of the shape's bounding box as a fraction of the image side
SIZES = {"tiny": 0.09, "small": 0.15, "large": 0.24}
# the default set's nine positions, pulled 8% towards the centre so that large shapes stay inside the image
POSITIONS = {
    phrase: (0.5 + 0.92 * (x - 0.5), 0.5 + 0.92 * (y - 0.5)) for phrase, (x, y) in synthetic.POSITIONS.items()
}
PROMPT = "a {}"


@dataclass(frozen=True)
class Task:
    """Which colours and shapes a task draws from (names from COLORS and SHAPES)."""

    name: str
    colors: tuple[str, ...]
    shapes: tuple[str, ...]

    def classnames(self) -> list[str]:
        """Zero-shot classes, colour-major: label = colour index * len(shapes) + shape index."""
        return [f"{c} {s}" for c in self.colors for s in self.shapes]

    def full_captions(self) -> list[str]:
        """Every full caption, in the order of `caption_index`."""
        return [
            f"a {size} {c} {s} {pos}"
            for size, c, s, pos in itertools.product(SIZES, self.colors, self.shapes, POSITIONS)
        ]


PRETRAIN = Task("pretrain", tuple(COLORS)[:8], SHAPES[:6])
FINETUNE = Task("finetune", tuple(COLORS)[8:], SHAPES)
ALL = Task("all", tuple(COLORS), SHAPES)
TASKS = {t.name: t for t in (PRETRAIN, FINETUNE, ALL)}


def vocabulary() -> list[str]:
    """Every word of every task's captions and prompts: one tokenizer serves pretraining and fine-tuning."""
    words = {"a"} | set(COLORS) | set(SHAPES) | set(SIZES)
    for phrase in POSITIONS:
        words |= set(phrase.split())
    return sorted(words)


def caption_table(task: Task) -> list[str]:
    """All captions of a task, short ones included, indexed by caption_index (size / position may be left out:
    index 0 of each means "left out")."""
    sizes, positions = ("", *SIZES), ("", *POSITIONS)
    return [
        " ".join(w for w in ("a", size, c, s, pos) if w)
        for size, c, s, pos in itertools.product(sizes, task.colors, task.shapes, positions)
    ]


def caption_index(task: Task, size, color, shape, position, keep_size, keep_position) -> torch.Tensor:
    """Row of caption_table(task) for attribute indices (tensors); keep_* False drops that attribute."""
    n_c, n_s, n_p = len(task.colors), len(task.shapes), len(POSITIONS)
    size_slot = torch.where(keep_size, size + 1, torch.zeros_like(size))
    pos_slot = torch.where(keep_position, position + 1, torch.zeros_like(position))
    return ((size_slot * n_c + color) * n_s + shape) * (n_p + 1) + pos_slot


def full_caption_index(task: Task, size, color, shape, position) -> torch.Tensor:
    """Row of task.full_captions() for attribute indices."""
    return ((size * len(task.colors) + color) * len(task.shapes) + shape) * len(POSITIONS) + position


def _shape_masks(u: torch.Tensor, v: torch.Tensor, shape: torch.Tensor) -> torch.Tensor:
    """(B, H, W) bool: the pixels inside each image's shape; u, v are coordinates in units of its radius."""
    au, av = u.abs(), v.abs()
    box = torch.maximum(au, av)
    radial = torch.sqrt(u * u + v * v)
    masks = torch.stack(
        [
            radial <= 1.0,  # circle
            box <= 0.85,  # square
            (v <= 0.9) & (v >= -1.0) & (au <= (v + 1.0) / 1.9),  # triangle, apex up
            ((au <= 0.33) & (av <= 1.0)) | ((av <= 0.33) & (au <= 1.0)),  # cross
            au + av <= 1.0,  # diamond
            (radial <= 1.0) & (radial >= 0.55),  # ring
            (box <= 0.9) & (box >= 0.55),  # frame (hollow square)
            (av <= 0.35) & (au <= 1.0),  # bar (horizontal)
            (au <= 0.35) & (av <= 1.0),  # pillar (vertical)
            (((u - v).abs() <= 0.42) | ((u + v).abs() <= 0.42)) & (box <= 0.85),  # saltire (diagonal cross)
        ]
    )
    return masks.gather(0, shape.view(1, -1, 1, 1).expand(1, *u.shape)).squeeze(0)


def render(color, shape, size, position, image_size: int, generator: torch.Generator) -> torch.Tensor:
    """(B, 3, image_size, image_size) float images in [0, 1] for attribute indices (B,) into COLORS, SHAPES,
    SIZES and POSITIONS, jittered (centre, radius, tint, background, noise) by `generator`, on its device.
    Rendered at 2x and averaged down, so edges are anti-aliased and tiny shapes stay legible."""
    device, batch = color.device, color.shape[0]

    def uniform(*shape_, low=0.0, high=1.0):
        return torch.rand(*shape_, generator=generator, device=device) * (high - low) + low

    side = 2 * image_size
    centres = torch.tensor(list(POSITIONS.values()), device=device)[position]  # (B, 2) fractions
    centres = (centres + uniform(batch, 2, low=-0.05, high=0.05)) * side
    radius = (
        torch.tensor(list(SIZES.values()), device=device)[size] * side * uniform(batch, low=0.88, high=1.12)
    )
    grid = torch.arange(side, device=device, dtype=torch.float32) + 0.5
    u = (grid.view(1, 1, side) - centres[:, 0].view(-1, 1, 1)) / radius.view(-1, 1, 1)
    v = (grid.view(1, side, 1) - centres[:, 1].view(-1, 1, 1)) / radius.view(-1, 1, 1)
    mask = _shape_masks(u.expand(batch, side, side), v.expand(batch, side, side), shape).float()
    rgb = torch.tensor(list(COLORS.values()), device=device, dtype=torch.float32)[color] / 255.0
    rgb = (rgb + uniform(batch, 3, low=-0.06, high=0.06)).clamp(0, 1)
    background = uniform(batch, 1, low=0.04, high=0.28).expand(batch, 3)
    image = background.view(batch, 3, 1, 1) + (rgb - background).view(batch, 3, 1, 1) * mask.unsqueeze(1)
    image = torch.nn.functional.avg_pool2d(image, 2)
    noise = torch.randn(batch, 3, image_size, image_size, generator=generator, device=device) * 0.04
    return (image + noise).clamp(0, 1)


@dataclass
class Batch:
    pixels: torch.Tensor  # (B, 3, S, S) in [0, 1]
    caption: torch.Tensor  # (B,) rows of caption_table (train) or of task.full_captions (eval)
    label: torch.Tensor  # (B,) zero-shot class (colour x shape)


def sample(task: Task, batch: int, image_size: int, generator: torch.Generator, full: bool = False) -> Batch:
    """One batch of the task: uniform attributes; captions keep size / position with probability 0.6 each
    (full=True: full captions, indexed into task.full_captions())."""
    device = generator.device

    def pick(n):
        return torch.randint(n, (batch,), generator=generator, device=device)

    color, shape, size, position = pick(len(task.colors)), pick(len(task.shapes)), pick(len(SIZES)), pick(9)
    keep = torch.rand(2, batch, generator=generator, device=device) < 0.6
    global_color = torch.tensor([list(COLORS).index(c) for c in task.colors], device=device)[color]
    global_shape = torch.tensor([SHAPES.index(s) for s in task.shapes], device=device)[shape]
    pixels = render(global_color, global_shape, size, position, image_size, generator)
    if full:
        caption = full_caption_index(task, size, color, shape, position)
    else:
        caption = caption_index(task, size, color, shape, position, keep[0], keep[1])
    return Batch(pixels, caption, color * len(task.shapes) + shape)


def step_generator(device: torch.device | str, seed: int, step: int, stream: int = 0) -> torch.Generator:
    """The generator of one training step: batches depend on (seed, step) only, not on what ran before."""
    generator = torch.Generator(device=device)
    generator.manual_seed(((seed * 1_000_003 + step) * 7 + stream) % (2**63))
    return generator


EVAL_STREAM = 5  # eval sets draw from their own stream, never equal to a training step's


def eval_batches(task: Task, num_samples: int, image_size: int, device, seed: int = 0, chunk: int = 1000):
    """The eval set (full captions) in chunks; the same images for the same (task, num_samples, seed)."""
    for start in range(0, num_samples, chunk):
        generator = step_generator(device, 10_000 + seed, start, EVAL_STREAM)
        yield sample(task, min(chunk, num_samples - start), image_size, generator, full=True)
