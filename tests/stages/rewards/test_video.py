import numpy as np
import pytest

from tests.tiny_reward_models import random_images
from unirl.stages.rewards import ScoreBatch, ScorerError, build_scorer, run_scorer
from unirl.stages.rewards.video import frame_indices


def test_frame_indices_are_evenly_spaced_and_keep_the_ends():
    assert frame_indices(5, None) == [0, 1, 2, 3, 4]
    assert frame_indices(3, 8) == [0, 1, 2]
    assert frame_indices(9, 3) == [0, 4, 8]
    assert frame_indices(10, 4) == [0, 3, 6, 9]
    assert frame_indices(7, 1) == [0]


def test_video_score_is_mean_of_frame_scores(clip_dir):
    frames = random_images(5, seed=7)
    videos = [frames, frames[:2], frames[4:]]
    prompts = ["a cat", "hello", "xyz"]
    batch = ScoreBatch(["v/0", "v/1", "v/2"], prompts, videos=videos)
    params = {"model_path": str(clip_dir), "device": "cpu"}
    video = build_scorer("video", scorer="hps", params=params)
    got = run_scorer(video, batch).scores
    assert got.shape == (3,)
    hps = build_scorer("hps", **params)
    for i, (prompt, clip_frames) in enumerate(zip(prompts, videos)):
        per_frame = run_scorer(hps, ScoreBatch([str(k) for k in range(len(clip_frames))],
                                               [prompt] * len(clip_frames), images=clip_frames)).scores
        assert got[i] == pytest.approx(per_frame.mean(), abs=1e-6)
    np.testing.assert_array_equal(run_scorer(video, batch).scores, got)
    sub = build_scorer("video", scorer="hps", params=params, max_frames=2)
    first_last = run_scorer(hps, ScoreBatch(["a", "b"], ["a cat"] * 2, images=[frames[0], frames[4]])).scores
    assert run_scorer(sub, batch).scores[0] == pytest.approx(first_last.mean(), abs=1e-6)


def test_video_components_are_averaged():
    frames = random_images(4)
    batch = ScoreBatch(["v/0", "v/1"], ["p", "q"], texts=["a cat", "dog"], videos=[frames[:3], frames[3:]])
    result = run_scorer(build_scorer("video", scorer="keyword", params={"keywords": ["cat", "dog"]}), batch)
    np.testing.assert_array_equal(result.scores, [0.5, 0.5])
    np.testing.assert_array_equal(result.components["hits"], [1.0, 1.0])


def test_video_needs_videos():
    with pytest.raises(ScorerError, match="'video' needs videos"):
        run_scorer(build_scorer("video", scorer="constant"), ScoreBatch(["a"], ["p"]))
