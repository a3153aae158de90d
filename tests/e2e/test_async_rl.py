"""The engine server through the real CLI. Sync: one engine process serves every iteration.
Async: the rl-producer flow in its own process samples ahead on the engine server while the
trainer trains, under max_staleness 1. The producer is SIGKILLed as it
commits iteration 1's batch: the trainer starts it again, it resumes at its first uncommitted
batch, and that batch is exactly what the killed producer would have committed (the schedule and
the seeds depend on the iteration alone): nothing lost, nothing sampled or trained twice."""
from __future__ import annotations

import json

import pyarrow.ipc as ipc
import pytest

from tests.conftest import TINY, run_unirl

pytestmark = pytest.mark.slow

ASYNC = ["run", str(TINY), "iterations=3", "reward.scorers=[{name: integer_format}]", "rollout.engine.name=engine_server",
         "rollout.mode=async", "rollout.max_staleness=1", "rollout.correction={}", "eval.enabled=false"]


def resampled_equals_committed(recipe, root, run: str, columns: tuple[str, ...]) -> None:
    """Iteration 1's batch sampled again from scratch with version 0 on a fresh engine server equals
    what the (restarted) producer committed, in `columns`."""
    from unirl.stages.runtime.registry import engines
    from unirl.stages.runtime.sample import read_rollouts
    from unirl.stages.runtime.storage import RunStorage

    storage = RunStorage(str(root), run)
    engine = engines.get("engine_server")(recipe, storage, None)
    try:
        requests = storage.stage_manifest(1, "requests")
        assert requests is not None, "iteration 1's requests were committed"
        again = read_rollouts(storage, engine.generate(requests["files"][0], "check/rollouts", 1, 0)["files"])
    finally:
        engine.close()
    committed = read_rollouts(storage, ["iter-000001/rollouts/part-000.arrow"])
    for column in columns:
        assert again.column(column).to_pylist() == committed.column(column).to_pylist(), column


def test_a_killed_producer_is_restarted_and_loses_nothing(tmp_path, unirl_env):
    from unirl.stages.recipe import load_recipe
    from unirl.stages.run.audit import audit_run
    from unirl.stages.runtime.storage import RunStorage

    root = tmp_path / "runs"
    out = run_unirl([*ASYNC, f"storage.root={root}"], {**unirl_env, "UNIRL_FAULTS": "produce@1"})
    assert "producer (pid" in out.stdout + out.stderr and "starting it again" in out.stdout + out.stderr
    run = root / "tiny"
    for i in range(3):
        produced = json.loads((run / f"iter-{i:06d}/manifests/produce.json").read_text())
        assert produced["policy_version"] == max(0, i - 1)  # the schedule: version k - max_staleness
        rows = ipc.open_file(str(run / f"iter-{i:06d}/rollouts/part-000.arrow")).read_all()
        assert set(rows.column("policy_version").to_pylist()) == {max(0, i - 1)}
        gen = json.loads((run / f"iter-{i:06d}/manifests/generate.json").read_text())
        assert gen["files"] == produced["files"] and gen["metrics"]["rollout/stale_groups_dropped"] == 0
        train = json.loads((run / f"iter-{i:06d}/train.json").read_text())["metrics"]
        assert train["stale_frac"] == (0.0 if i == 0 else 1.0) and train["is_weight_mean"] > 0
        assert (train["behaviour_logp_max_abs_diff"] <= 1e-4) == (i == 0)  # stale rows differ, and are measured
    assert (run / "weights/v000003/manifest.json").is_file()
    report = audit_run(RunStorage(str(root), "tiny"))  # each group trained once, across the producer's restart
    assert report.ok and [line.versions for line in report.lines] == [(0, 0), (0, 0), (1, 1)], report.text()
    # iteration 1's batch, sampled again from scratch with version 0: the restarted producer's rows
    resampled_equals_committed(load_recipe(str(TINY), [*ASYNC[2:], f"storage.root={root}"]), root, "tiny",
                               ("sample_id", "response_ids", "response_logprobs"))


