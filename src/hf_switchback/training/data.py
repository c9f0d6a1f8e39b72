"""Training and eval data: anything `datasets` loads, turned into fixed-size batches of pixels + token ids.

Sources (pick one; the training script maps its flags to `load_source`):
- the embedded synthetic set (map-style, generated on the fly);
- CSV / JSON(L) files with an image path column and a caption column (paths relative to the file's folder);
- `imagefolder` with a metadata.csv/jsonl (file_name + caption);
- webdataset tar shards, streamed: shards are split across ranks (`split_dataset_by_node`) and across
  dataloader workers (datasets does that inside each worker), so no sample is read twice within an epoch;
- any Hub data set by name (streaming or not).

`CaptionStream` is the one iterable all of them go through. It decodes images itself (the `Image` feature is
cast to `decode=False`; shards are read as raw bytes by `shards.py`), so an unreadable or empty sample (bad
image, non-UTF-8 text, malformed JSON, an image over the pixel limit, an oversized or corrupt `.gz` member) is
skipped, counted and logged (rate-limited) instead of ending the run, as OpenCLIP's `log_and_continue` does;
the count rides along in each batch ("num_skipped"). Batches always have the full batch size: ranks must
all-gather equal-sized features in the contrastive loss.

Augmentation is in PIL + torch (torchvision is not a dependency): for training a random resized crop
(OpenCLIP's scale range), no flip (captions say "left" and "right"), then the processor's mean/std; eval uses
the model's own image processor. The crop is drawn from a generator seeded by (seed, epoch, sample key), not
from the global RNG: augmentation is then identical whichever worker or rank decodes the sample.

Position in the data is (epoch, batches consumed in that epoch), per rank; resuming replays the epoch's
order and drops the consumed batches, which is exact because order and augmentation depend only on
(seed, epoch, sample key).
"""

from __future__ import annotations

import codecs
import glob
import io
import json
import logging
import math
import os
import random
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from PIL import Image

from .shards import DEFAULT_MAX_MEMBER_BYTES, ERROR_FIELD, shard_samples

logger = logging.getLogger(__name__)

IMAGE_COLUMNS = ("image", "jpg", "png", "jpeg", "webp", "img")
# Images with more pixels are skipped before they are decoded. PIL's own default (Image.MAX_IMAGE_PIXELS,
# 89,478,485 = 1 GiB of 32-bit pixels / 4 / 3) only warns up to twice that: a 12000 x 12000 image still
# decodes (+1.1 GB, seconds each). Here PIL's warning level is the hard limit; PIL still refuses anything
# above twice its own limit whatever this is set to.
DEFAULT_MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS
CAPTION_COLUMNS = ("caption", "txt", "text", "captions", "sentences")


@dataclass
class DataSource:
    """A data set plus how to read it. `dataset` is map-style (len + getitem) or a datasets.IterableDataset."""

    dataset: object
    image_column: str
    caption_column: str
    streaming: bool
    base_dir: str | None = None  # where relative image paths (CSV/JSON) are resolved
    label_column: str | None = None


def _pick_column(columns, wanted: str | None, candidates, what: str) -> str:
    if wanted is not None:
        if wanted not in columns:
            raise ValueError(f"{what} column {wanted!r} not found; the data has columns {sorted(columns)}")
        return wanted
    for name in candidates:
        if name in columns:
            return name
    raise ValueError(
        f"no {what} column found among {sorted(columns)}; pass --{what}_column (looked for {list(candidates)})"
    )


def columns_of(dataset) -> list[str]:
    """Column names of a datasets.Dataset / IterableDataset (peeks at one example if undeclared)."""
    if getattr(dataset, "column_names", None):
        return list(dataset.column_names)
    if getattr(dataset, "features", None):
        return list(dataset.features)
    # Streaming sets without declared features (some webdataset shards): peek at the first example.
    return list(next(iter(dataset)).keys())


