"""Toy GenEval: grammar, fixed splits, rendering, and the detector's scores."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFilter

from unirl.stages.toys.geneval import (
    COLOURS,
    KINDS,
    RELATIONS,
    SHAPES,
    ObjectSpec,
    PromptSpec,
    all_prompts,
    detect,
    make_examples,
    parse_prompt,
    relations,
    render,
    sample_prompts,
    score,
    split_of,
)
from unirl.stages.toys.geneval.detector import connected_components, shape_features, shape_of


def test_every_grammar_prompt_parses_back_to_itself():
    prompts = all_prompts()
    assert len(prompts) == len(set(prompts)) == 12 + 24 + 132 + 4 * 132
    for p in prompts:
        assert parse_prompt(p).text == p
    assert parse_prompt("A photo of Two  red circles.") == PromptSpec((ObjectSpec("circle", "red", 2),))
    assert parse_prompt("one blue square above a green triangle") == PromptSpec(
        (ObjectSpec("square", "blue"), ObjectSpec("triangle", "green")), "above")
    assert parse_prompt("two red circles and three blue squares").kind == "pair"


@pytest.mark.parametrize("bad", [
    "a purple circle", "two red hexagons", "red circle", "a red circle near a blue square",
    "a red circle on the left of a red circle", "two red circles above a blue square", "a red circle and",
    "a red circle and a blue square please", "",
])
def test_a_prompt_outside_the_grammar_is_a_clear_error(bad):
    with pytest.raises(ValueError) as err:
        parse_prompt(bad)
    assert repr(bad) in str(err.value) and "Grammar:" in str(err.value)


def test_the_heldout_split_is_fixed_disjoint_and_covers_every_kind():
    train, heldout = set(all_prompts(split="train")), set(all_prompts(split="heldout"))
    assert train.isdisjoint(heldout) and len(train) + len(heldout) == len(all_prompts())
    assert 0.1 < len(heldout) / len(all_prompts()) < 0.3
    for kind in KINDS:
        assert all_prompts(kind, "heldout") and all_prompts(kind, "train"), kind
    assert split_of("A photo of two red circles.") == split_of("two red circles")
    a = sample_prompts(50, seed=3, split="heldout")
    assert a == sample_prompts(50, seed=3, split="heldout") != sample_prompts(50, seed=4, split="heldout")
    assert set(a) <= heldout and {parse_prompt(p).kind for p in a} == set(KINDS)
    assert set(sample_prompts(200, seed=0)) <= train
    with pytest.raises(ValueError, match="unknown split 'validation'"):
        sample_prompts(1, seed=0, split="validation")


def test_dev_and_test_partition_the_heldout_prompts_of_every_kind():
    for kind in KINDS:
        dev, test = set(all_prompts(kind, "dev")), set(all_prompts(kind, "test"))
        assert not dev & test and dev | test == set(all_prompts(kind, "heldout")), kind
        assert len(dev) >= 2 and len(test) >= 2 and abs(len(dev) - len(test)) <= 1, kind
    assert (len(all_prompts(split="dev")), len(all_prompts(split="test"))) == (78, 77)
    # The partition is fixed: evaluations stored under one stay comparable.
    assert all_prompts("single", "dev") == ["a blue square", "a yellow triangle"]
    assert all_prompts("single", "test") == ["a green triangle", "a yellow square"]
    assert len(all_prompts("single", "train")) == 8  # topped up to four held out: 20% of 12 hashed to one
    assert all_prompts("count", "dev") == ["two red triangles", "three green triangles"]
    assert all_prompts("count", "test") == ["three blue circles", "three yellow triangles"]


def test_the_source_gives_disjoint_dev_and_test_splits_never_trained_on():
    from unirl.stages.sources.geneval import GenEvalData, GenEvalSource

    a, b = (GenEvalSource.build(GenEvalData(heldout_size=32, seed=5)) for _ in range(2))
    dev, test = a.heldout("dev"), a.heldout("test")
    assert len(dev) == len(test) == 32 and a.heldout() == dev
    for split in ("dev", "test"):
        assert [p.text for p in a.heldout(split)] == [p.text for p in b.heldout(split)]
    assert not {p.text for p in dev} & {p.text for p in test}
    assert {p.text for p in dev} <= set(all_prompts(split="dev")) and {p.text for p in test} <= set(all_prompts(split="test"))
    assert {parse_prompt(p.text).kind for p in test} == set(KINDS)
    trained = {p.text for it in range(50) for p in a.batch(it, 16)}
    assert not trained & {p.text for p in dev + test}
    assert (dev[0].prompt_id, test[0].prompt_id) == ("heldout-00000", "test-00000")
    assert test[0].metadata == {"geneval_prompt": test[0].text}
    with pytest.raises(ValueError, match="unknown held-out split 'train'"):
        a.heldout("train")


def test_single_prompts_have_dev_and_test_splits_and_listed_training_prompts_must_be_train_prompts():
    from unirl.stages.sources.geneval import GenEvalData, GenEvalSource

    single = GenEvalSource.build(GenEvalData(kinds=["single"], heldout_size=16))
    assert {p.text for p in single.heldout("dev")} == {"a blue square", "a yellow triangle"}
    assert {p.text for p in single.heldout("test")} == {"a green triangle", "a yellow square"}
    with pytest.raises(ValueError, match="data.prompts.1: 'three blue circles' is a held-out prompt"):
        GenEvalData(prompts=["a red circle", "three blue circles"])


def test_render_is_seeded_and_sized():
    a = render("a red circle on the left of a blue square", size=32, seed=1)
    assert a.size == (32, 32) and a.mode == "RGB"
    assert a.tobytes() == render("a red circle on the left of a blue square", size=32, seed=1).tobytes()
    assert a.tobytes() != render("a red circle on the left of a blue square", size=32, seed=2).tobytes()
    assert render("two red circles", size=48, seed=0).size == (48, 48)
    colours = {tuple(c) for c in np.asarray(a).reshape(-1, 3)}
    assert colours == {(255, 255, 255), COLOURS["red"], COLOURS["blue"]}
    with pytest.raises(ValueError, match="size"):
        render("a red circle", size=8)
    examples = make_examples(4, seed=0, size=32)
    assert len(examples) == 4 and all(score(e.image, e.prompt).strict == 1.0 for e in examples)


def test_caption_noise_draws_one_object_group_in_another_colour():
    from unirl.stages.toys.geneval.dataset import parse_prompt

    noisy = make_examples(40, seed=3, size=32, noise=1.0)
    assert [e.prompt for e in noisy] == [e.prompt for e in make_examples(40, seed=3, size=32)]  # the captions stay
    for e in noisy:
        wrong = score(e.image, e.prompt)
        assert wrong.strict == 0.0 and wrong.colour < 1.0, (e.prompt, wrong)
        drawn = {tuple(c) for c in np.asarray(e.image).reshape(-1, 3)} - {(255, 255, 255)}
        said = {COLOURS[o.colour] for o in parse_prompt(e.prompt).objects}
        assert drawn != said, e.prompt  # a group in a colour the prompt does not give it
    half = make_examples(400, seed=3, size=32, noise=0.5)
    slipped = sum(score(e.image, e.prompt).strict == 0.0 for e in half)
    assert 160 <= slipped <= 240  # about half, drawn per example from the seed
    assert [e.image.tobytes() for e in half[:5]] == [e.image.tobytes() for e in make_examples(5, seed=3, size=32, noise=0.5)]


def test_rendered_images_score_one_on_their_own_prompts():
    prompts = all_prompts()
    rng = np.random.default_rng(0)
    for i in rng.choice(len(prompts), size=300, replace=False):
        for seed in (0, 1):
            s = score(render(prompts[i], size=32, seed=seed), prompts[i])
            assert s.strict == 1.0, (prompts[i], seed, s)
            assert (s.object, s.colour, s.count, s.position) == (1.0, 1.0, 1.0, 1.0)
    for size in (16, 64):
        for p in sample_prompts(20, seed=size):
            assert score(render(p, size=size, seed=0), p).strict == 1.0, (p, size)


def test_mild_pixel_noise_does_not_change_the_score():
    rng = np.random.default_rng(0)
    for i, p in enumerate(sample_prompts(40, seed=1)):
        pixels = np.asarray(render(p, 32, seed=i)).astype(int) + rng.integers(-25, 26, size=(32, 32, 3))
        assert score(Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)), p).strict == 1.0, p


def test_each_wrong_criterion_lowers_its_component_and_fails_strict():
    image = render("two red circles", 32, seed=0)
    assert score(image, "two blue circles").colour == 0.0
    assert score(image, "two red squares").object == 0.0
    assert score(image, "three red circles").count == 0.0 and score(image, "a red circle").count == 0.0
    for wrong in ("two blue circles", "two red squares", "three red circles", "a red circle"):
        assert score(image, wrong).strict == 0.0
    left = render("a green square on the left of a yellow triangle", 32, seed=3)
    flipped = score(left, "a green square on the right of a yellow triangle")
    assert flipped.position == 0.0 and flipped.strict == 0.0 and flipped.count == 1.0
    half = score(left, "a green square on the left of a blue triangle")
    assert half.colour == 0.5 and half.object == 1.0 and half.strict == 0.0


def test_random_mismatched_prompts_score_lower():
    prompts = sample_prompts(200, seed=7)
    rng = np.random.default_rng(7)
    matched, mismatched = [], []
    for i, p in enumerate(prompts):
        image = render(p, 32, seed=i)
        other = prompts[int(rng.integers(len(prompts)))]
        matched.append(score(image, p).strict)
        if parse_prompt(other) != parse_prompt(p):
            mismatched.append(score(image, other).strict)
    assert np.mean(matched) == 1.0 and np.mean(mismatched) < 0.05


def test_blank_image_scores_zero():
    blank = Image.new("RGB", (32, 32), (255, 255, 255))
    s = score(blank, "a red circle above a blue square")
    assert (s.strict, s.object, s.colour, s.count, s.position) == (0.0, 0.0, 0.0, 0.0, 0.0)
    assert detect(blank) == []


def test_detector_shapes_on_a_hand_drawn_image():
    image = Image.new("RGB", (40, 40), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    draw.rectangle((2, 2, 11, 11), fill=COLOURS["red"])
    draw.ellipse((20, 2, 31, 13), fill=COLOURS["blue"])
    draw.polygon([(2, 35), (13, 35), (7.5, 24)], fill=COLOURS["green"])
    draw.point((30, 30), fill=COLOURS["yellow"])  # a one-pixel speck is noise
    found = {(b.colour, b.shape) for b in detect(image)}
    assert found == {("red", "square"), ("blue", "circle"), ("green", "triangle")}
    square = next(b for b in detect(image) if b.shape == "square")
    assert square.bbox == (2, 2, 11, 11) and square.area == 100 and square.fill == 1.0
    assert set(SHAPES) == {s for _, s in found}


def test_shape_features_on_hand_masks():
    triangle = np.array([
        [0, 0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 1, 0, 0],
        [0, 1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1, 1, 1],
    ], dtype=bool)
    # top half 1 + 3 = 4 px, bottom half 5 + 7 = 12; 1x1 corner cells: 0, 0, 1, 1
    assert shape_features(triangle) == (4 / 12, 0.5) and shape_of(*shape_features(triangle)) == "triangle"
    disc = np.array([[0, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1], [0, 1, 1, 0]], dtype=bool)
    assert shape_features(disc) == (1.0, 0.0) and shape_of(1.0, 0.0) == "circle"
    assert shape_features(np.ones((4, 4), dtype=bool)) == (1.0, 1.0) and shape_of(1.0, 1.0) == "square"


def test_soft_edged_shapes_are_read_as_drawn():
    """A generated or VAE-decoded blob has soft edges: blurred, a triangle fills ~0.7 of its box
    (a circle's ~0.785 more than its own ~0.5), yet every scene still scores 1.0."""
    prompts = sample_prompts(120, seed=3)
    images = [render(p, 32, seed=i).filter(ImageFilter.GaussianBlur(0.7)) for i, p in enumerate(prompts)]
    assert [score(im, p).strict for im, p in zip(images, prompts)] == [1.0] * len(prompts)
    fills = [b.fill for im in images for b in detect(im) if b.shape == "triangle"]
    assert len(fills) > 20 and np.median(fills) > 0.66


def test_connected_components_on_a_hand_mask():
    mask = np.array([
        [1, 1, 0, 1],
        [0, 1, 0, 1],
        [1, 0, 0, 1],
        [1, 1, 1, 1],
    ], dtype=bool)
    labels, n = connected_components(mask)
    assert n == 2  # diagonal neighbours do not connect
    assert labels[0, 0] == labels[1, 1] != labels[2, 0] == labels[0, 3]
    assert (labels[~mask] == -1).all()


def test_relations_of_boxes():
    a, b = (0, 10, 5, 15), (20, 10, 25, 15)
    assert relations(a, b) == {RELATIONS[0]} and relations(b, a) == {RELATIONS[1]}
    top, bottom = (10, 0, 15, 5), (10, 20, 15, 25)
    assert relations(top, bottom) == {"above"} and relations(bottom, top) == {"below"}
    assert relations((0, 0, 5, 5), (20, 20, 25, 25)) == {RELATIONS[0], "above"}
    assert relations((0, 0, 9, 9), (1, 1, 10, 10)) == set()  # overlapping centres: no relation