def test_a_sync_engine_serves_every_iteration_without_a_restart(tmp_path, unirl_env):
    """The engine starts inside iteration 0's flow run (each iteration's run has a thread of its
    own: they are started ahead) and must outlive that thread: iteration 1 samples on the same
    engine, synced to version 1. (It used to be SIGKILLed as iteration 0's thread ended, and every
    later iteration paid a restart, until the restarts ran out.)"""
    root = tmp_path / "runs"
    out = run_unirl(["run", str(TINY), "iterations=2", "reward.scorers=[{name: integer_format}]",
                     "rollout.engine.name=engine_server", "eval.enabled=false", f"storage.root={root}"], unirl_env)
    said = out.stdout + out.stderr
    assert "rollout engine died" not in said and "starting it again" not in said, said[-3000:]
    for i in range(2):
        rows = ipc.open_file(str(root / "tiny" / f"iter-{i:06d}/rollouts/part-000.arrow")).read_all()
        assert set(rows.column("policy_version").to_pylist()) == {i}
        train = json.loads((root / "tiny" / f"iter-{i:06d}/train.json").read_text())["metrics"]
        assert train["behaviour_logp_max_abs_diff"] <= 1e-4  # the engine's record, replayed by the trainer


# The diffusion quickstart's tiny SD3 (16 px), no warm start, 4 prompts x 4 images of 3 SDE steps.
FLOW_ASYNC = ["run", "recipes/diffusion/quickstart.yaml", "model.tiny={image_size: 16}", "sft=null", "iterations=3",
              "checkpoint_every=3", "rollout.prompts_per_iteration=4", "rollout.group_size=4", "rollout.sampler.num_steps=3",
              "rollout.sampler.sde_steps={mode: all}", "reward.scorers=[{name: brightness}]", "eval.enabled=false",
              "tracking.preview_every=0", "rollout.engine.name=engine_server", "rollout.mode=async", "rollout.max_staleness=1",
              "rollout.correction={}"]


def test_an_async_flow_run_resumes_a_killed_producer_and_weighs_the_older_rows(tmp_path, unirl_env):
    """Flow-GRPO on the engine server, async under max_staleness 1, the producer SIGKILLed as it
    commits iteration 1's batch: restarted, it commits what the killed one would have (latents and
    step log-probs of version 0, sampled again); iteration 0 replays its rows bit for bit, the later
    ones (version i - 1) train under the per-step correction; `unirl audit` passes."""
    from tests.conftest import REPO
    from unirl.stages.recipe import load_recipe
    from unirl.stages.run.audit import audit_run
    from unirl.stages.runtime.storage import RunStorage

    root = tmp_path / "runs"
    args = [FLOW_ASYNC[0], str(REPO / FLOW_ASYNC[1]), *FLOW_ASYNC[2:], f"storage.root={root}"]
    out = run_unirl(args, {**unirl_env, "UNIRL_FAULTS": "produce@1"})
    assert "starting it again" in out.stdout + out.stderr
    run = root / "diffusion-quickstart"
    for i in range(3):
        rows = ipc.open_file(str(run / f"iter-{i:06d}/rollouts/part-000.arrow")).read_all()
        assert set(rows.column("policy_version").to_pylist()) == {max(0, i - 1)}
        train = json.loads((run / f"iter-{i:06d}/train.json").read_text())["metrics"]
        assert train["stale_frac"] == (0.0 if i == 0 else 1.0) and train["is_weight_mean"] > 0
        assert (train["behaviour_logp_max_abs_diff"] == 0.0) == (i == 0)
    report = audit_run(RunStorage(str(root), "diffusion-quickstart"))
    assert report.ok and [line.versions for line in report.lines] == [(0, 0), (0, 0), (1, 1)], report.text()
    resampled_equals_committed(load_recipe(str(REPO / FLOW_ASYNC[1]), [*FLOW_ASYNC[2:], f"storage.root={root}"]), root,
                               "diffusion-quickstart", ("sample_id", "latents", "sde_logprobs"))


# The partial-rollout recipe (echo: write back the prompt's digits) shortened: strings of 1-2 digits,
# a third of 3-6, against a segment of 2 tokens, so groups with a longer answer are cut and finish in
# the next batch.
PARTIAL = ["iterations=4", "checkpoint_every=2", "sft.steps=100", "sft.noise=0", "rollout.prompts_per_iteration=8",
           "rollout.group_size=4", "data.short=2", "data.long=6", "data.long_frac=0.3", "data.heldout_size=10",
           "rollout.max_new_tokens=7", "rollout.max_staleness=2", "rollout.partial={segment_tokens: 2}", "eval.enabled=false"]


