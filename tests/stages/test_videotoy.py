"""The toy video task: grammar, fixed split, rendering, the detector on hand-made clips, the
reward, the prompt source and its SFT records with the teacher's slip."""
from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from unirl.stages.rewards.base import ScoreBatch, build_scorer, run_scorer
from unirl.stages.toys.geneval.dataset import BACKGROUND, COLOURS
from unirl.stages.toys.videotoy import all_prompts, make_clips, parse_prompt, render, sample_prompts, score, split_of
from unirl.stages.toys.videotoy.dataset import ClipSpec


def clip_of(paths: list[list[tuple[int, int]]], colour: str = "red", side: int = 4, size: int = 16) -> np.ndarray:
    """uint8 (F, size, size, 3): per frame, squares of `side` at the given top-left corners."""
    clip = np.empty((len(paths), size, size, 3), dtype=np.uint8)
    clip[:] = BACKGROUND
    for t, corners in enumerate(paths):
        for x, y in corners:
            clip[t, y:y + side, x:x + side] = COLOURS[colour]
    return clip


def test_the_grammar_its_split_and_the_prompt_errors():
    prompts = all_prompts()
    assert len(prompts) == len(set(prompts)) == 2 * 4 * 4 * 2
    assert all(parse_prompt(p).text == p for p in prompts)
    assert parse_prompt("Two Blue squares moving up quickly.") == ClipSpec(2, "blue", "up", "quickly")
    train, heldout = set(all_prompts("train")), set(all_prompts("heldout"))
    assert train.isdisjoint(heldout) and len(train) + len(heldout) == 64 and 20 <= len(heldout) <= 30
    assert split_of("two blue squares moving up slowly") == split_of("Two blue squares moving up slowly.")
    # every word of a held-out prompt is seen in training: held-out prompts are new combinations
    assert {w for p in heldout for w in p.split()} <= {w for p in train for w in p.split()}
    assert set(sample_prompts(100, 0, "heldout")) <= heldout
    assert sample_prompts(5, 1) == ["a yellow square moving left quickly", "a yellow square moving down quickly",  # recorded once
                                    "two green squares moving right quickly", "two yellow squares moving down slowly",
                                    "a red square moving right slowly"]
    # dev and test halve the held-out prompts, fixed (evaluations stored under one stay comparable)
    dev, test = all_prompts("dev"), all_prompts("test")
    assert (len(dev), len(test)) == (13, 13) and not set(dev) & set(test) and set(dev) | set(test) == heldout
    assert dev[:2] == ["a green square moving right quickly", "a yellow square moving left slowly"]
    assert test[:2] == ["a red square moving left slowly", "a red square moving down quickly"]
    assert {parse_prompt(p).count for p in test} == {parse_prompt(p).count for p in dev} == {1, 2}
    assert set(sample_prompts(100, 0, "test")) <= set(test)
    # a held-out set weighs every prompt of its split alike: 64 draws of 13 prompts, 4 or 5 each
    drawn = sample_prompts(64, 0, "dev")
    assert set(drawn) == set(dev) and {drawn.count(p) for p in dev} == {4, 5}
    for bad in ("a red square moving sideways slowly", "two red square moving up slowly", "a purple square moving up slowly",
                "a red square"):
        with pytest.raises(ValueError, match="cannot parse toy video prompt"):
            parse_prompt(bad)


def test_every_render_scores_one_against_its_prompt_and_its_reverse_moves_the_other_way():
    for p in all_prompts():
        for seed in (0, 1):
            s = score(render(p, 16, 5, seed), p)
            assert s.strict == 1.0, (p, s)
            r = score(render(p, 16, 5, seed, reverse=True), p)
            assert r.direction == 0.0 and r.colour == r.count == 1.0 and r.strict == 0.0, (p, r)
    assert score(render("a red square moving left slowly", 24, 5, 0), "a red square moving left slowly").strict == 1.0
    with pytest.raises(ValueError, match="leaves a 16-pixel frame within 9 frames"):
        render("a red square moving up quickly", 16, 9)


def test_the_detector_on_hand_made_clips():
    # one red square moving right 1 px a frame, then 2 px a frame
    slow = clip_of([[(2 + t, 6)] for t in range(5)])
    quick = clip_of([[(2 + 2 * t, 6)] for t in range(5)])
    assert score(slow, "a red square moving right slowly").strict == 1.0
    s = score(slow, "a red square moving right quickly")
    assert (s.direction, s.speed, s.strict) == (1.0, 0.0, 0.0)
    assert score(quick, "a red square moving right quickly").strict == 1.0
    assert score(quick, "a red square moving up quickly").direction == 0.0  # it moves across the stated axis
    s = score(slow, "a blue square moving right slowly")
    assert (s.object, s.colour, s.count, s.direction) == (1.0, 0.0, 0.0, 0.0)
    s = score(slow, "two red squares moving right slowly")
    assert (s.colour, s.count, s.direction, s.strict) == (1.0, 0.0, 1.0, 0.0)
    pair = clip_of([[(2, 2 + t), (9, 2 + t)] for t in range(5)], colour="green")
    assert score(pair, "two green squares moving down slowly").strict == 1.0
    still = clip_of([[(6, 6)]] * 5)
    assert score(still, "a red square moving left slowly").direction == 0.0
    gone = clip_of([[(2 + t, 6)] for t in range(4)] + [[]])  # the square vanishes in the last frame
    s = score(gone, "a red square moving right slowly")
    assert s.colour == s.count == 0.8 and s.direction == 0.0
    with pytest.raises(ValueError, match="at least 2 frames"):
        score(slow[:1], "a red square moving right slowly")


