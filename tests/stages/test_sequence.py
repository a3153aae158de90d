"""The iteration sequence (stages/run/sequence.py), written once for every run shape: its order,
DAPO's refill rule, and what the iteration reports, on steps that record what they are given."""
from __future__ import annotations

from typing import Any

from tests.conftest import TINY
from unirl.stages.recipe import load_recipe
from unirl.stages.run.sequence import Batch, Steps, Update, run_iteration


def recorded(informative: list[int], teachers: int = 0) -> tuple[Steps, list[tuple[Any, ...]]]:
    """Steps that log each call; round r's scoring finds `informative[r]` informative groups."""
    calls: list[tuple[Any, ...]] = []

    def generate(r: int) -> Batch:
        calls.append(("generate", r))
        return Batch([f"rollouts-r{r}"], {"": [f"rollouts-r{r}"]}, {"rollout/stale": 1.0} if r == 0 else {},
                     {"time/generate_s": 1.0 + r})

    def score(files: list[str], r: int) -> dict[str, Any]:
        calls.append(("score", tuple(files), r))
        return {"files": [f"rewards-r{r}"], "metrics": {"rollout/reward_mean": 0.1 * (r + 1)},
                "informative_groups": informative[r], "seconds": 0.5}

    def teach(files: list[str]) -> list[dict[str, Any]]:
        calls.append(("teach", tuple(files)))
        return [{"files": [f"teacher-{t}"], "seconds": 2.0} for t in range(teachers)]

    def advantage(rewards: list[str], rollouts: list[str], taught: list[str]) -> dict[str, Any]:
        calls.append(("advantage", tuple(rewards), tuple(rollouts), tuple(taught)))
        return {"files": ["advantages"], "metrics": {"advantage/mean": 0.0}, "seconds": 0.25}

    def update(rollouts: dict[str, list[str]], adv: dict[str, Any]) -> Update:
        calls.append(("update", {k: tuple(v) for k, v in rollouts.items()}, adv["files"][0]))
        return Update({"train/loss": 0.5}, {"time/train_s": 3.0, "time/sync_s": 0.125}, {"policy_version": 8})

    return Steps(generate, score, advantage, update, teach if teachers else None), calls


def test_one_round_in_order_and_its_report():
    recipe = load_recipe(TINY)
    steps, calls = recorded([recipe.rollout.prompts_per_iteration])
    out = run_iteration(recipe, 7, steps)
    assert [c[0] for c in calls] == ["generate", "score", "advantage", "update"]
    assert calls[2] == ("advantage", ("rewards-r0",), ("rollouts-r0",), ())
    assert out["iteration"] == 7 and out["policy_version"] == 8
    m = out["metrics"]
    assert (m["rollout/stale"], m["rollout/reward_mean"], m["advantage/mean"], m["train/loss"]) == (1.0, 0.1, 0.0, 0.5)
    assert (m["time/generate_s"], m["time/score_s"], m["time/advantage_s"], m["time/train_s"], m["time/sync_s"]) == \
        (1.0, 0.5, 0.25, 3.0, 0.125)
    assert "time/teacher_s" not in m and m["time/iteration_s"] >= 0


def test_dapo_refills_until_enough_groups_carry_signal_or_the_cap():
    """Rounds go on while the informative groups found so far are fewer than prompts_per_iteration
    and fewer than max_rounds rounds ran; every round's samples train, the first round's rewards
    are reported, and the sampling time is the rounds' sum."""
    recipe = load_recipe(TINY, ["rollout.dynamic_sampling={max_rounds: 3}"])
    n = recipe.rollout.prompts_per_iteration
    steps, calls = recorded([n - 2, 1, 5])
    out = run_iteration(recipe, 0, steps)
    assert [c[0] for c in calls] == ["generate", "score", "generate", "score", "generate", "score", "advantage", "update"]
    assert calls[-2][1:3] == (("rewards-r0", "rewards-r1", "rewards-r2"), ("rollouts-r0", "rollouts-r1", "rollouts-r2"))
    assert calls[-1][1] == {"": ("rollouts-r0", "rollouts-r1", "rollouts-r2")}
    assert out["metrics"]["rollout/reward_mean"] == 0.1 and out["metrics"]["time/generate_s"] == 1.0 + 2.0 + 3.0
    steps, calls = recorded([n - 1, 1, 0])  # enough after two rounds
    run_iteration(recipe, 0, steps)
    assert [c[0] for c in calls].count("generate") == 2
    steps, calls = recorded([0, 0, 0, 0])  # no signal at all: the cap
    run_iteration(recipe, 0, steps)
    assert [c[0] for c in calls].count("generate") == 3


def test_teachers_score_every_round_before_the_advantages():
    recipe = load_recipe(TINY)
    steps, calls = recorded([recipe.rollout.prompts_per_iteration], teachers=2)
    out = run_iteration(recipe, 0, steps)
    assert [c[0] for c in calls] == ["generate", "score", "teach", "advantage", "update"]
    assert calls[3][3] == ("teacher-0", "teacher-1") and out["metrics"]["time/teacher_s"] == 4.0