def from_hf_dataset(dataset, *, image_column=None, caption_column=None, label_column=None, base_dir=None):
    """Wrap a datasets.Dataset / IterableDataset; turns off its image decoding so we can skip bad samples."""
    import datasets

    columns = columns_of(dataset)
    image_column = _pick_column(columns, image_column, IMAGE_COLUMNS, "image")
    if label_column is not None and label_column not in columns:
        raise ValueError(f"label column {label_column!r} not found; the data has columns {sorted(columns)}")
    caption_column = _pick_column(columns, caption_column, CAPTION_COLUMNS, "caption")
    streaming = isinstance(dataset, datasets.IterableDataset)
    features = getattr(dataset, "features", None)
    if features is not None and image_column in features:
        if isinstance(features[image_column], datasets.Image):
            dataset = dataset.cast_column(image_column, datasets.Image(decode=False))
    elif streaming and features is not None:  # (raw-bytes shards declare no features: nothing to decode)
        dataset = dataset.decode(False)
    return DataSource(dataset, image_column, caption_column, streaming, base_dir, label_column)


def load_source(
    *,
    synthetic_samples: int | None = None,
    synthetic_image_size: int = 64,
    train_file: str | None = None,
    data_dir: str | None = None,
    shards: str | list[str] | None = None,
    dataset_name: str | None = None,
    dataset_config: str | None = None,
    split: str = "train",
    streaming: bool = False,
    image_column: str | None = None,
    caption_column: str | None = None,
    label_column: str | None = None,
    seed: int = 0,
    max_member_bytes: int = DEFAULT_MAX_MEMBER_BYTES,
) -> DataSource:
    """Exactly one of synthetic_samples / train_file / data_dir / shards / dataset_name."""
    given = [synthetic_samples, train_file, data_dir, shards, dataset_name]
    if sum(x is not None for x in given) != 1:
        raise ValueError(
            "pass exactly one data source (synthetic, train_file, data_dir, shards, dataset_name)"
        )
    if synthetic_samples is not None:
        from .synthetic import SyntheticShapes

        data = SyntheticShapes(synthetic_samples, image_size=synthetic_image_size, seed=seed, split="train")
        return DataSource(data, "image", "caption", streaming=False, label_column="label")

    import datasets

    if train_file is not None:
        ext = train_file.rsplit(".", 1)[-1].lower()
        builder = {"csv": "csv", "tsv": "csv", "json": "json", "jsonl": "json"}.get(ext)
        if builder is None:
            raise ValueError(f"train file must be .csv, .tsv, .json or .jsonl, got {train_file!r}")
        kwargs = {"delimiter": "\t"} if ext == "tsv" else {}
        # datasets would refuse the whole file for one non-UTF-8 caption; read such bytes as U+FFFD instead,
        # and the row is skipped and counted like an unreadable image (pick_caption)
        kwargs["encoding_errors"] = "replace"
        if builder == "json":
            check_json_array_encoding(train_file)
            # The JSON builder applies encoding_errors only when it re-decodes, which it does for any encoding
            # but "utf-8": "utf-8-sig" is UTF-8 that also drops a leading byte-order mark.
            kwargs["encoding"] = "utf-8-sig"
        ds = datasets.load_dataset(
            builder, data_files=train_file, split="train", streaming=streaming, **kwargs
        )
        base_dir = os.path.dirname(os.path.abspath(train_file))
        return from_hf_dataset(
            ds, image_column=image_column, caption_column=caption_column, base_dir=base_dir
        )
    if data_dir is not None:
        ds = datasets.load_dataset("imagefolder", data_dir=data_dir, split=split, streaming=streaming)
        return from_hf_dataset(
            ds, image_column=image_column, caption_column=caption_column, label_column=label_column
        )
    if shards is not None:
        files = expand_shards(shards)
        # Raw bytes from our own tar reader (shards.py says why); a list in gen_kwargs makes every shard a
        # unit that datasets shuffles and splits across ranks and workers.
        ds = datasets.IterableDataset.from_generator(
            shard_samples, gen_kwargs={"shards": files, "max_member_bytes": max_member_bytes}
        )
        return from_hf_dataset(
            ds, image_column=image_column, caption_column=caption_column, label_column=label_column
        )
    ds = datasets.load_dataset(dataset_name, dataset_config, split=split, streaming=streaming)
    return from_hf_dataset(
        ds, image_column=image_column, caption_column=caption_column, label_column=label_column
    )


