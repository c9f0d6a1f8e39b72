"""Webdataset tar shards read as raw bytes, so that every decode happens where a bad sample can be skipped.

Why not `datasets`' own webdataset builder: it decodes `.txt` (UTF-8), `.json`, `.cls` and `.gz` members while
it reads the tar, inside the dataset's iterator. One non-UTF-8 caption or malformed JSON raises there, outside
any per-sample try, and ends the run (and again at the same position on resume); a `.gz` member is unpacked
whole into memory whatever its size; a truncated shard ends without a word. Here a shard yields
{"__key__", "__url__", <field>: bytes, ...} per sample, exactly as stored, and `data.CaptionStream` decodes
(and skips) sample by sample, as OpenCLIP's `log_and_continue` handler does.

Conventions kept from webdataset: a sample is the run of consecutive members sharing a key, the key is the
member path up to the first dot of its file name, the field is the rest ("0001.seg.png" -> "seg.png").
A `.gz` member is gunzipped here into the field without the suffix ("txt.gz" -> "txt"), at most
`max_member_bytes` of output: a decompression bomb costs one skipped sample, not the process's memory.
A sample that cannot be read whole carries "__error__" (the reason); the stream counts it as skipped.
"""

from __future__ import annotations

import gzip
import io
import logging
import os
import tarfile
import zlib
from collections.abc import Iterator

logger = logging.getLogger(__name__)

# Largest member (after gunzip) read into memory: far above any image or caption of an image-text set
# (LAION/DataComp images are tens of KB to a few MB), far below what a bomb would take.
DEFAULT_MAX_MEMBER_BYTES = 64 * 2**20
ERROR_FIELD = "__error__"


def split_member_name(name: str) -> tuple[str | None, str | None]:
    """("dir/0001", "seg.png") from "dir/0001.seg.png"; (None, None) for names without a field."""
    folder, base = os.path.split(name)
    if base.startswith(".") or "." not in base:  # hidden files (.DS_Store) and names without a field
        return None, None
    stem, field = base.split(".", 1)
    if not field:
        return None, None
    return (f"{folder}/{stem}" if folder else stem), field


def gunzip_capped(data: bytes, limit: int) -> bytes:
    """Decompress at most `limit` bytes; raise ValueError when the member holds more (or is not gzip)."""
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(data)) as f:
            out = f.read(limit + 1)
    except (OSError, EOFError, zlib.error) as err:
        raise ValueError(f"unreadable gzip member: {err}") from None
    if len(out) > limit:
        raise ValueError(
            f"gzip member unpacks to more than {limit} bytes (the member size cap, hf_switchback.training.shards.DEFAULT_MAX_MEMBER_BYTES)"
        )
    return out


def read_shard(path: str, max_member_bytes: int = DEFAULT_MAX_MEMBER_BYTES) -> Iterator[dict]:
    """The samples of one tar shard, fields as raw bytes. A truncated or corrupt shard is reported with its
    name and the number of samples read from it; the sample it broke off in is dropped."""
    sample: dict | None = None
    count = 0
    try:
        with tarfile.open(path, mode="r|*") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                key, field = split_member_name(member.name)
                if key is None:
                    continue
                if sample is not None and sample["__key__"] != key:
                    count += 1
                    yield sample
                    sample = None
                if sample is None:
                    sample = {"__key__": key, "__url__": path}
                _read_member(tar, member, field, sample, max_member_bytes)
    except (FileNotFoundError, PermissionError):
        raise  # a shard that cannot be opened is a wrong path, not damaged data: never skip it silently
    except (tarfile.TarError, EOFError, OSError, zlib.error) as err:
        logger.warning(
            "shard %s is truncated or corrupt after %d samples (%s): the rest of it is skipped",
            path,
            count,
            err,
        )
        return
    if sample is not None:
        yield sample


def _read_member(tar, member, field: str, sample: dict, limit: int) -> None:
    if member.size > limit:  # not read: the stream skips over it
        sample[ERROR_FIELD] = f"member {member.name} has {member.size} bytes (more than {limit})"
        return
    data = tar.extractfile(member).read()
    if len(data) != member.size:
        raise EOFError(f"member {member.name} ends after {len(data)} of {member.size} bytes")
    if field.lower().endswith(".gz"):
        field = field[:-3]
        try:
            data = gunzip_capped(data, limit)
        except ValueError as err:
            sample[ERROR_FIELD] = f"{member.name}: {err}"
            return
    if field in sample:
        sample[ERROR_FIELD] = f"field {field!r} twice in sample {sample['__key__']!r}"
        return
    sample[field] = data


def shard_samples(shards: list[str], max_member_bytes: int = DEFAULT_MAX_MEMBER_BYTES) -> Iterator[dict]:
    """Generator for `datasets.IterableDataset.from_generator`: the `shards` list is what datasets splits
    across ranks (split_dataset_by_node) and dataloader workers, and shuffles, as with its own builder."""
    for path in shards:
        yield from read_shard(path, max_member_bytes)
