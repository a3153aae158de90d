"""Rollout accumulation (`train.accumulate_rollouts`, stages/runtime/accumulation.py): the window
arithmetic, what validate refuses, and the update on a window's batches, which must be the update
on one batch of the same rows (the loss normalised over their union), through the worker's own
train command on a tiny text family and a tiny flow family."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch

from tests.conftest import REPO, recipe_errors
from tests.tiny import TINY, merged
from unirl.stages.recipe import build_recipe
from unirl.stages.runtime import accumulation as acc
from unirl.stages.runtime.storage import RunStorage, iter_dir, join


def test_windows_versions_and_the_schedule():
    from unirl.stages.runtime.accumulation import schedule_steps

    two = build_recipe({"iterations": 6, "train": {"accumulate_rollouts": 2, "updates_per_batch": 3}})
    assert [acc.version_of(two, i) for i in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [acc.version_after(two, i) for i in range(6)] == [0, 1, 1, 2, 2, 3]
    assert [acc.closes(two, i) for i in range(6)] == [False, True] * 3
    assert list(acc.window(two, 3)) == [2, 3] and acc.closing_iteration(two, 2) == 3 and acc.final_version(two) == 3
    assert schedule_steps(two, 6) == 9  # 3 updates of updates_per_batch optimizer steps each


def test_one_batch_per_update_is_the_run_without_accumulation():
    from unirl.stages.runtime.accumulation import schedule_steps

    one = build_recipe({"iterations": 5, "train": {"updates_per_batch": 2}})
    assert one.train.accumulate_rollouts == 1
    assert [acc.version_of(one, i) for i in range(5)] == list(range(5))
    assert [acc.version_after(one, i) for i in range(5)] == list(range(1, 6))
    assert all(acc.closes(one, i) and list(acc.window(one, i)) == [i] for i in range(5))
    assert schedule_steps(one, 5) == 10 and acc.final_version(one) == 5
    # resuming with another M is refused (the fingerprint differs); the default leaves the field out of it
    five = build_recipe({"iterations": 5, "train": {"updates_per_batch": 2, "accumulate_rollouts": 5}})
    assert one.fingerprint() != five.fingerprint()
    assert "accumulate_rollouts" in one.to_yaml()  # the resolved recipe still says what ran


def test_validate_refuses_what_cannot_accumulate():
    assert any("greater than or equal to 1" in e for e in recipe_errors({"train": {"accumulate_rollouts": 0}}))
    assert recipe_errors({"iterations": 5, "train": {"accumulate_rollouts": 2}}) == [
        "iterations: 5 is not a multiple of train.accumulate_rollouts (2): the last 1 iteration(s) would sample batches "
        "that no optimizer step trains; set iterations to 4 or 6"]
    from unirl.stages.recipe import RecipeError, load_recipe

    with pytest.raises(RecipeError) as caught:
        load_recipe(REPO / "recipes/unified/quickstart.yaml", ["iterations=4", "train.accumulate_rollouts=2"])
    errors = caught.value.errors
    assert errors == ["train.accumulate_rollouts: a composed run (compose.kind 'unified') takes its update every iteration; "
                      "rollout accumulation is built for single-model runs; set it to 1"]


def test_an_extension_that_ends_mid_window_is_refused():
    from unirl.flows.rl import rl_train

    recipe = build_recipe({"iterations": 4, "train": {"accumulate_rollouts": 2}})
    with pytest.raises(ValueError, match=r"^iterations: 5 is not a multiple of train.accumulate_rollouts \(2\)"):
        rl_train.fn(recipe, "r", iterations=5)


# -- the update on a window is the update on one batch of its rows -----------------------------------


ALGORITHM = {"qwen3": "grpo", "sd3": "flow_grpo"}


def worker(case: str, root, scratch, weights, **train):
    from unirl.stages.workers.worker import Worker

    recipe = build_recipe(merged(TINY[case], {"iterations": 2, "storage": {"root": str(root)}, "algorithm": {"name": ALGORITHM[case]},
                                              "train": {"micro_batch_size": 3, **train}}))
    spec = {"recipe": recipe.model_dump(mode="json"), "root": str(root), "run": "run", "weights_dir": str(weights),
            "scratch": str(scratch)}
    return Worker(spec, None, torch.device("cpu")), recipe


def params(w) -> list[torch.Tensor]:
    return [p.detach().clone() for p in w.stack.module.parameters()]


@pytest.mark.parametrize("case", ["qwen3", "sd3"])
def test_two_accumulated_batches_update_as_one_batch_of_their_rows(case, tmp_path, tiny_weights):
    """Iterations 0 and 1 of an accumulate_rollouts=2 run, sampled by version 0 (iteration 0's
    batch keeps 2 of its groups, as dynamic sampling would, so the batches differ in size and a
    per-batch normaliser would weigh their rows otherwise), updated at iteration 1 on both; and a
    worker of a run without accumulation updated on one batch made of the same rows. The same
    gradient norm and loss, and the same parameters after the step, to fp32 rounding (micro-batches
    of 3 cut both alike). Normalising each batch on its own instead, half the loss each (two parts
    of the update), moves the parameters elsewhere: the comparison would see it."""
    from unirl.stages.run import iteration as it
    from unirl.stages.runtime.sample import read_rollouts, read_shard, write_shard
    from unirl.stages.train.update import UpdatePart, joint_update

    weights = tiny_weights(case)
    acc_w, recipe = worker(case, tmp_path, tmp_path / "acc", weights, accumulate_rollouts=2)
    storage = RunStorage(recipe.storage.root, "run")
    batches = []
    for i in range(2):
        req = it.write_requests(storage, recipe, i)
        gen = acc_w.generate(iteration=i, requests=req["files"][0], out_dir=join(iter_dir(i), "rollouts"))
        adv = it.advantages(storage, recipe, i, it.score(storage, recipe, i, gen["files"])["files"])["files"][0]
        if i == 0:
            table = read_shard(storage, adv, "advantages")
            kept = sorted(set(table.column("group_id").to_pylist()))[:1]
            write_shard(storage, adv, table.filter(pc.is_in(table.column("group_id"), value_set=pa.array(kept))))
        batches.append({"rollouts": gen["files"], "advantages": adv})
    sizes = [read_shard(storage, b["advantages"], "advantages").num_rows for b in batches]
    assert sizes[0] < sizes[1]
    assert acc_w.version == 0 and all(set(read_rollouts(storage, b["rollouts"]).column("policy_version").to_pylist()) == {0}
                                      for b in batches)

    # the per-batch normaliser, for contrast: each batch a part of its own, half the loss each
    contrast, _ = worker(case, tmp_path, tmp_path / "contrast", weights, accumulate_rollouts=2)
    stage = contrast.stages[""]
    parts = [UpdatePart(stage.policy, stage.algorithm, *contrast._cut(b["rollouts"], b["advantages"])[""][:2], stage.tolerance, 0.5)
             for b in batches]
    joint_update(contrast.stack, parts, iteration=1, seed=recipe.seed, version=0)

    before = params(acc_w)
    trained = acc_w.train(iteration=1, rollouts=batches[1]["rollouts"], advantages=batches[1]["advantages"], earlier=batches[:1])
    assert trained["policy_version"] == acc_w.version == 1

    one_w, one_recipe = worker(case, tmp_path, tmp_path / "one", weights)
    assert one_recipe.train.accumulate_rollouts == 1
    one = storage
    rows = pa.concat_tables([read_rollouts(storage, b["rollouts"]) for b in batches]).sort_by("sample_id")
    advantages = pa.concat_tables([read_shard(storage, b["advantages"], "advantages") for b in batches])
    write_shard(one, "batch/rollouts.arrow", rows)
    write_shard(one, "batch/advantages.arrow", advantages)
    single = one_w.train(iteration=1, rollouts=["batch/rollouts.arrow"], advantages="batch/advantages.arrow")

    a, b = trained["metrics"], single["metrics"]
    assert a["grad_norm"] > 0 and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
    moved = max(float((p - q).abs().max()) for p, q in zip(params(acc_w), before))
    assert moved > 1e-4, "the update moved nothing"
    same = max(float((p - q).abs().max()) for p, q in zip(params(acc_w), params(one_w)))
    assert same <= 1e-6, f"the window's update differs from one batch's by {same:.3g}"
    other = max(float((p - q).abs().max()) for p, q in zip(params(contrast), params(one_w)))
    assert other > 100 * max(same, 1e-8), f"a per-batch normaliser lands {other:.3g} from one batch's update"


def test_the_in_process_loop_updates_once_per_window(tiny_weights):
    """The benchmarks' floor (stages/run/loop.py) keeps a window's batches until its last iteration."""
    from unirl.stages.run.loop import InProcessLoop

    recipe = build_recipe(merged(TINY["qwen3"], {"iterations": 2, "train": {"accumulate_rollouts": 2}}))
    loop = InProcessLoop(recipe, str(tiny_weights("qwen3")))
    first = loop.iteration(0)
    assert first["train/accumulated_batches"] == 1 and "train/loss" not in first and loop.worker.version == 0
    second = loop.iteration(1)
    assert second["train/accumulated_batches"] == 2 and second["train/grad_norm"] > 0 and loop.worker.version == 1
    assert loop.worker.stack.opt_steps == 1 and not loop.storage.fs.exists(loop.storage.path(iter_dir(0)))
