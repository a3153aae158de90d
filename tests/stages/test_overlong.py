import numpy as np
import pytest

from unirl.stages.rewards.overlong import apply_overlong, soft_overlong_penalty


def test_soft_penalty_at_the_boundaries_by_hand():
    # L_max = 10, L_cache = 4: free up to 6 tokens, then a linear ramp to -1 at 10, -1 beyond.
    lengths = [0, 6, 7, 8, 9, 10, 11]
    expected = [0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0]
    np.testing.assert_allclose(soft_overlong_penalty(np.array(lengths), 10, 4), expected)


def test_soft_is_added_and_scaled_by_penalty():
    scores = np.ones(6)
    reasons = ["stop", "stop", "stop", "length", "length", "length"]
    new, comp = apply_overlong(scores, [0, 6, 8, 10, 10, 12], reasons, mode="soft", max_new_tokens=10, buffer=4, penalty=0.5)
    np.testing.assert_allclose(comp, [0, 0, -0.25, -0.5, -0.5, -0.5])
    np.testing.assert_allclose(new, [1, 1, 0.75, 0.5, 0.5, 0.5])


def test_buffer_equal_to_max_ramps_from_zero_length():
    np.testing.assert_allclose(soft_overlong_penalty(np.array([0, 1, 2]), 2, 2), [0.0, -0.5, -1.0])


def test_zero_and_keep():
    scores = np.array([1.0, 0.7, -0.2])
    reasons = ["stop", "length", "length"]
    new, comp = apply_overlong(scores, [3, 8, 8], reasons, mode="zero", max_new_tokens=8)
    np.testing.assert_allclose(new, [1.0, 0.0, 0.0])
    np.testing.assert_allclose(comp, [0.0, -0.7, 0.2])
    new, comp = apply_overlong(scores, [3, 8, 8], reasons, mode="keep", max_new_tokens=8)
    np.testing.assert_allclose(new, scores)
    assert not comp.any()
    assert new is not scores


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(mode="clip", max_new_tokens=8), "unknown mode 'clip'"),
        (dict(mode="soft", max_new_tokens=8, buffer=9), "buffer: must be in"),
        (dict(mode="soft", max_new_tokens=8, buffer=0), "buffer: must be in"),
    ],
)
def test_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        apply_overlong(np.zeros(2), [1, 2], ["stop", "stop"], **kwargs)


def test_length_mismatch():
    with pytest.raises(ValueError, match="2 scores, 3 lengths and 2 finish reasons"):
        apply_overlong(np.zeros(2), [1, 2, 3], ["stop", "stop"], mode="keep", max_new_tokens=8)
