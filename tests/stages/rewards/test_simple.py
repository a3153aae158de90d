import numpy as np
import pytest

from unirl.stages.rewards import ScoreBatch, build_scorer, run_scorer, scorer_names


def batch() -> ScoreBatch:
    return ScoreBatch(["g/0", "g/1", "g/2"], ["p", "pp", "ppp"], texts=["A cat", "dog and CAT", ""])


def test_registered_by_name():
    assert {"text_length", "constant", "keyword"} <= set(scorer_names())


def test_text_length_chars_words_and_cap():
    assert run_scorer(build_scorer("text_length"), batch()).scores.tolist() == [5, 11, 0]
    assert run_scorer(build_scorer("text_length", unit="words"), batch()).scores.tolist() == [2, 3, 0]
    capped = run_scorer(build_scorer("text_length", max_length=8), batch()).scores
    np.testing.assert_allclose(capped, [5 / 8, 1.0, 0.0])
    on_prompt = run_scorer(build_scorer("text_length", field="prompt"), batch()).scores
    assert on_prompt.tolist() == [1, 2, 3]


def test_keyword_fraction_and_hits():
    result = run_scorer(build_scorer("keyword", keywords=["cat", "dog"]), batch())
    assert result.scores.tolist() == [0.5, 1.0, 0.0]
    assert result.components["hits"].tolist() == [1, 2, 0]
    strict = run_scorer(build_scorer("keyword", keywords=["CAT"], case_sensitive=True), batch())
    assert strict.scores.tolist() == [0.0, 1.0, 0.0]


def test_constant_and_missing_text():
    assert run_scorer(build_scorer("constant", value=2.5), batch()).scores.tolist() == [2.5] * 3
    with pytest.raises(Exception, match="text_length.*needs decoded text"):
        run_scorer(build_scorer("text_length"), ScoreBatch(["a"], ["p"]))
