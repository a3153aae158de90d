"""The seams: recipes validated whole from the registries, the behaviour-policy check that fails on
a perturbed weight, and no family or algorithm name compared outside its own file. (That every
recipe field is read by something is checked at the end of the suite: tests/recipe_fields.py.)"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from tests import zygote
from tests.conftest import REPO
from tests.conftest import recipe_errors as errors
from tests.tiny import TINY, merged
from unirl.stages.algorithms import BehaviourMismatchError
from unirl.stages.recipe import build_recipe
from unirl.stages.runtime.registry import algorithms, families

SOURCES = [p for d in ("stages", "flows", "tasks") for p in (REPO / d).rglob("*.py")]


def sd3(**over) -> dict:
    return merged(TINY["sd3"], {"algorithm": {"name": "flow_grpo"}}, over)


def qwen3(**over) -> dict:
    return merged(TINY["qwen3"], over)


# -- recipes validated whole ------------------------------------------------------------------


def test_a_family_cannot_carry_the_other_policys_sampling_fields():
    (err,) = errors(sd3(rollout={"max_new_tokens": 8}))
    assert err.startswith("rollout.max_new_tokens: unknown field for rollout.kind 'flow'; rollout.kind 'text' takes it (allowed: ")
    assert "sampler" in err
    (err,) = errors(qwen3(rollout={"sampler": {"num_steps": 4}}))
    assert err.startswith("rollout.sampler: unknown field for rollout.kind 'text'; rollout.kind 'flow' takes it (allowed: ")
    assert "max_new_tokens" in err
    errs = errors({"model": {"kind": "qwen3"}, "rollout": {"kind": "flow"}, "algorithm": {"name": "grpo"}})
    assert "rollout.kind: 'flow' sampling does not run model.kind 'qwen3', whose policy is 'text'; remove rollout.kind" in errs


def test_an_algorithm_of_the_other_segment_kind_is_refused_naming_both():
    (err,) = errors(qwen3(algorithm={"name": "flow_grpo"}))
    assert err == ("algorithm.name: 'flow_grpo' trains latent segments, but model.kind 'qwen3' produces text segments "
                   "(allowed: drpo, grpo, gspo)")
    (err,) = errors(sd3(algorithm={"name": "grpo"}))
    assert err.startswith("algorithm.name: 'grpo' trains text segments, but model.kind 'sd3' produces latent segments")


def test_several_updates_for_an_algorithm_that_cannot_are_refused(monkeypatch):
    class OneShot(algorithms.get("grpo")):
        supports_multi_update = False

    monkeypatch.setitem(algorithms._entries, "grpo", OneShot)
    (err,) = errors(qwen3(train={"updates_per_batch": 2}))
    assert err == ("train.updates_per_batch: algorithm 'grpo' takes one update per batch, not 2; set "
                   "train.updates_per_batch=1 or choose another algorithm.name")


def test_nft_without_ema_fails_validate_in_the_cli(tmp_path):
    bad = zygote.run([sys.executable, "-m", "unirl.flows.cli", "validate", str(REPO / "recipes/diffusion/nft.yaml"), "train.ema=null"],
                     cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 2
    assert "train.ema: algorithm `nft` samples with and regresses against an EMA old policy" in bad.stderr


def test_scorers_declare_their_params_and_what_they_read():
    (err,) = errors(qwen3(reward={"scorers": [{"name": "exact_match", "params": {"strict": True}}]}))
    assert err == "reward.scorers.0.params.strict: unknown param of scorer 'exact_match' (allowed: none)"
    (err,) = errors(qwen3(reward={"scorers": [{"name": "keyword"}]}))
    assert err.startswith("reward.scorers.0.params.keywords: Field required")
    (err,) = errors(qwen3(reward={"scorers": [{"name": "text_length", "params": {"max_length": "long"}}]}))
    assert err.startswith("reward.scorers.0.params.max_length: Input should be a valid integer")
    (err,) = errors(sd3(reward={"scorers": [{"name": "exact_match"}]}))
    assert err == ("reward.scorers.0.name: scorer 'exact_match' reads text, but model.kind 'sd3' produces image; "
                   "choose a scorer that reads image")
    (err,) = errors(qwen3(eval={"scorer": "geneval"}))
    assert err.startswith("eval.scorer: scorer 'geneval' reads image, but model.kind 'qwen3' produces text")
    build_recipe(sd3(reward={"scorers": [{"name": "remote", "params": {"url": "http://127.0.0.1:1"}}]}))  # reads what the server reads


def test_two_scorers_with_one_key_are_refused_and_distinct_keys_are_scored_apart(tmp_path):
    two = [{"name": "text_length", "params": {"max_length": 2}}, {"name": "text_length", "params": {"max_length": 4}}]
    (err,) = errors(qwen3(reward={"scorers": two}))
    assert err == ("reward.scorers.1.key: scorer 'text_length' has the key 'text_length' of reward.scorers.0; "
                   "give one of them another `key`")
    recipe = build_recipe(qwen3(reward={"scorers": [{**two[0], "key": "short"}, {**two[1], "key": "long"}]},
                                storage={"root": str(tmp_path)}))
    from unirl.stages.run import iteration as it
    from unirl.stages.runtime.sample import read_shard, table_from_rows, write_shard
    from unirl.stages.runtime.storage import RunStorage

    storage = RunStorage(str(tmp_path), "run")
    rows = [{"sample_id": "g/0", "group_id": "g", "iteration": 0, "policy_version": 0, "parts": ["text"], "metadata": {},
             "prompt": "p", "prompt_ids": [1], "response_ids": [2, 3, 4], "response_logprobs": [0.0] * 3,
             "finish_reason": "stop", "text": "abc"}]
    write_shard(storage, "r.arrow", table_from_rows(rows, "rollouts", ["text"]))
    it.score(storage, recipe, 0, ["r.arrow"])
    rewards = read_shard(storage, "iter-000000/rewards.arrow", "rewards")
    assert rewards.column("reward/short").to_pylist() == [1.0] and rewards.column("reward/long").to_pylist() == [0.75]
    assert rewards.column("reward").to_pylist() == [1.75]


def test_soft_overlong_and_file_sft_records_from_the_recipe(tmp_path):
    """The recipe's overlong ramp reaches scoring, and `sft.source: file` reaches the SFT records."""
    from unirl.stages.run import iteration as it
    from unirl.stages.runtime.sample import read_shard, table_from_rows, write_shard
    from unirl.stages.runtime.storage import RunStorage
    from unirl.stages.train.sft import write_sft_data

    records = tmp_path / "sft.jsonl"
    records.write_text('{"prompt": "1+2=", "response": "3"}\n{"prompt": "2+2=", "response": "4"}\n')
    recipe = build_recipe(qwen3(reward={"scorers": [{"name": "constant", "params": {"value": 1.0}}],
                                        "overlong": {"truncated": "soft", "buffer": 2, "penalty": 0.5}},
                                sft={"source": "file", "path": str(records)}, storage={"root": str(tmp_path)}))
    storage = RunStorage(str(tmp_path), "run")
    rows = [{"sample_id": f"g/{n}", "group_id": "g", "iteration": 0, "policy_version": 0, "parts": ["text"],
             "metadata": {}, "prompt": "p", "prompt_ids": [1], "response_ids": [2] * n, "response_logprobs": [0.0] * n,
             "finish_reason": "length" if n == 3 else "stop", "text": "x" * n} for n in (1, 2, 3)]
    write_shard(storage, "r.arrow", table_from_rows(rows, "rollouts", ["text"]))
    it.score(storage, recipe, 0, ["r.arrow"])
    # max_new_tokens 3, buffer 2: 0 up to 1 token, then -0.5 * (length - 1) / 2 (DAPO's soft punishment)
    assert read_shard(storage, "iter-000000/rewards.arrow", "rewards").column("reward").to_pylist() == [1.0, 0.75, 0.5]
    sft = read_shard(storage, write_sft_data(storage, recipe)["files"][0], "sft")
    assert sft.column("response").to_pylist() == ["3", "4"]


