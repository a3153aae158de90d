import numpy as np
import pytest

from tests.tiny_reward_models import random_images
from unirl.stages.rewards import ScoreBatch, ScorerError, build_scorer, run_scorer
from unirl.stages.rewards.ocr import edit_distance, quoted_text, text_similarity


@pytest.mark.parametrize("a, b, d", [("", "", 0), ("abc", "", 3), ("kitten", "sitting", 3),
                                     ("flaw", "lawn", 2), ("same", "same", 0), ("ab", "ba", 2)])
def test_edit_distance(a, b, d):
    assert edit_distance(a, b) == d == edit_distance(b, a)


def test_quoted_text():
    assert quoted_text('A sign that says "Open Late"') == "Open Late"
    assert quoted_text('"Hi" and “there”') == "Hi there"
    assert quoted_text("no quotes, it's plain") is None


def test_text_similarity_normalization():
    assert text_similarity("Open Late", "open late") == 1.0  # case and spaces ignored
    assert text_similarity("kitten", "sitting") == pytest.approx(1 - 3 / 7)
    assert text_similarity("ab", "AB", ignore_case=False) == 0.0
    assert text_similarity("a  b", "a b", ignore_spaces=False) == 1.0  # collapsed, not removed
    assert text_similarity("ab", "a b", ignore_spaces=False) == pytest.approx(1 - 1 / 3)
    assert text_similarity("", "") == 1.0 and text_similarity("xyz", "") == 0.0


@pytest.fixture(scope="module")
def scorer(ocr_dir):
    return build_scorer("ocr", model_path=str(ocr_dir), device="cpu", max_new_tokens=12)


def test_ocr_score_is_one_minus_normalized_edit_distance(scorer):
    images = random_images(4, seed=3)
    prompts = ['a sign saying "hello"', 'the word "mhxwk61cdl"', 'poster: "MHX WK"', "no quote here"]
    batch = ScoreBatch(["s/0", "s/1", "s/2", "s/3"], prompts, images=images,
                       metadata=[{}, {}, {}, {"ocr_text": "cdl"}])
    result = run_scorer(scorer, batch)
    reads = scorer.read(images)
    assert len(reads) == 4 and all(reads), "the tiny model must emit characters"
    targets = ["hello", "mhxwk61cdl", "MHX WK", "cdl"]
    want = [1 - edit_distance(r.replace(" ", ""), t.lower().replace(" ", "")) /
            max(len(r.replace(" ", "")), len(t.replace(" ", ""))) for r, t in zip(reads, targets)]
    np.testing.assert_allclose(result.scores, want)
    assert ((result.scores >= 0) & (result.scores <= 1)).all()
    np.testing.assert_array_equal(result.components["exact"], (result.scores == 1.0).astype(float))
    np.testing.assert_array_equal(run_scorer(scorer, batch).scores, result.scores)


def test_prompt_without_quotes_is_an_error_naming_the_sample(scorer):
    batch = ScoreBatch(["ok/0", "bad/1"], ['"hi"', "a photo of a cat"], images=random_images(2))
    with pytest.raises(ScorerError, match="sample 'bad/1' has no quoted text"):
        run_scorer(scorer, batch)