def test_the_videotoy_scorer_modes_read_videos():
    prompt = "a red square moving right slowly"
    good = [Image.fromarray(f) for f in clip_of([[(2 + t, 6)] for t in range(5)])]
    wrong_speed = [Image.fromarray(f) for f in clip_of([[(2 + 2 * t, 6)] for t in range(5)])]
    batch = ScoreBatch(["a", "b"], [prompt, prompt], videos=[good, wrong_speed])
    strict = run_scorer(build_scorer("videotoy"), batch)
    assert strict.scores.tolist() == [1.0, 0.0] and strict.components["speed"].tolist() == [1.0, 0.0]
    assert run_scorer(build_scorer("videotoy", mode="mean"), batch).scores.tolist() == [1.0, 0.75]
    # motion: strict, direction, speed; the wrong-speed clip moves the right way and nothing else.
    assert run_scorer(build_scorer("videotoy", mode="motion"), batch).scores.tolist() == pytest.approx([1.0, 1 / 3])
    with pytest.raises(ValueError, match="not one of strict, mean"):
        build_scorer("videotoy", mode="partial")


def test_the_source_and_its_sft_records_carry_the_teachers_slip(tmp_path):
    from tests.tiny import TINY, merged
    from unirl.stages.recipe import build_recipe
    from unirl.stages.runtime.registry import sources

    recipe = build_recipe(merged(TINY["wan"], {"algorithm": {"name": "flow_grpo"}, "data": {"heldout_size": 16},
                                               "sft": {"examples": 40, "noise": 0.5, "seed": 3}, "storage": {"root": str(tmp_path)}}))
    src = sources.get("videotoy")
    prompts = src.build(recipe.data)
    assert [p.text for p in prompts.batch(2, 4)] == ["two blue squares moving right slowly", "a blue square moving right quickly",
                                                     "a yellow square moving down quickly", "a green square moving left quickly"]
    assert [p.text for p in prompts.batch(2, 4)] != [p.text for p in prompts.batch(3, 4)]
    assert all(split_of(p.text) == "train" for p in prompts.batch(0, 50))
    assert len(prompts.heldout()) == 16 and all(split_of(p.text) == "heldout" for p in prompts.heldout())
    dev, test = ({p.text for p in prompts.heldout(split)} for split in ("dev", "test"))
    assert len(prompts.heldout("test")) == 16 and not dev & test
    assert not (dev | test) & {p.text for it in range(40) for p in prompts.batch(it, 8)}
    again = src.build(recipe.data)
    assert [p.text for p in again.heldout("test")] == [p.text for p in prompts.heldout("test")]
    assert [p.prompt_id for p in prompts.heldout("test")[:2]] == ["test-00000", "test-00001"]
    with pytest.raises(ValueError, match="unknown held-out split 'heldout'"):
        prompts.heldout("heldout")
    records = src.sft_records(recipe)
    assert len(records) == 40
    reversed_ = 0
    for r in records:
        frames = [np.asarray(Image.open(io.BytesIO(b)).convert("RGB")) for b in r["media_frames"]]
        assert len(frames) == 5 and frames[0].shape == (16, 16, 3)
        s = score(frames, r["prompt"])
        assert s.colour == s.count == 1.0
        reversed_ += s.direction == 0.0
    assert 10 <= reversed_ <= 30  # about half of them move the wrong way
    clips = make_clips(40, 3, reverse_fraction=0.5)
    assert [p for p, _ in clips] == [r["prompt"] for r in records]


def test_a_source_or_size_that_cannot_make_toy_clips_is_a_validate_error(tmp_path):
    from tests.tiny import TINY, merged
    from unirl.stages.recipe import RecipeError, build_recipe

    def errors(base: str = "wan", **over) -> list[str]:
        with pytest.raises(RecipeError) as info:
            build_recipe(merged(TINY[base], {"algorithm": {"name": "flow_grpo"}, "storage": {"root": str(tmp_path)}}, over))
        return info.value.errors

    (err,) = errors(rollout={"sampler": {"num_frames": 9}})
    assert err.startswith("rollout.sampler: a quick square crosses a 16-pixel frame in fewer than 9 frames")
    (err,) = errors("sd3", data={"name": "videotoy"})
    assert err.startswith("data.name: toy video prompts need a video model; model.kind 'sd3' makes image")
    (err,) = errors(data={"prompts": ["a red square moving around"]})
    assert err.startswith("data.prompts.0: cannot parse toy video prompt")
    (err,) = errors(data={"prompts": ["a red square moving up slowly", "two blue squares moving up slowly"]})
    assert err.startswith("data.prompts.1: 'two blue squares moving up slowly' is a held-out prompt")
