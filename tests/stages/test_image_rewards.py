"""Image scorers: toy GenEval, JPEG (in)compressibility, brightness, colorfulness."""
from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from unirl.stages.rewards import ScoreBatch, ScorerError, build_scorer, run_scorer, scorer_names
from unirl.stages.toys.geneval import render


def _batch(images, prompts=None):
    n = len(images)
    return ScoreBatch([f"g/{i}" for i in range(n)], prompts or [""] * n, images=images)


def _solid(rgb, size=32):
    return Image.new("RGB", (size, size), rgb)


def test_image_scorers_are_registered():
    assert {"geneval", "jpeg_compressibility", "jpeg_incompressibility", "brightness", "colorfulness"} <= set(scorer_names())


def test_geneval_scorer_strict_mean_and_partial_with_components():
    prompts = ["two red circles", "a blue square on the left of a green triangle"]
    images = [render(p, 32, seed=i) for i, p in enumerate(prompts)]
    batch = _batch(images + images + images[:1], prompts + ["three red circles",
                   "a blue square on the right of a green triangle", "two blue circles"])
    strict = run_scorer(build_scorer("geneval"), batch)
    np.testing.assert_array_equal(strict.scores, [1, 1, 0, 0, 0])
    assert set(strict.components) == {"strict", "object", "colour", "count", "position"}
    np.testing.assert_array_equal(strict.components["object"], [1, 1, 1, 1, 1])
    np.testing.assert_array_equal(strict.components["colour"], [1, 1, 1, 1, 0])
    np.testing.assert_array_equal(strict.components["count"], [1, 1, 0, 1, 0])
    np.testing.assert_array_equal(strict.components["position"], [1, 1, 1, 0, 1])
    # mean of object, colour, count, position: red circles for "two blue circles" still earn half
    mean = run_scorer(build_scorer("geneval", mode="mean"), batch)
    np.testing.assert_allclose(mean.scores, [1, 1, 0.75, 0.75, 0.5])
    # mean of strict, colour, count, position: the wrong colour earns only the position quarter
    partial = run_scorer(build_scorer("geneval", mode="partial"), batch)
    np.testing.assert_allclose(partial.scores, [1, 1, 0.5, 0.5, 0.25])
    with pytest.raises(ValueError, match="mode"):
        build_scorer("geneval", mode="loose")


def test_geneval_scorer_names_an_unparseable_prompt():
    with pytest.raises(ScorerError, match="geneval.*a purple circle"):
        run_scorer(build_scorer("geneval"), _batch([_solid((255, 255, 255))], ["a purple circle"]))


def test_jpeg_rewards_are_signed_kilobytes_at_quality_95():
    rng = np.random.default_rng(0)
    flat, noise = _solid((200, 30, 30)), Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8))
    buf = io.BytesIO()
    noise.save(buf, format="JPEG", quality=95)
    kb = len(buf.getvalue()) / 1000
    comp = run_scorer(build_scorer("jpeg_compressibility"), _batch([flat, noise]))
    incomp = run_scorer(build_scorer("jpeg_incompressibility"), _batch([flat, noise]))
    assert comp.scores[1] == pytest.approx(-kb) and incomp.scores[1] == pytest.approx(kb)
    assert comp.scores[0] > comp.scores[1] and incomp.scores[0] < incomp.scores[1]
    np.testing.assert_allclose(comp.components["jpeg_kb"], incomp.scores)
    lower = run_scorer(build_scorer("jpeg_incompressibility", quality=20), _batch([noise]))
    assert lower.scores[0] < kb
    with pytest.raises(ValueError, match="quality"):
        build_scorer("jpeg_compressibility", quality=0)


def test_brightness_is_mean_luma_in_unit_range():
    half = np.zeros((32, 32, 3), dtype=np.uint8)
    half[:, :16] = 255
    images = [_solid((255, 255, 255)), _solid((0, 0, 0)), _solid((255, 0, 0)), Image.fromarray(half)]
    np.testing.assert_allclose(run_scorer(build_scorer("brightness"), _batch(images)).scores, [1, 0, 0.299, 0.5])


def test_colorfulness_is_zero_for_grey_and_matches_hand_computation():
    assert run_scorer(build_scorer("colorfulness"), _batch([_solid((90, 90, 90))])).scores[0] == pytest.approx(0)
    # Half pure red, half pure blue: rg = 255 | 0, yb = 127.5 | -255.
    pixels = np.zeros((4, 4, 3), dtype=np.uint8)
    pixels[:, :2, 0] = 255
    pixels[:, 2:, 2] = 255
    std = np.hypot(127.5, 191.25)
    mean = np.hypot(127.5, -63.75)
    expected = (std + 0.3 * mean) / 255
    got = run_scorer(build_scorer("colorfulness"), _batch([Image.fromarray(pixels)])).scores[0]
    assert got == pytest.approx(expected)
    assert got > run_scorer(build_scorer("colorfulness"), _batch([_solid((150, 120, 120))])).scores[0]


def test_image_scorers_need_images():
    batch = ScoreBatch(["g/0"], ["a red circle"], texts=["hi"])
    for name in ("geneval", "jpeg_compressibility", "brightness", "colorfulness"):
        with pytest.raises(ScorerError, match=f"{name}.*images"):
            run_scorer(build_scorer(name), batch)
