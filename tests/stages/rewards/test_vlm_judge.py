import numpy as np
import pytest

from stages.rewards import ScoreBatch, ScorerError, build_scorer, run_scorer
from stages.tiny_models import random_images
from stages.rewards.vlm_judge import parse_score


def test_parse_score_maps_to_unit_interval():
    assert parse_score("7", 0, 10) == 0.7
    assert parse_score("Score: 8.5/10", 0, 10) == 0.85
    assert parse_score("3", 1, 5) == 0.5
    assert parse_score("great", 0, 10) is None
    assert parse_score("11", 0, 10) is None
    assert parse_score("-1", 0, 10) is None


def batch(n: int, images: bool = True) -> ScoreBatch:
    return ScoreBatch([f"j/{i}" for i in range(n)], [f"prompt {i}" for i in range(n)],
                      texts=[f"answer {i}" for i in range(n)],
                      images=random_images(n, size=(56, 56)) if images else None)


def test_judge_score_is_parsed_and_normalized(judge_dir):
    judge = build_scorer("vlm_judge", model_path=str(judge_dir), device="cpu", batch_size=2)
    with_images = run_scorer(judge, batch(3))
    assert with_images.scores.shape == (3,)
    np.testing.assert_array_equal(with_images.scores, [0.7] * 3)  # answer "7 7 ...", range 0-10
    assert judge.answers(batch(1))[0].split()[0] == "7"
    text_only = run_scorer(judge, batch(2, images=False))
    np.testing.assert_array_equal(text_only.scores, [0.7, 0.7])
    ranged = build_scorer("vlm_judge", model_path=str(judge_dir), device="cpu", min_score=5, max_score=9)
    np.testing.assert_allclose(run_scorer(ranged, batch(2)).scores, [0.5, 0.5])


def test_unparseable_answer_is_an_error_naming_the_sample(mute_judge_dir):
    judge = build_scorer("vlm_judge", model_path=str(mute_judge_dir), device="cpu")
    with pytest.raises(ScorerError, match=r"no score in \[0, 10\] in the answer for sample 'j/0': 'great"):
        run_scorer(judge, batch(2))


def test_out_of_range_answer_is_an_error(judge_dir):
    judge = build_scorer("vlm_judge", model_path=str(judge_dir), device="cpu", max_score=5)
    with pytest.raises(ScorerError, match=r"no score in \[0, 5\]"):
        run_scorer(judge, batch(1))
