"""The data of a train_clip.py run, from its flags: the training source, the eval set, the micro-batch stream.

With no data flag the run uses the embedded synthetic shapes set (training/synthetic.py): generated on the fly,
held-out combinations for eval, nothing downloaded.
"""

from __future__ import annotations

import logging

from . import data as data_lib
from . import synthetic

logger = logging.getLogger(__name__)

# The synthetic images are drawn at twice the default model's input (training/model_setup.py); the random
# resized crop brings them down.
SYNTHETIC_IMAGE_SIZE = 64


def has_real_data(args) -> bool:
    """True when a training data flag was given (else: the synthetic set)."""
    return any((args.train_file, args.train_data_dir, args.train_shards, args.dataset_name))


def max_image_pixels(args) -> int | None:
    """--max_image_pixels for training and eval data alike (0: no cap of ours)."""
    return args.max_image_pixels or None


def load_train_source(args) -> data_lib.DataSource:
    """The training data; --max_train_samples keeps its first N samples (of the stream, when streamed)."""
    limit = args.max_train_samples
    synthetic_samples = min(args.synthetic_train_samples, limit or args.synthetic_train_samples)
    source = data_lib.load_source(
        synthetic_samples=None if has_real_data(args) else synthetic_samples,
        synthetic_image_size=SYNTHETIC_IMAGE_SIZE,
        train_file=args.train_file,
        data_dir=args.train_data_dir,
        shards=args.train_shards,
        dataset_name=args.dataset_name,
        dataset_config=args.dataset_config_name,
        split=args.train_split,
        streaming=args.streaming,
        image_column=args.image_column,
        caption_column=args.caption_column,
        seed=args.seed,
    )
    if limit is not None and has_real_data(args):
        if source.streaming:
            source.dataset = source.dataset.take(limit)
        elif limit < len(source.dataset):
            source.dataset = source.dataset.select(range(limit))
    return source


def load_eval_set(args, train_source):
    """(images, captions, labels|None), class names, templates. Synthetic: held-out distinct combinations."""
    if not has_real_data(args):
        data = synthetic.SyntheticShapes(args.max_eval_samples, image_size=SYNTHETIC_IMAGE_SIZE, split="eval")
        source = data_lib.DataSource(data, "image", "caption", streaming=False, label_column="label")
        eval_set = data_lib.load_eval_samples(source, args.max_eval_samples, max_image_pixels(args))
        return eval_set, synthetic.zeroshot_classnames(), synthetic.ZEROSHOT_TEMPLATES
    if args.validation_file or args.validation_shards or args.validation_split:
        source = data_lib.load_source(
            train_file=args.validation_file,
            shards=args.validation_shards,
            dataset_name=args.dataset_name if args.validation_split else None,
            dataset_config=args.dataset_config_name,
            split=args.validation_split or "validation",
            streaming=args.streaming,
            image_column=args.image_column,
            caption_column=args.caption_column,
        )
    else:
        logger.warning("no validation data given: evaluating on the first training samples (not held out)")
        source = train_source
    classnames = None
    if args.zeroshot_label_column:
        if args.zeroshot_label_column not in data_lib.columns_of(source.dataset):
            raise ValueError(
                f"--zeroshot_label_column {args.zeroshot_label_column!r} is not a column of the eval data"
            )
        source.label_column = args.zeroshot_label_column
        feature = (getattr(source.dataset, "features", None) or {}).get(args.zeroshot_label_column)
        classnames = (
            args.zeroshot_classnames.split(",")
            if args.zeroshot_classnames
            else getattr(feature, "names", None)
        )
        if not classnames:
            raise ValueError(
                f"--zeroshot_label_column {args.zeroshot_label_column!r} is not a ClassLabel: pass --zeroshot_classnames"
            )
    templates = tuple(args.zeroshot_templates.split("|"))
    eval_set = data_lib.load_eval_samples(source, args.max_eval_samples, max_image_pixels(args))
    return eval_set, classnames, templates


def micro_batch_stream(stream, collate, batch_size: int, num_workers: int, epoch: int, skip: int):
    """Endless (epoch, batches consumed in epoch, batch); skips the first `skip` batches of `epoch`."""
    while True:
        loader = data_lib.epoch_loader(stream, collate, batch_size, epoch, num_workers=num_workers)
        seen = 0
        for seen, batch in enumerate(loader, start=1):
            if seen > skip:
                yield epoch, seen, batch
        if seen == 0:
            raise RuntimeError(
                f"epoch {epoch} produced no full batch of {batch_size} on this rank: too little data "
                "(or every sample unreadable) for this batch size and number of processes"
            )
        epoch, skip = epoch + 1, 0