def test_partial_rollouts_carry_cut_groups_with_their_token_versions_through_a_kill(tmp_path, unirl_env):
    """Async GRPO with partial rollouts, the producer SIGKILLed as it commits batch 2: every batch
    trains the groups that finished; a group cut in batch j goes on in batch j+1 from its first
    tokens of version b(j), the rest of later versions (`token_versions`, policy_version the oldest);
    the restarted producer commits what the killed one would have (batch 2 sampled again from its
    requests and batch 1's carry); `unirl audit` passes, and fails a row whose oldest token is
    older than max_staleness allows."""
    import pyarrow as pa

    from tests.conftest import REPO
    from unirl.stages.recipe import load_recipe
    from unirl.stages.run.audit import audit_run
    from unirl.stages.runtime.registry import engines
    from unirl.stages.runtime.sample import read_rollouts, read_shard, write_shard
    from unirl.stages.runtime.storage import RunStorage

    root = tmp_path / "runs"
    recipe_path = str(REPO / "recipes/ar/partial.yaml")
    out = run_unirl(["run", recipe_path, *PARTIAL, f"storage.root={root}"], {**unirl_env, "UNIRL_FAULTS": "produce@2"})
    assert "starting it again" in out.stdout + out.stderr
    storage = RunStorage(str(root), "partial")
    continued = 0
    for i in range(4):
        produced = storage.stage_manifest(i, "produce")
        assert produced["policy_version"] == max(0, i - 1)  # partial rollouts: one update ahead
        rows = read_rollouts(storage, produced["files"]).to_pylist()
        carry = read_shard(storage, produced["carry"], "rollouts").to_pylist()
        for row in rows:
            versions = row["token_versions"]
            assert len(versions) == len(row["response_ids"]) == len(row["response_logprobs"]) and versions == sorted(versions)
            assert row["policy_version"] == min(versions) and set(versions) <= {max(0, i - 2), max(0, i - 1)}
            continued += len(set(versions)) > 1
        carried = {r["group_id"] for r in carry}
        assert carried.isdisjoint({r["group_id"] for r in rows})
        if i < 3:  # what batch i cut, batch i+1 goes on with (finished, or cut again): its first tokens as they were
            after = storage.stage_manifest(i + 1, "produce")
            later = {r["sample_id"]: r for r in [*read_rollouts(storage, after["files"]).to_pylist(),
                                                 *read_shard(storage, after["carry"], "rollouts").to_pylist()]}
            for r in carry:
                assert later[r["sample_id"]]["response_ids"][:len(r["response_ids"])] == r["response_ids"]
                assert later[r["sample_id"]]["token_versions"][:len(r["response_ids"])] == r["token_versions"]
    assert continued > 0, "no sample was cut and continued: the test's segment cuts nothing"
    report = audit_run(storage)
    assert report.ok, report.text()

    # batch 2 sampled again from scratch (version 1, batch 1's carry): what the restarted producer committed
    recipe = load_recipe(recipe_path, [*PARTIAL, f"storage.root={root}"])
    engine = engines.get("engine_server")(recipe, storage, None)
    try:
        again = engine.generate(storage.stage_manifest(2, "requests")["files"][0], "check/rollouts", 2, 1,
                                carried=storage.stage_manifest(1, "produce")["carry"])
    finally:
        engine.close()
    committed = read_rollouts(storage, storage.stage_manifest(2, "produce")["files"])
    for column in ("sample_id", "response_ids", "response_logprobs", "token_versions"):
        assert read_rollouts(storage, again["files"]).column(column).to_pylist() == committed.column(column).to_pylist()

    # a trained row whose first token is older than the bound: the audit names it
    rel = storage.stage_manifest(3, "produce")["files"][0]
    table = read_shard(storage, rel, "rollouts")
    versions = table.column("token_versions").to_pylist()
    versions[0] = [0] + versions[0][1:]  # trained at version 3, max_staleness 2: version 0 is too old
    table = table.set_column(table.schema.get_field_index("token_versions"), "token_versions",
                             pa.array(versions, pa.list_(pa.int32())))
    write_shard(storage, rel, table)
    failed = audit_run(storage)
    assert not failed.ok and any("oldest token" in v for v in failed.violations) \
        and any("3 older than the iteration" in v for v in failed.violations), failed.text()
