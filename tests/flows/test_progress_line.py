"""The per-iteration progress line `unirl run` prints."""
from __future__ import annotations

from unirl.tasks.console import iteration_line as progress_line

BASE = {"rollout/reward_mean": 0.25, "rollout/reward_std": 0.5, "train/loss": -0.0123, "train/grad_norm": 0.75,
        "time/iteration_s": 2.04}


def test_progress_line_shows_kl_and_clip_when_the_loss_has_them():
    line = progress_line(3, 40, {**BASE, "train/approx_kl": 1.5e-4, "train/clip_frac": 0.0625})
    assert line == ("[unirl] iter-000003 (4/40)  reward 0.250±0.500  loss -0.0123  kl 1.50e-04  clip 0.062"
                    "  grad 0.750  2.0s")


def test_kl_is_left_out_while_the_policy_is_the_one_that_sampled():
    # one on-policy update per batch: the ratio is 1 and approx_kl 0 by construction, on every line
    line = progress_line(3, 40, {**BASE, "train/approx_kl": 0.0, "train/clip_frac": 0.0})
    assert line == "[unirl] iter-000003 (4/40)  reward 0.250±0.500  loss -0.0123  clip 0.000  grad 0.750  2.0s"


def test_progress_line_leaves_out_what_a_likelihood_free_loss_lacks():
    line = progress_line(0, 2, BASE)
    assert line == "[unirl] iter-000000 (1/2)  reward 0.250±0.500  loss -0.0123  grad 0.750  2.0s"
    assert "nan" not in line


def test_an_iteration_that_accumulates_says_its_update_comes_later():
    waiting = {k: v for k, v in BASE.items() if not k.startswith("train/")} | {"train/accumulated_batches": 1}
    assert progress_line(4, 8, waiting) == ("[unirl] iter-000004 (5/8)  reward 0.250±0.500  batch 1 accumulated, "
                                            "no update yet  2.0s")
    assert progress_line(5, 8, {**BASE, "train/accumulated_batches": 2}) == (
        "[unirl] iter-000005 (6/8)  reward 0.250±0.500  loss -0.0123  grad 0.750  2.0s")


def test_a_long_error_keeps_its_first_and_last_lines():
    from unirl.tasks.console import error_text

    exc = RuntimeError("\n".join(f"line {i}" for i in range(100)))
    text = error_text(exc).splitlines()
    assert text[0] == "RuntimeError: line 0" and text[-1] == "line 99" and len(text) == 31
    assert "70 lines more in the run's logs/ folder" in text[8]
    assert error_text(ValueError("short")) == "ValueError: short"
