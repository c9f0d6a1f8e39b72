"""Poisoned or odd data: every bad sample is skipped and counted, never the end of the run."""

import codecs
import gzip
import io
import logging
import re
import tarfile

import pytest
import torch
from PIL import Image

from hf_switchback.training.data import (
    DEFAULT_MAX_IMAGE_PIXELS,
    CaptionStream,
    SkipLog,
    TrainTransform,
    decode_image,
    field_value,
    load_eval_samples,
    load_source,
)
from hf_switchback.training.shards import DEFAULT_MAX_MEMBER_BYTES, read_shard, split_member_name

TRANSFORM = TrainTransform(32, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))


def png(side=32, color=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (side, side), color).save(buf, format="PNG")
    return buf.getvalue()


def write_tar(path, members: list[tuple[str, bytes]]) -> str:
    with tarfile.open(path, "w") as tar:
        for name, payload in members:
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    return str(path)


def good(i: int) -> list[tuple[str, bytes]]:
    return [
        (f"s{i:03d}.png", png()),
        (f"s{i:03d}.txt", f"a red square {i}".encode()),
        (f"s{i:03d}.json", b'{"id": %d}' % i),
    ]


@pytest.fixture
def poisoned(tmp_path):
    """Shard a: 6 good samples and 4 bad ones; shard b: 4 good samples, then cut in the middle of a member."""
    members = []
    for i in range(3):
        members += good(i)
    members += [("bad_utf8.png", png()), ("bad_utf8.txt", b"caf\xe9 \xff\xfe")]  # latin-1, not UTF-8
    members += [("bad_json.png", png()), ("bad_json.txt", b"fine"), ("bad_json.json", b'{"id": ')]  # unused
    members += [("bomb.png", png()), ("bomb.txt.gz", gzip.compress(b"x" * 5000))]  # over the 4 KiB cap
    members += [("big.png", png(side=64)), ("big.txt", b"a big image")]  # over the pixel cap below
    members += [("zipped.png", png()), ("zipped.txt.gz", gzip.compress(b"a zipped caption"))]
    members += [("noimage.txt", b"only text")]
    for i in range(3, 6):
        members += good(i)
    write_tar(tmp_path / "a.tar", members)
    members = []
    for i in range(6, 11):
        members += good(i)
    path = write_tar(tmp_path / "b.tar", members)
    with tarfile.open(path) as tar:
        cut = tar.getmember("s010.png").offset_data + 10
    with open(path, "r+b") as f:  # cut inside the 5th sample's image
        f.truncate(cut)
    return tmp_path


def read_all(source, num_workers=2, max_image_pixels=2000):
    stream = CaptionStream(source, TRANSFORM, seed=0, max_image_pixels=max_image_pixels)
    loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=num_workers)
    samples = list(loader)
    return {s["__key__"]: s["caption"] for s in samples}, sum(int(s["skipped"]) for s in samples)


def test_poisoned_shards_skip_and_count_every_bad_sample(poisoned, caplog):
    source = load_source(shards=str(poisoned), max_member_bytes=4096)
    with caplog.at_level(logging.WARNING):
        captions, skipped = read_all(source, num_workers=0)
    good_keys = {f"s{i:03d}" for i in range(10)} | {"bad_json", "zipped"}
    assert set(captions) == good_keys  # s010 was cut off with the truncated shard
    assert captions["zipped"] == "a zipped caption" and captions["bad_json"] == "fine"
    assert skipped == 4  # bad_utf8, bomb, big, noimage
    text = caplog.text
    assert "bad_utf8" in text and "UnicodeDecodeError" in text
    assert "more than 4096 bytes" in text and "over the limit of 2000" in text
    assert f"shard {poisoned / 'b.tar'} is truncated or corrupt after 4 samples" in text
    # the same with dataloader workers (each reads its own shard)
    assert read_all(source, num_workers=2) == (captions, skipped)


def test_eval_samples_skip_bad_ones_too(poisoned):
    images, captions, labels = load_eval_samples(load_source(shards=str(poisoned)), 100)
    # the 12 good ones + big and bomb, which fit the default pixel and member caps; bad_utf8 and noimage skipped
    assert len(images) == len(captions) == 14 and labels is None


