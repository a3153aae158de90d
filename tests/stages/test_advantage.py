import math

import numpy as np
import pytest
import torch

from unirl.stages.kernels.advantage import group_advantages, group_stats

EPS = 1e-6


def test_one_group_by_hand():
    # mean = 0.75; deviations .25, -.75, .25, .25; var = (3*.0625 + .5625)/4 = .1875 (ddof=0)
    std = math.sqrt(0.1875)  # 0.4330127
    adv = group_advantages([1.0, 0.0, 1.0, 1.0], ["p"] * 4)
    expected = torch.tensor([0.25, -0.75, 0.25, 0.25]) / (std + EPS)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(adv, torch.tensor([0.57735, -1.73205, 0.57735, 0.57735]), atol=1e-4, rtol=0)


def test_groups_are_independent_and_interleaved_ids_work():
    # group a = [1, 0, 1, 1] (as above), group b = [2, 4]: mean 3, std 1 -> -1, +1
    rewards = torch.tensor([1.0, 2.0, 0.0, 1.0, 4.0, 1.0])
    ids = ["a", "b", "a", "a", "b", "a"]
    adv = group_advantages(rewards, ids)
    a = 1 / (math.sqrt(0.1875) + EPS)
    expected = torch.tensor([0.25 * a, -1 / (1 + EPS), -0.75 * a, 0.25 * a, 1 / (1 + EPS), 0.25 * a])
    torch.testing.assert_close(adv, expected)


def test_equal_rewards_give_exactly_zero():
    # 0.1 is not exact in binary: r - mean(r) leaves a ~1e-17 residue for three copies of it.
    adv = group_advantages([0.1, 0.1, 0.1, 1.0, 0.0], ["a", "a", "a", "b", "b"])
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    # group b: mean .5, std .5
    torch.testing.assert_close(adv[3:], torch.tensor([0.5, -0.5]) / (0.5 + EPS))
    assert group_advantages([5.0], ["only"]).tolist() == [0.0]


def test_without_normalize_only_the_mean_is_subtracted():
    adv = group_advantages(np.array([1.0, 0.0, 1.0, 1.0]), ["p"] * 4, normalize=False)
    torch.testing.assert_close(adv, torch.tensor([0.25, -0.75, 0.25, 0.25]))


def test_use_global_std():
    # batch [1, 0, 3, 3]: mean 1.75, squared deviations .5625 3.0625 1.5625 1.5625 -> var 1.6875
    global_std = math.sqrt(1.6875)  # 1.2990381
    adv = group_advantages([1.0, 0.0, 3.0, 3.0], ["a", "a", "b", "b"], use_global_std=True)
    # group a: mean .5 -> deviations +.5, -.5 divided by the batch std; group b is flat -> 0
    expected = torch.tensor([0.5, -0.5, 0.0, 0.0]) / (global_std + EPS)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(adv[:2], torch.tensor([0.3849, -0.3849]), atol=1e-4, rtol=0)


def test_scope_global_ignores_groups():
    adv = group_advantages([1.0, 0.0, 3.0, 3.0], ["a", "a", "b", "b"], scope="global")
    expected = torch.tensor([-0.75, -1.75, 1.25, 1.25]) / (math.sqrt(1.6875) + EPS)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(adv, torch.tensor([-0.57735, -1.34715, 0.96225, 0.96225]), atol=1e-4, rtol=0)
    # group b on its own is flat, but within the batch it is above average
    assert adv[2] > 0


def test_scope_global_with_all_equal_batch_is_zero():
    assert group_advantages([0.1] * 3, ["a", "b", "c"], scope="global").tolist() == [0.0] * 3


def test_group_stats():
    rewards = [1.0, 0.0, 1.0, 1.0, 2.0, 2.0, 0.0, 0.0, 0.0]
    ids = ["a"] * 4 + ["b"] * 2 + ["c"] * 3
    stats = group_stats(rewards, ids)
    assert stats["zero_std_group_frac"] == pytest.approx(2 / 3)
    assert stats["num_groups"] == 3
    assert stats["reward_mean"] == pytest.approx(7 / 9)
    assert stats["group_std_mean"] == pytest.approx(math.sqrt(0.1875) / 3)
    assert group_stats([1.0, 0.0], ["a", "a"])["zero_std_group_frac"] == 0.0


@pytest.mark.parametrize(
    ("rewards", "ids", "kwargs", "match"),
    [
        ([1.0, 2.0], ["a"], {}, "rewards has 2 entries but group_ids has 1"),
        ([], [], {}, "empty"),
        ([1.0, 0.0, float("nan")], ["a", "a", "b"], {}, r"index 2 \(group 'b'\) is nan"),
        ([float("inf"), 0.0], ["a", "a"], {}, "index 0"),
        ([[1.0, 0.0]], ["a"], {}, "1-D"),
        ([1.0, 0.0], ["a", "a"], {"scope": "prompt"}, "scope must be one of"),
    ],
)
def test_errors_say_what_is_wrong(rewards, ids, kwargs, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards, ids, **kwargs)


def test_group_stats_validates_too():
    with pytest.raises(ValueError, match="index 1"):
        group_stats([0.0, float("nan")], ["a", "a"])
