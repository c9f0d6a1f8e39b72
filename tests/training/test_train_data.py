"""Data: webdataset shards written by the tool, streamed back by 2 ranks x 2 workers; corrupt samples; crops."""

import io
import random
import tarfile

import pytest
import torch
from PIL import Image

from hf_switchback.training.data import (
    CaptionStream,
    Collate,
    RandomResizedCrop,
    TrainTransform,
    epoch_loader,
    load_source,
)
from hf_switchback.training.synthetic import SyntheticShapes, vocabulary, write_webdataset_shards
from hf_switchback.training.tokenizer import build_word_tokenizer

TRANSFORM = TrainTransform(32, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))


def add_member(tar, name, payload: bytes):
    info = tarfile.TarInfo(name)
    info.size = len(payload)
    tar.addfile(info, io.BytesIO(payload))


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """4 shards x 10 good samples; shard 1 gets a corrupt image, shard 2 an empty caption."""
    folder = tmp_path_factory.mktemp("shards")
    paths = write_webdataset_shards(str(folder), num_samples=40, samples_per_shard=10, image_size=32)
    with tarfile.open(paths[1], "a") as tar:
        add_member(tar, "bad_image.png", b"\x89PNG\r\n\x1a\n this is not a png")
        add_member(tar, "bad_image.txt", b"a red circle")
    with tarfile.open(paths[2], "a") as tar:
        buf = io.BytesIO()
        Image.new("RGB", (32, 32)).save(buf, format="PNG")
        add_member(tar, "no_caption.png", buf.getvalue())
        add_member(tar, "no_caption.txt", b"   ")
    return folder


def read_epoch(source, rank, world, epoch=0, num_workers=2):
    stream = CaptionStream(source, TRANSFORM, seed=0, rank=rank, world_size=world)
    stream.set_epoch(epoch)
    loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=num_workers)
    keys, skipped = [], 0
    for sample in loader:
        keys.append(sample["__key__"])
        skipped += int(sample["skipped"])
        assert sample["pixel_values"].shape == (3, 32, 32)
    return keys, skipped


def test_two_ranks_stream_every_sample_once(shards):
    source = load_source(shards=str(shards))
    assert source.streaming
    expected = {f"train{i:08d}" for i in range(40)}
    for epoch in (0, 1):
        keys0, skipped0 = read_epoch(source, 0, 2, epoch)
        keys1, skipped1 = read_epoch(source, 1, 2, epoch)
        assert len(keys0) == len(set(keys0)) and len(keys1) == len(set(keys1))
        assert not set(keys0) & set(keys1), "a sample was read by both ranks"
        assert set(keys0) | set(keys1) == expected, "a sample was lost"
        assert skipped0 + skipped1 == 2  # the corrupt image and the empty caption
    # a new epoch reshuffles (different order on at least one rank)
    assert read_epoch(source, 0, 2, 0)[0] != read_epoch(source, 0, 2, 1)[0] or (
        read_epoch(source, 1, 2, 0)[0] != read_epoch(source, 1, 2, 1)[0]
    )


def test_batches_are_full_and_count_skipped(shards):
    source = load_source(shards=str(shards))
    tokenizer = build_word_tokenizer(vocabulary())
    stream = CaptionStream(source, TRANSFORM, seed=0, rank=0, world_size=1)
    batches = list(epoch_loader(stream, Collate(tokenizer, 12), batch_size=5, epoch=0, num_workers=2))
    assert all(b["pixel_values"].shape == (5, 3, 32, 32) and b["input_ids"].shape == (5, 12) for b in batches)
    assert sum(int(b["num_skipped"]) for b in batches) == 2
    assert sum(len(b["keys"]) for b in batches) == 40
    # every caption ends with <end_of_text> before padding: the text tower pools there
    ids = batches[0]["input_ids"]
    assert ((ids == tokenizer.eos_token_id).sum(dim=1) == 1).all()


def test_map_style_ranks_partition_and_replay_exactly():
    source = load_source(synthetic_samples=30, synthetic_image_size=32)
    keys = [read_epoch(source, r, 2, num_workers=2)[0] for r in range(2)]
    assert len(keys[0]) == len(keys[1]) == 15 and not set(keys[0]) & set(keys[1])
    # same (seed, epoch) -> same order and the same augmented pixels, whatever the number of workers
    s1 = next(iter(CaptionStream(source, TRANSFORM, rank=1, world_size=2)))
    s2 = next(iter(CaptionStream(source, TRANSFORM, rank=1, world_size=2)))
    assert s1["__key__"] == s2["__key__"] and torch.equal(s1["pixel_values"], s2["pixel_values"])