def test_eval_skip_warning_names_the_row(tmp_path, caplog):
    """A CSV without __key__: the warning names the bad row's position in the file, not the count kept so far."""
    Image.new("RGB", (8, 8)).save(tmp_path / "ok.png")
    (tmp_path / "bad.png").write_bytes(b"not a png")
    rows = ["ok.png,a", "bad.png,b", "ok.png,c", "bad.png,d", "ok.png,e"]
    (tmp_path / "data.csv").write_text("image,caption\n" + "\n".join(rows) + "\n")
    with caplog.at_level(logging.WARNING):
        images, _, _ = load_eval_samples(load_source(train_file=str(tmp_path / "data.csv")), 10)
    assert len(images) == 3
    # the second bad row is row 3, with 2 images kept before it
    assert "eval: skipping sample row 1:" in caplog.text and "eval: skipping sample row 3:" in caplog.text


def test_eval_data_gets_the_training_pixel_cap(poisoned):
    """--max_image_pixels caps the eval images too (a decompression bomb in the validation shards)."""
    from hf_switchback.training import cli
    from hf_switchback.training.sources import load_eval_set

    assert len(load_eval_samples(load_source(shards=str(poisoned)), 100, max_image_pixels=2000)[0]) == 13

    def eval_images(*flags):
        shards = ["--train_shards", str(poisoned), "--validation_shards", str(poisoned)]
        args = cli.build_parser().parse_args(
            [*shards, "--max_train_steps", "1", "--max_eval_samples", "100", *flags]
        )
        return len(load_eval_set(args, train_source=None)[0][0])

    assert eval_images("--max_image_pixels", "2000") == 13  # the 64x64 "big" one skipped
    assert eval_images("--max_image_pixels", "0") == 14  # 0: no cap of ours


def test_field_value_decodes_json_and_flags_unreadable_samples():
    assert field_value({"json": b'{"caption": "x"}'}, "json") == {"caption": "x"}
    assert field_value({"txt": b"raw"}, "txt") == b"raw"  # text is decoded by pick_caption (UTF-8)
    with pytest.raises(ValueError):
        field_value({"json": b'{"caption": '}, "json")
    with pytest.raises(ValueError, match="too big"):
        field_value({"__error__": "too big", "txt": b"x"}, "txt")


def test_pixel_limit_is_checked_before_decoding():
    assert DEFAULT_MAX_IMAGE_PIXELS == Image.MAX_IMAGE_PIXELS == 89_478_485
    buf = io.BytesIO()
    Image.new("1", (12000, 12000)).save(buf, format="PNG")  # 144 M pixels, a few KB on disk
    over = pytest.raises(ValueError, match="12000x12000 pixels is over the limit of 89478485")
    with pytest.warns(Image.DecompressionBombWarning), over:  # PIL only warns: it would decode it
        decode_image(buf.getvalue())
    assert decode_image(png(), max_pixels=32 * 32).size == (32, 32)


def test_member_names_and_caps():
    assert split_member_name("dir/0001.seg.png") == ("dir/0001", "seg.png")
    assert split_member_name("0001.txt") == ("0001", "txt")
    assert split_member_name(".DS_Store") == (None, None) and split_member_name("README") == (None, None)
    assert DEFAULT_MAX_MEMBER_BYTES == 64 * 2**20


def test_oversized_member_is_not_read(tmp_path):
    path = write_tar(tmp_path / "c.tar", [("a.png", png()), ("a.txt", b"x" * 5000), ("b.png", png())])
    samples = list(read_shard(path, max_member_bytes=4096))
    assert [s["__key__"] for s in samples] == ["a", "b"]
    assert "txt" not in samples[0] and "5000 bytes" in samples[0]["__error__"]


def test_skip_log_is_rate_limited(caplog):
    log = SkipLog("rank 0", first=5)
    with caplog.at_level(logging.WARNING):
        for i in range(100):
            log.add(str(i), ValueError("bad"))
    # 5 in full, then one summary at 8, 16, 32, 64
    assert len(caplog.records) == 9 and "64 samples skipped so far ({'ValueError': 64})" in caplog.text


def test_a_missing_shard_is_an_error_not_a_truncated_one(tmp_path):
    """Only damaged data is skipped: a wrong path must stop the run, not read as 'truncated after 0 samples'."""
    with pytest.raises(FileNotFoundError):
        list(read_shard(str(tmp_path / "no-such-shard.tar")))