# -- the behaviour-policy check ---------------------------------------------------------------


def worker_for(family: str, algo: str, tmp_path: Path, weights: Path):
    from unirl.stages.runtime.storage import RunStorage
    from unirl.stages.workers.worker import Worker

    recipe = build_recipe(merged(TINY[family], {"algorithm": {"name": algo}, "storage": {"root": str(tmp_path)}}))
    spec = {"recipe": recipe.model_dump(mode="json"), "root": str(tmp_path), "run": "run", "weights_dir": str(weights),
            "scratch": str(tmp_path / "scratch")}
    return Worker(spec, None, torch.device("cpu")), recipe, RunStorage(str(tmp_path), "run")


@pytest.mark.parametrize("family,algo,param", [("qwen3", "grpo", "lm_head.weight"),
                                               ("sd3", "flow_grpo", "proj_out.weight")])
def test_perturbing_one_weight_between_generate_and_train_raises(family, algo, param, tmp_path, tiny_weights):
    from unirl.stages.run import iteration as it

    w, recipe, storage = worker_for(family, algo, tmp_path, tiny_weights(family))
    requests = it.write_requests(storage, recipe, 0)["files"][0]
    gen = w.generate(iteration=0, requests=requests, out_dir="iter-000000/rollouts")
    adv = it.advantages(storage, recipe, 0, it.score(storage, recipe, 0, gen["files"])["files"])
    weight = dict(w.stack.module.named_parameters())[param]
    with torch.no_grad():
        weight[0].add_(0.5)  # one row of the output layer
    with pytest.raises(BehaviourMismatchError, match=r"iteration 0, rank 0: sample 'iter-000000/it000000-\d+/\d+': the "
                                                     r"trainer's replay of .* differs from the log-probs recorded at sampling time"):
        w.train(iteration=0, rollouts=gen["files"], advantages=adv["files"][0])
    with torch.no_grad():
        weight[0].sub_(0.5)
    w.stack.optimizer.zero_grad(set_to_none=True)
    trained = w.train(iteration=0, rollouts=gen["files"], advantages=adv["files"][0])
    assert 0.0 <= trained["metrics"]["behaviour_logp_max_abs_diff"] <= w.tolerance


