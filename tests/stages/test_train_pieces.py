"""Training pieces: label masks, lr schedules by hand, EMA by hand, sampling primitives, seeds."""
from __future__ import annotations

import math

import pytest
import torch

from unirl.stages.policies.text import token_batch
from unirl.stages.policies.text_sampling import inverse_cdf, top_p_filter
from unirl.stages.runtime.seeds import derive_seed
from unirl.stages.train.stack import EMA, lr_factor


def test_token_batch_masks_exactly_the_response_labels():
    b = token_batch([[1, 2, 3], [4]], [[7, 8], [9, 10, 11]], pad_id=0, device=torch.device("cpu"))
    assert b["ids"].tolist() == [[1, 2, 3, 7, 8], [4, 9, 10, 11, 0]]
    assert b["attn"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    # label t+1 is predicted at t: response tokens 7, 8 sit at labels 2, 3 (ids[1:] = 2 3 7 8)
    assert b["mask"].tolist() == [[0, 0, 1, 1], [1, 1, 1, 0]]


@pytest.mark.parametrize("schedule,step,expected", [
    ("constant", 0, 0.5), ("constant", 1, 1.0), ("constant", 50, 1.0),
    ("linear", 2, 1.0), ("linear", 6, 0.5), ("linear", 10, 0.0), ("linear", 99, 0.0),
    ("cosine", 2, 1.0), ("cosine", 6, 0.5), ("cosine", 10, 0.0),
])
def test_lr_factor_by_hand(schedule, step, expected):
    # warm-up 2 steps: 1/2, 2/2; then 8 steps of decay to 0 at step 10
    assert lr_factor(step, schedule=schedule, warmup=2, total=10, min_ratio=0.0) == pytest.approx(expected)


def test_cosine_floor_and_quarter_point():
    # progress 1/4: 0.1 + 0.9 * (1 + cos(pi/4)) / 2
    assert lr_factor(2, schedule="cosine", warmup=0, total=8, min_ratio=0.1) == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2)
    with pytest.raises(ValueError, match="allowed: constant, linear, cosine"):
        lr_factor(0, schedule="step", warmup=0, total=1, min_ratio=0)


def test_ema_update_by_hand():
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    ema = EMA(model, decay=0.9)
    with torch.no_grad():
        model.weight.fill_(3.0)
    ema.update(model)  # 0.9 * 1 + 0.1 * 3
    assert ema.shadow["weight"].item() == pytest.approx(1.2)
    ema.update(model)  # 0.9 * 1.2 + 0.1 * 3
    assert ema.shadow["weight"].item() == pytest.approx(1.38)


def test_top_p_keeps_smallest_set_reaching_the_mass():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = top_p_filter(probs, 0.7)  # 0.5 alone < 0.7, so 0.5 and 0.3 stay
    assert torch.allclose(kept, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    assert torch.equal(top_p_filter(probs, 1.0), probs)


def test_inverse_cdf_picks_the_interval_of_u():
    probs = torch.tensor([[0.2, 0.3, 0.5]] * 4)
    u = torch.tensor([0.0, 0.19, 0.2, 0.99])
    assert inverse_cdf(probs, u).tolist() == [0, 0, 1, 2]


# sha256 of the joined parts, first 8 bytes little-endian, top bit cleared; computed once with
# hashlib on "0/3/g/1", "0/3/g/2", "x", "7:group:g1". A change here changes every noise draw
# of every recorded run, and a resumed run would no longer draw what it drew before.
SEEDS = [((0, 3, "g/1"), "/", 5077202418524524412), ((0, 3, "g/2"), "/", 2594549709598086920),
         (("x",), "/", 4949498559009812781), ((7, "group", "g1"), ":", 6440037467012009200)]


def test_derive_seed_is_the_recorded_sha256_prefix():
    assert [derive_seed(*parts, sep=sep) for parts, sep, _ in SEEDS] == [seed for *_, seed in SEEDS]


def test_derive_seed_is_the_same_in_interpreters_with_other_hash_salts():
    """Python salts hash() per process (PYTHONHASHSEED); a seed built on it would differ here."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    cases = [(p, s, 0) for p, s, _ in SEEDS]
    script = f"from unirl.stages.runtime.seeds import derive_seed; print([derive_seed(*p, sep=s) for p, s, _ in {cases!r}])"
    repo = Path(__file__).resolve().parents[2]
    printed = {subprocess.run([sys.executable, "-c", script], cwd=repo, capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": salt}).stdout.strip() for salt in ("1", "2")}
    assert printed == {repr([seed for *_, seed in SEEDS])}