def test_a_csv_caption_that_is_not_utf8_is_skipped_and_counted_with_its_row(tmp_path, caplog):
    """One latin-1 caption used to abort loading the whole CSV (UnicodeDecodeError inside datasets)."""
    lines = [b"path,text"]
    for i in range(4):
        (tmp_path / f"{i}.png").write_bytes(png())
        lines.append(b"%d.png,a red square %d" % (i, i))
    lines[2] = b"1.png,caf\xe9 cr\xe8me"  # data row 1
    (tmp_path / "train.csv").write_bytes(b"\n".join(lines) + b"\n")
    source = load_source(train_file=str(tmp_path / "train.csv"), image_column="path", caption_column="text")
    with caplog.at_level(logging.WARNING):
        captions, skipped = read_all(source, num_workers=0)
    assert sorted(captions) == ["0", "2", "3"] and skipped == 1
    assert "skipping sample 1: ValueError: caption holds bytes that are not UTF-8" in caplog.text
    _images, eval_captions, _ = load_eval_samples(source, 10)
    assert eval_captions == ["a red square 0", "a red square 2", "a red square 3"]


@pytest.mark.parametrize("streaming", [False, True])
def test_a_jsonl_caption_that_is_not_utf8_is_skipped_and_counted_with_its_row(tmp_path, caplog, streaming):
    """As with a CSV: one latin-1 caption must not abort loading the whole JSON Lines file (datasets raised
    UnicodeDecodeError for it); valid UTF-8 beyond ASCII and a leading byte-order mark read as written."""
    lines = []
    for i in range(4):
        (tmp_path / f"{i}.png").write_bytes(png())
        lines.append(b'{"path": "%d.png", "text": "a red square %d"}' % (i, i))
    lines[1] = b'{"path": "1.png", "text": "caf\xe9 cr\xe8me"}'  # latin-1
    lines[3] = b'{"path": "3.png", "text": "caf\xc3\xa9 cr\xc3\xa8me"}'  # the same words in UTF-8
    (tmp_path / "train.jsonl").write_bytes(codecs.BOM_UTF8 + b"\n".join(lines) + b"\n")
    source = load_source(
        train_file=str(tmp_path / "train.jsonl"),
        image_column="path",
        caption_column="text",
        streaming=streaming,
    )
    with caplog.at_level(logging.WARNING):
        stream = CaptionStream(source, TRANSFORM, seed=0)
        samples = list(torch.utils.data.DataLoader(stream, batch_size=None, num_workers=0))
    captions = sorted(s["caption"] for s in samples)
    assert captions == ["a red square 0", "a red square 2", "café crème"]
    assert sum(int(s["skipped"]) for s in samples) == 1
    assert (
        "ValueError: caption holds bytes that are not UTF-8 (read as U+FFFD): 'caf\ufffd cr\ufffdme'"
        in caplog.text
    )
    _images, eval_captions, _ = load_eval_samples(source, 10)
    assert eval_captions == ["a red square 0", "a red square 2", "café crème"]


def test_a_json_array_that_is_not_utf8_names_the_file_the_place_and_the_fix(tmp_path):
    """A JSON file holding one array is parsed whole by datasets, so a bad byte cannot be skipped with its
    row: the error says where it is and how to re-encode, instead of datasets' message without a file name."""
    rows = [b'  {"path": "%d.png", "text": "a red square %d"}' % (i, i) for i in range(3)]
    rows[2] = b'  {"path": "2.png", "text": "caf\xe9"}'
    path = tmp_path / "train.json"
    path.write_bytes(b"[\n" + b",\n".join(rows) + b"\n]\n")
    offset = path.read_bytes().index(b"\xe9")
    column = offset - path.read_bytes().rindex(b"\n", 0, offset)
    where = f"byte 0xe9 at line 4, column {column} (offset {offset}) is not UTF-8"
    with pytest.raises(ValueError, match=re.escape(f"{path}: {where}")) as err:
        load_source(train_file=str(path), image_column="path", caption_column="text")
    assert f"iconv -f latin1 -t utf-8 {path}" in str(err.value) and ".jsonl" in str(err.value)
    # the same array in UTF-8 loads (the check reads the file only; it changes nothing)
    path.write_bytes(path.read_bytes().replace(b"\xe9", b"\xc3\xa9"))
    source = load_source(train_file=str(path), image_column="path", caption_column="text")
    assert [row["text"] for row in source.dataset] == ["a red square 0", "a red square 1", "café"]