def test_a_grpo_clone_that_replays_against_itself_would_not_notice(tmp_path, tiny_weights):
    """The check compares the sampler's record with the trainer's replay: the recorded log-probs
    really reach it (a check against the replay itself, the old `old_logp = logp.detach()` ratio
    test, stays at ratio 1 with the weight perturbed)."""
    from unirl.stages.run import iteration as it

    w, recipe, storage = worker_for("qwen3", "grpo", tmp_path, tiny_weights("qwen3"))
    requests = it.write_requests(storage, recipe, 0)["files"][0]
    gen = w.generate(iteration=0, requests=requests, out_dir="iter-000000/rollouts")
    adv = it.advantages(storage, recipe, 0, it.score(storage, recipe, 0, gen["files"])["files"])
    with torch.no_grad():
        dict(w.stack.module.named_parameters())["lm_head.weight"][0].add_(0.5)
    w.tolerance = float("inf")
    trained = w.train(iteration=0, rollouts=gen["files"], advantages=adv["files"][0])
    assert trained["metrics"]["ratio_min"] == trained["metrics"]["ratio_max"] == 1.0  # the self-check cannot fail
    assert trained["metrics"]["behaviour_logp_max_abs_diff"] > 1e-2  # the behaviour check sees it


# -- no names compared outside the registries -------------------------------------------------


def test_no_family_algorithm_or_engine_name_is_compared_outside_its_own_file():
    """stages/diffusion/sde.py is left out: its step-selection modes ("mixgrpo") are names of its own
    that an algorithm happens to share."""
    from unirl.stages.runtime.registry import engines

    names = families.names() + algorithms.names() + engines.names()
    pattern = re.compile(r"""(==|!=)\s*["'](%s)["']|["'](%s)["']\s*(==|!=)|\bin\s*[\(\[\{][^)\]\}]*["'](%s)["']"""
                         % (("|".join(names),) * 3))
    found = []
    for path in SOURCES:
        if path == REPO / "stages" / "diffusion" / "sde.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                found.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not found, "names compared outside the registries:\n" + "\n".join(found)


