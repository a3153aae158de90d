"""Prompts with images: the toy VQA source (answers checked against the toy-GenEval detector on
the very images the prompts carry), image columns of JSONL / Parquet files, and bad images that
fail before anything is sampled, naming the row or sample and the file."""
from __future__ import annotations

import hashlib
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from unirl.stages.runtime.images import decode, png_bytes
from unirl.stages.runtime.seeds import derive_seed
from unirl.stages.sources.data_files import DataFileError, FilePrompts
from unirl.stages.toys.geneval.dataset import render
from unirl.stages.toys.geneval.detector import detect
from unirl.stages.toys.toy_vqa import HELDOUT_SEEDS, TEST_SEEDS, ToyVQA


def test_toy_vqa_answers_are_what_the_detector_sees_in_the_prompts_image():
    source = ToyVQA(image_size=32, heldout_size=40, seed=3)
    prompts = source.heldout("dev") + source.heldout("test") + source.batch(0, 60)
    assert {p.metadata["kind"] for p in prompts} == {"colour", "shape", "count", "position"}
    for p in prompts:
        (png,) = p.images
        blobs = detect(decode(png, p.prompt_id))
        answer, kind = p.metadata["answer"], p.metadata["kind"]
        if kind == "colour":
            assert [b.colour for b in blobs] == [answer], p
        elif kind == "shape":
            assert [b.shape for b in blobs] == [answer], p
        elif kind == "count":
            assert str(len(blobs)) == answer, p
        else:
            words = p.text.split()  # is the C1 S1 left or right of the C2 S2?
            first = next(b for b in blobs if (b.colour, b.shape) == (words[2], words[3]))
            second = next(b for b in blobs if (b.colour, b.shape) == (words[-2], words[-1].rstrip("?")))
            assert ("left" if first.bbox[2] < second.bbox[0] else "right") == answer, p


def test_toy_vqa_stream_is_deterministic_and_never_draws_a_dev_or_test_image():
    a, b = ToyVQA(seed=5), ToyVQA(seed=5)
    # Recorded once (sha256 of the decoded pixels, first 16 hex digits): a resumed run draws these again.
    assert [(p.text, p.metadata["answer"], hashlib.sha256(decode(p.images[0], "x").tobytes()).hexdigest()[:16])
            for p in a.batch(7, 16)[:3]] == [("what colour is the triangle?", "yellow", "7b81e3cdf3c5054f"),
                                             ("is the green triangle left or right of the blue square?", "right", "34cca94318b6a793"),
                                             ("what shape is the green object?", "square", "e4f7f9376621b449")]
    assert [p.text for p in a.batch(7, 16)] != [p.text for p in a.batch(8, 16)]
    for split in ("dev", "test"):
        assert [(p.prompt_id, p.text, p.images) for p in a.heldout(split)] == \
            [(p.prompt_id, p.text, p.images) for p in b.heldout(split)]
        assert len(a.heldout(split)) == 40
    dev, test = ({p.images for p in a.heldout(split)} for split in ("dev", "test"))
    assert not dev & test and a.heldout() == a.heldout("dev")
    assert not (dev | test) & {p.images for i in range(20) for p in a.batch(i, 16)}
    assert ToyVQA(seed=5, heldout_size=3).heldout()[0].images == a.heldout()[0].images  # the split grows, never reshuffles
    assert HELDOUT_SEEDS == 2**31  # training layouts are drawn below it (seed % 2**31)
    with pytest.raises(ValueError, match="unknown held-out split 'heldout' \\(allowed: dev, test\\)"):
        a.heldout("heldout")


def test_toy_vqa_dev_is_the_heldout_split_of_before_the_test_split():
    # Computed before the test split existed (sha256 of the decoded pixels, first 16 hex digits).
    expected = [("what colour is the square?", "red", "680ff4db0b9b3a9d"),
                ("how many shapes are there?", "1", "92ad91104f789891"),
                ("how many shapes are there?", "3", "a370bcb536eedf6b"),
                ("what colour is the triangle?", "green", "f04d5fc08527ecc0")]
    dev = ToyVQA(seed=5, heldout_size=4).heldout("dev")
    assert [(p.text, p.metadata["answer"], hashlib.sha256(decode(p.images[0], "x").tobytes()).hexdigest()[:16])
            for p in dev] == expected
    assert [p.prompt_id for p in dev] == [f"heldout-{i:05d}" for i in range(4)]