def check_json_array_encoding(path: str) -> None:
    """Raise ValueError naming the first non-UTF-8 byte of a JSON file that holds one array (`[{...}, ...]`).

    datasets parses such a file whole, before any decoding, so one bad byte would end the load with a message
    naming neither the file nor the place; JSON Lines rows are decoded line by line (bad ones are skipped).
    """
    with open(path, "rb") as f:
        if not f.read(4096).removeprefix(codecs.BOM_UTF8).lstrip().startswith(b"["):
            return
        f.seek(0)
        data = f.read()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        column = err.start - data.rfind(b"\n", 0, err.start)
        raise ValueError(
            f"{path}: byte 0x{data[err.start]:02x} at line {line}, column {column} (offset {err.start}) is "
            "not UTF-8, and a JSON file holding one array is read whole: re-encode it to UTF-8 (from Latin-1: "
            f"`iconv -f latin1 -t utf-8 {path} > fixed.json`), or write JSON Lines (.jsonl, one object a "
            "line), where a row with such bytes is skipped and counted"
        ) from None


def expand_shards(shards: str | list[str]) -> list[str]:
    """A glob, a comma-separated list, a folder (all *.tar in it), or a list -> sorted existing files."""
    if isinstance(shards, str):
        if os.path.isdir(shards):
            patterns = [os.path.join(shards, "*.tar")]
        else:
            patterns = [p for p in shards.split(",") if p]
    else:
        patterns = list(shards)
    files = sorted({f for p in patterns for f in (glob.glob(p) or ([p] if os.path.exists(p) else []))})
    if not files:
        raise FileNotFoundError(f"no webdataset shards match {shards!r}")
    return files


def decode_image(
    value, base_dir: str | None = None, max_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS
) -> Image.Image:
    """PIL image / {"bytes", "path"} / raw bytes / path -> fully loaded RGB image. Raises on bad data, and on
    images over `max_pixels` (checked from the header, before decoding; None: no limit of ours)."""
    if isinstance(value, Image.Image):
        image = value
    elif isinstance(value, dict) and value.get("bytes"):
        image = Image.open(io.BytesIO(value["bytes"]))
    elif isinstance(value, (bytes, bytearray)):
        image = Image.open(io.BytesIO(value))
    else:
        path = value.get("path") if isinstance(value, dict) else value
        if not isinstance(path, str) or not path:
            raise ValueError(f"no image in {type(value).__name__}")
        if base_dir is not None and not os.path.isabs(path) and "://" not in path:
            path = os.path.join(base_dir, path)
        image = Image.open(path)
    if max_pixels is not None and image.width * image.height > max_pixels:
        raise ValueError(
            f"image of {image.width}x{image.height} pixels is over the limit of {max_pixels} (--max_image_pixels)"
        )
    image.load()  # truncated files fail here, not later in a worker's transform
    return image.convert("RGB")


def field_value(example: dict, column: str):
    """example[column], raw webdataset bytes decoded by the field's extension: JSON (".json") parsed, text
    as UTF-8. Raises on a sample the shard reader marked unreadable, and on undecodable bytes."""
    if ERROR_FIELD in example:
        raise ValueError(example[ERROR_FIELD])
    value = example.get(column)
    if isinstance(value, (bytes, bytearray)) and column.lower().rsplit(".", 1)[-1] == "json":
        value = json.loads(value.decode("utf-8"))
    return value


REPLACEMENT_CHAR = "\ufffd"