def test_no_sde_kernel_name_is_compared_outside_its_own_file():
    """A kernel (stages/diffusion/kernels/) is one file: its name, its SGLang counterpart and
    whether it is deterministic are the registry's, not comparisons elsewhere."""
    from unirl.stages.runtime.registry import kernels, policies

    names = [n for n in kernels.names() if n not in policies.names()]  # "flow" is also the flow policy's kind
    pattern = re.compile(r"""(==|!=)\s*["'](%s)["']|["'](%s)["']\s*(==|!=)|\bin\s*[\(\[\{][^)\]\}]*["'](%s)["']"""
                         % (("|".join(names),) * 3))
    kernel_files = REPO / "stages" / "diffusion" / "kernels"
    found = [f"{path.relative_to(REPO)}:{n}: {line.strip()}" for path in SOURCES if kernel_files not in path.parents
             for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, "kernel names compared outside their files:\n" + "\n".join(found)
    assert {"flow", "dance", "cps", "ode"} <= set(kernels.names())


def test_a_composed_shape_is_named_only_in_its_own_files():
    """A composed shape is its two modules, `stages/compose/<kind>.py` (its section, validator and
    composition) and `flows/shapes/<kind>.py` (its tasks and iteration flow), registered under its
    `compose.kind`; no other code compares the kind or mentions it as a string."""
    from unirl.flows.shapes import run_shapes
    from unirl.stages.runtime.registry import shapes

    kinds = shapes.names()
    assert set(kinds) <= set(run_shapes.names()) and {"pipeline", "unified"} <= set(kinds)  # every kind has its flow
    pattern = re.compile(r"""["'](""" + "|".join(kinds) + r""")["']""")
    own = {REPO / d / f"{kind}.py" for kind in kinds for d in ("stages/compose", "flows/shapes")}
    # recipe.py: the message to recipes with the former `unified:` section; deploy.py: recipe folders
    others = own | {REPO / "stages" / "recipe.py", REPO / "flows" / "deploy.py"}
    found = [f"{path.relative_to(REPO)}:{n}: {line.strip()}" for path in SOURCES if path not in others
             for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, "composed shape kinds named outside their files:\n" + "\n".join(found)
    recipe_lines = (REPO / "stages" / "recipe.py").read_text().splitlines()
    assert [line for line in recipe_lines if pattern.search(line)] == [
        line for line in recipe_lines if pattern.search(line) and "replaced by" in line]


def test_no_code_names_a_composed_part():
    """Composition is data: a pipeline's or unified model's parts are named by its recipe, so the
    names two fixed stages once had ("ar", "diffusion") are compared nowhere. flows/deploy.py is
    left out: there they are recipe folders (recipes/ar/, recipes/diffusion/)."""
    pattern = re.compile(r"""["'](ar|diffusion)["']""")
    found = [f"{path.relative_to(REPO)}:{n}: {line.strip()}" for path in SOURCES if path.name != "deploy.py"
             for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, "part names in code:\n" + "\n".join(found)


def test_a_policy_declares_its_segment_columns_wire_and_engine_backend():
    """What adding a policy kind used to take edits in four files for is declared on the policy:
    the rollout shard's segment columns, the dedicated engines' wire and the engine server's backend."""
    from unirl.stages.runtime.registry import load_object, policies
    from unirl.stages.runtime.sample import segment_columns, table_from_rows

    routes = set()
    for name, policy in policies.items():
        assert segment_columns()[policy.segment] is policy.columns, name
        assert callable(load_object(policy.wire).for_engine), name
        backend = load_object(policy.server_backend)
        routes.add(backend.route)
        table = table_from_rows([], "rollouts", [policy.segment])
        assert set(policy.columns) <= set(table.schema.names), name
    assert routes == {"/generate", "/rollout/generate"}  # SGLang's routes, one per policy