def test_toy_vqa_compares_images_not_only_layout_seeds():
    """Small single-object scenes have few layouts, so distinct seeds collide: the colliding
    training and test images are drawn again, with the next layout seed of their range."""
    a = ToyVQA(kinds=("colour", "shape"), image_size=16, heldout_size=40, seed=5)
    dev, test = a.heldout("dev"), a.heldout("test")
    first_layout = [(png_bytes(render(p.metadata["scene"], 16, seed=TEST_SEEDS + i)),) for i, p in enumerate(test)]
    assert [p.images for p in test] != first_layout  # some test scene first fell on a dev image
    assert {p.images for p in dev}.isdisjoint(p.images for p in test)
    held, redrawn = {p.images for p in dev + test}, 0
    for i in range(20):
        for j, p in enumerate(a.batch(i, 16)):
            assert p.images not in held, p
            redrawn += p.images != (png_bytes(render(p.metadata["scene"], 16, seed=derive_seed(5, "train", i, j) % HELDOUT_SEEDS)),)
    assert redrawn  # and some training scenes first fell on a dev or test image


def rgb(colour: tuple[int, int, int], size: tuple[int, int] = (20, 12)) -> Image.Image:
    return Image.new("RGB", size, colour)


def test_image_columns_of_jsonl_and_parquet_files(tmp_path):
    rgb((200, 0, 0)).save(tmp_path / "red.png")
    rgb((0, 0, 200)).save(tmp_path / "blue.jpg", quality=95)
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"question": "colour?", "answer": "red", "image": "red.png"},
        {"question": "colours?", "answer": "red, blue", "image": ["red.png", str(tmp_path / "blue.jpg")]},
    ]) + "\n")
    src = FilePrompts(path=tmp_path / "d.jsonl", prompt_column="question", image_column="image")
    first, both = src.batch(0, 2) if src.batch(0, 2)[0].text == "colour?" else reversed(src.batch(0, 2))
    assert len(first.images) == 1 and len(both.images) == 2
    assert decode(first.images[0], "x").getpixel((3, 3)) == (200, 0, 0)
    assert decode(both.images[1], "x").size == (20, 12)
    assert "image" not in first.metadata and first.metadata["answer"] == "red"
    red, green = (tmp_path / "red.png").read_bytes(), png_bytes(rgb((0, 200, 0)))
    pq.write_table(pa.table({"prompt": ["q1", "q2"], "answer": ["a", "b"], "img": [red, green]}), tmp_path / "b.parquet")
    # Hugging Face datasets store an Image feature as a {bytes, path} struct.
    pq.write_table(pa.table({"prompt": ["q1", "q2"], "answer": ["a", "b"],
                             "img": [{"bytes": red, "path": None}, {"bytes": None, "path": str(tmp_path / "blue.jpg")}]}),
                   tmp_path / "s.parquet")
    for name, expected in (("b.parquet", [(0, 200, 0), (200, 0, 0)]), ("s.parquet", [(0, 0, 200), (200, 0, 0)])):
        rows = FilePrompts(path=tmp_path / name, image_column="img").batch(0, 2)
        colours = sorted(decode(p.images[0], "x").getpixel((5, 5)) for p in rows)
        assert [tuple(round(c, -1) for c in rgb_) for rgb_ in colours] == expected, name


def test_the_same_question_about_two_images_is_two_prompts_for_the_heldout_split(tmp_path):
    for k in range(6):
        rgb((40 * k, 0, 0)).save(tmp_path / f"{k}.png")
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"prompt": "colour?", "answer": str(k), "image": f"{k}.png"}) + "\n"
                                              for k in range(6)))
    src = FilePrompts(path=tmp_path / "d.jsonl", image_column="image", heldout_fraction=0.5, seed=1)
    assert len(src.heldout()) == 3 and src.train_size == 3


@pytest.mark.parametrize("bad,message", [
    ({"image": "missing.png"}, r"line 2: column 'image': image file .*missing.png does not exist"),
    ({"image": "junk.png"}, r"line 2: column 'image': image file .*junk.png: the image bytes do not decode"),
    ({"image": []}, r"line 2 has no image \(column 'image'\); every prompt needs one or more"),
    ({"image": ["ok.png", 3]}, r"line 2: column 'image' item 1: an image must be a file path or image bytes, got int"),
])
def test_a_bad_image_in_a_data_file_fails_naming_the_line_and_the_file(tmp_path, bad, message):
    rgb((1, 2, 3)).save(tmp_path / "ok.png")
    (tmp_path / "junk.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really")
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "q", "answer": "a", "image": "ok.png"}) + "\n"
                                      + json.dumps({"prompt": "q2", "answer": "a", **bad}) + "\n")
    with pytest.raises(DataFileError, match=str(tmp_path / "d.jsonl") + ": " + message):
        FilePrompts(path=tmp_path / "d.jsonl", image_column="image")


def test_a_truncated_png_fails_on_decoding_not_inside_the_model():
    data = png_bytes(rgb((9, 9, 9), (64, 64)))
    with pytest.raises(ValueError, match="sample 's/0': the image bytes do not decode"):
        decode(data[: len(data) // 2], "sample 's/0'")
    assert Image.open(io.BytesIO(data)).size == (64, 64)