def pick_caption(value, rng: random.Random) -> str:
    """A caption string; a list (several captions per image, as COCO) gives one at random."""
    if isinstance(value, (bytes, bytearray)):
        value = value.decode("utf-8")
    if isinstance(value, (list, tuple)):
        value = rng.choice(value) if value else None
        if isinstance(value, (bytes, bytearray)):
            value = value.decode("utf-8")
    if not isinstance(value, str) or not value.strip():
        raise ValueError("empty or missing caption")
    if (
        REPLACEMENT_CHAR in value
    ):  # what undecodable bytes became (CSV and JSON files are read with errors="replace")
        raise ValueError(f"caption holds bytes that are not UTF-8 (read as U+FFFD): {value[:60]!r}")
    return value.strip()


# Training augmentation, drawn from each sample's own generator (sample_rng; the module docstring says why).


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


class CaptionStream(torch.utils.data.IterableDataset):
    """One rank's share of one epoch, as {"pixel_values", "caption", "__key__", "skipped"} samples.

    Map-style sources: a permutation of all indices seeded by (seed, epoch), cut to a multiple of the world
    size, rank r taking positions r, r+world, ...; those are cut into blocks of `worker_block` samples (the
    batch size, set by epoch_loader) and dataloader worker w of W takes blocks w, w+W, ... The DataLoader
    collects each batch inside one worker and takes batches from the workers in turn, so every batch holds
    the same samples whatever --num_workers is (until a worker skips an unreadable sample).
    Streaming sources: shard-level (and buffer) shuffling by datasets with the same seeds on every rank,
    then `split_dataset_by_node`; datasets splits shards across workers itself.
    """

    def __init__(
        self,
        source: DataSource,
        transform: Callable,
        *,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        shuffle_buffer: int = 1000,
        max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS,
    ):
        super().__init__()
        self.source, self.transform = source, transform
        self.max_image_pixels = max_image_pixels
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.shuffle, self.shuffle_buffer = shuffle, shuffle_buffer
        self.epoch = 0
        self.worker_block = 1

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def set_worker_block(self, samples: int) -> None:
        """Samples each dataloader worker takes in a row: the batch size, so batches do not depend on workers."""
        if samples < 1:
            raise ValueError(f"worker_block must be >= 1 sample, got {samples}")
        self.worker_block = samples

    def _raw(self) -> Iterator[tuple[str, dict]]:
        if self.source.streaming:
            from datasets.distributed import split_dataset_by_node

            ds = self.source.dataset
            if self.shuffle:
                # The epoch goes into the seed (not set_epoch), so it is fixed when the stream is built and
                # survives the copies that split_dataset_by_node and the dataloader workers make.
                ds = ds.shuffle(seed=self.seed * 100_003 + self.epoch, buffer_size=self.shuffle_buffer)
            ds = split_dataset_by_node(ds, rank=self.rank, world_size=self.world_size)
            for i, example in enumerate(ds):
                yield str(example.get("__key__", f"{self.rank}-{i}")), example
            return
        n = len(self.source.dataset)
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
            order = torch.randperm(n, generator=generator).tolist()
        else:
            order = list(range(n))
        order = order[: n - n % self.world_size][self.rank :: self.world_size]
        worker = torch.utils.data.get_worker_info()
        if worker is not None:
            # Whole blocks per worker, not every W-th sample: with the latter, batch b would hold the samples
            # of worker b % W, and changing --num_workers would change what every batch contains (and with it a
            # seeded run's result).
            block, stride = self.worker_block, self.worker_block * worker.num_workers
            start = worker.id * block
            order = [i for b in range(start, len(order), stride) for i in order[b : b + block]]
        for index in order:
            example = self.source.dataset[index]
            yield str(example.get("__key__", index)), example

    def __iter__(self):
        # One sample of look-ahead: skips after the last good sample of a worker's stream are added to that
        # sample rather than lost with the stream's end.
        held, skipped = None, 0
        skip_log = SkipLog(f"rank {self.rank}")
        for key, example in self._raw():
            rng = sample_rng(self.seed, self.epoch, key)
            try:
                caption = pick_caption(field_value(example, self.source.caption_column), rng)
                image = decode_image(
                    field_value(example, self.source.image_column),
                    self.source.base_dir,
                    self.max_image_pixels,
                )
                pixel_values = self.transform(image, rng)
            except Exception as err:  # any unreadable sample: skip, count, keep training
                skip_log.add(key, err, example.get("__url__"))
                if held is None:
                    skipped += 1
                else:
                    held["skipped"] += 1
                continue
            if held is not None:
                yield held
            held = {"pixel_values": pixel_values, "caption": caption, "__key__": key, "skipped": skipped}
            skipped = 0
        if held is not None:
            yield held