def test_batches_do_not_depend_on_the_number_of_workers():
    source = load_source(synthetic_samples=46, synthetic_image_size=32)
    tokenizer = build_word_tokenizer(vocabulary())

    def batch_keys(num_workers, rank=0, world=1, batch_size=4):
        stream = CaptionStream(source, TRANSFORM, seed=3, rank=rank, world_size=world)
        collate = Collate(tokenizer, 12)
        loader = epoch_loader(stream, collate, batch_size=batch_size, epoch=1, num_workers=num_workers)
        return [b["keys"] for b in loader]

    one_process = batch_keys(0)
    assert len(one_process) == 11 and all(len(keys) == 4 for keys in one_process)  # 46 // 4, tail dropped
    assert batch_keys(2) == one_process
    assert batch_keys(3) == one_process
    # per rank too: rank 1 of 2 sees 23 samples -> 5 batches, the same with 0 or 3 workers
    assert batch_keys(3, rank=1, world=2) == batch_keys(0, rank=1, world=2)
    assert len(batch_keys(0, rank=1, world=2)) == 5
    # and 2 ranks x 4 hold, step by step, the samples of 1 rank x 8 (the same global batch), with 2 workers
    one_rank = batch_keys(2, batch_size=8)
    two_ranks = zip(batch_keys(2, rank=0, world=2), batch_keys(2, rank=1, world=2), strict=True)
    assert [sorted(a + b) for a, b in two_ranks] == [sorted(keys) for keys in one_rank]


def test_csv_source_with_relative_paths_and_a_missing_file(tmp_path):
    data = SyntheticShapes(6, image_size=32)
    rows = ["path,text"]
    for i in range(6):
        data[i]["image"].save(tmp_path / f"{i}.png")
        rows.append(f"{i}.png,{data[i]['caption']}")
    rows.append("missing.png,a lost image")
    (tmp_path / "train.csv").write_text("\n".join(rows))
    source = load_source(train_file=str(tmp_path / "train.csv"), image_column="path", caption_column="text")
    keys, skipped = read_epoch(source, 0, 1, num_workers=0)
    assert len(keys) == 6 and skipped == 1
    with pytest.raises(ValueError, match="columns"):
        load_source(train_file=str(tmp_path / "train.csv"), image_column="img")


def test_random_resized_crop_is_seeded_and_in_range():
    image = Image.new("RGB", (64, 48))
    crop = RandomResizedCrop(32, scale=(0.5, 1.0))
    a = crop(image, random.Random("k"))
    b = crop(image, random.Random("k"))
    assert a.size == (32, 32) and a.tobytes() == b.tobytes()


def test_imagefolder_with_metadata(tmp_path):
    data = SyntheticShapes(5, image_size=32)
    rows = ["file_name,caption"]
    for i in range(5):
        data[i]["image"].save(tmp_path / f"{i}.png")
        rows.append(f"{i}.png,{data[i]['caption']}")
    (tmp_path / "metadata.csv").write_text("\n".join(rows))
    source = load_source(data_dir=str(tmp_path))
    assert (source.image_column, source.caption_column, source.streaming) == ("image", "caption", False)
    keys, skipped = read_epoch(source, 0, 1, num_workers=0)
    assert len(keys) == 5 and skipped == 0


def test_dataset_by_name_from_a_local_folder(tmp_path):
    """--dataset_name goes through datasets.load_dataset(name): a local folder stands in for a Hub id offline."""
    data = SyntheticShapes(4, image_size=32)
    rows = [{"image": {"bytes": _png(data[i]["image"])}, "caption": data[i]["caption"]} for i in range(4)]
    import datasets

    ds = datasets.Dataset.from_list(rows).cast_column("image", datasets.Image())
    ds.to_parquet(str(tmp_path / "hub_like" / "data" / "train-00000.parquet"))
    source = load_source(dataset_name=str(tmp_path / "hub_like"), split="train")
    keys, skipped = read_epoch(source, 0, 1, num_workers=0)
    assert len(keys) == 4 and skipped == 0
    streamed = load_source(dataset_name=str(tmp_path / "hub_like"), split="train", streaming=True)
    assert streamed.streaming and len(read_epoch(streamed, 0, 1, num_workers=0)[0]) == 4


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()