class SkipLog:
    """Rate-limited log of skipped samples: the first `first` in full, then one line at every power of two
    with the counts by error type, so a shard full of bad samples cannot flood the log."""

    def __init__(self, where: str, first: int = 5):
        self.where, self.first = where, first
        self.total, self.by_type = 0, Counter()

    def add(self, key: str, err: Exception, shard: str | None = None) -> None:
        self.total += 1
        self.by_type[type(err).__name__] += 1
        if self.total <= self.first:
            origin = f" of {shard}" if shard else ""
            logger.warning(
                "%s: skipping sample %s%s: %s: %s", self.where, key, origin, type(err).__name__, err
            )
        elif self.total & (self.total - 1) == 0:
            logger.warning(
                "%s: %d samples skipped so far (%s)", self.where, self.total, dict(self.by_type.most_common())
            )


class Collate:
    """Stack pixels, tokenize captions to a fixed length (every rank gathers same-shaped tensors)."""

    def __init__(self, tokenizer, max_length: int):
        self.tokenizer, self.max_length = tokenizer, max_length

    def __call__(self, samples: list[dict]) -> dict:
        tokens = self.tokenizer(
            [s["caption"] for s in samples],
            padding="max_length",
            truncation=True,
            max_length=self.max_length,
            return_tensors="pt",
        )
        return {
            "pixel_values": torch.stack([s["pixel_values"] for s in samples]),
            "input_ids": tokens["input_ids"],
            "attention_mask": tokens["attention_mask"],
            "num_skipped": torch.tensor(sum(s["skipped"] for s in samples)),
            "keys": [s["__key__"] for s in samples],
        }


def epoch_loader(stream: CaptionStream, collate: Collate, batch_size: int, epoch: int, num_workers: int = 0):
    """A DataLoader over one epoch of `stream`: full batches only (drop_last), order fixed by (seed, epoch)."""
    stream.set_epoch(epoch)
    stream.set_worker_block(batch_size)
    return torch.utils.data.DataLoader(
        stream,
        batch_size=batch_size,
        collate_fn=collate,
        num_workers=num_workers,
        drop_last=True,
        persistent_workers=False,
        # Worker base seeds come from this generator, not the global RNG: creating the loader on resume must
        # not shift the global RNG stream that patch dropout and the model draw from.
        generator=torch.Generator().manual_seed(stream.seed * 100_003 + epoch),
    )


def load_eval_samples(
    source: DataSource, max_samples: int, max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS
) -> tuple[list[Image.Image], list[str], list[int] | None]:
    """The first `max_samples` readable (image, caption[, label]) triples, decoded, for the evaluator. Images
    over `max_image_pixels` (None: no cap of ours) are skipped before decoding, as in training."""
    images, captions, labels = [], [], []
    rng = random.Random(0)
    skip_log = SkipLog("eval")
    iterator = (
        iter(source.dataset) if source.streaming else (source.dataset[i] for i in range(len(source.dataset)))
    )
    # row: the example's position in the eval data (not the count kept so far), so a warning names the row to fix
    for row, example in enumerate(iterator):
        if len(images) >= max_samples:
            break
        try:
            caption = pick_caption(field_value(example, source.caption_column), rng)
            image = decode_image(field_value(example, source.image_column), source.base_dir, max_image_pixels)
            label = (
                int(field_value(example, source.label_column)) if source.label_column is not None else None
            )
        except Exception as err:
            skip_log.add(str(example.get("__key__", f"row {row}")), err, example.get("__url__"))
            continue
        images.append(image)
        captions.append(caption)
        if label is not None:
            labels.append(label)
    return images, captions, (labels if source.label_column is not None else None)
