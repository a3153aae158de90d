"""Multi-domain data and on-policy distillation for text families (docs/distillation.md): the
mixture's split of each iteration's prompts, advantages that never mix domains, the per-token
signal by hand, what validate refuses (a teacher whose tokenizer differs, named with the
student's), and the teacher stage through the real worker: its log-probs are the teacher's own,
recomputed here with transformers alone, and distillation pulls the student towards the teacher."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import recipe_errors
from tests.tiny import TINY, merged
from unirl.stages.recipe import build_recipe
from unirl.stages.runtime.storage import iter_dir, join

ADD = {"name": "arithmetic", "operators": ["+"], "max_value": 12, "seed": 11, "heldout_size": 6}
SUB = {"name": "arithmetic", "operators": ["-"], "max_value": 12, "seed": 12, "heldout_size": 6}


def mixture(*weights: float, **extra) -> dict:
    return {"name": "mixture", "domains": [{"name": "add", "weight": weights[0], "data": ADD, **extra.get("add", {})},
                                           {"name": "sub", "weight": weights[1], "data": SUB, **extra.get("sub", {})}]}


def test_a_mixture_splits_each_iteration_by_weight_and_tags_every_prompt():
    from unirl.stages.runtime.data import build_prompt_source
    from unirl.stages.sources.mixture import shares

    # 5 prompts at weights 1:2 -> 5/3 and 10/3 per iteration: the remainders carry over
    assert [shares([1, 2], i, 5) for i in range(3)] == [[2, 3], [1, 4], [2, 3]]
    assert np.sum([shares([1, 2], i, 5) for i in range(30)], axis=0).tolist() == [50, 100]
    assert [shares([1, 1, 1], i, 2) for i in range(3)] == [[1, 1, 0], [1, 0, 1], [0, 1, 1]]  # every domain gets turns
    source = build_prompt_source(build_recipe({"data": mixture(1, 2)}).data)
    batch = source.batch(4, 6)
    assert [p.metadata["domain"] for p in batch] == ["add"] * 2 + ["sub"] * 4
    assert all(p.prompt_id.startswith(p.metadata["domain"] + ".it000004-") for p in batch)
    assert [("+" in p.text, "-" in p.text) for p in batch] == [(True, False)] * 2 + [(False, True)] * 4
    dev, test = source.heldout("dev"), source.heldout("test")
    assert [p.metadata["domain"] for p in dev] == ["add"] * 6 + ["sub"] * 6
    assert not {p.text for p in dev} & {p.text for p in test}
    assert source.batch(4, 6) == batch  # a resumed run sees the same prompts


def test_advantages_are_computed_within_each_domain(tmp_path):
    """With the batch's standard deviation (use_global_std) a domain's scale must not set another's."""
    from unirl.stages.run.iteration import advantages
    from unirl.stages.runtime.sample import read_shard, table_from_rows, write_shard
    from unirl.stages.runtime.storage import RunStorage

    recipe = build_recipe({"data": mixture(1, 1), "advantage": {"use_global_std": True}})
    storage = RunStorage(str(tmp_path), "run")
    rows = [{"sample_id": f"{g}/{j}", "group_id": g, "reward": r, "domain": d}
            for g, d, rs in (("a0", "add", [0.0, 1.0]), ("s0", "sub", [0.0, 10.0]), ("s1", "sub", [10.0, 10.0]))
            for j, r in enumerate(rs)]
    write_shard(storage, "rewards.arrow", table_from_rows(rows, "rewards"))
    advantages(storage, recipe, 0, ["rewards.arrow"])
    out = read_shard(storage, join(iter_dir(0), "advantages.arrow"), "advantages")
    got = dict(zip(out.column("sample_id").to_pylist(), out.column("advantage").to_pylist()))
    # add: group mean 0.5, domain std of [0, 1] = 0.5 -> -1, +1. sub: group means 5 and 10; the
    # domain's rewards [0, 10, 10, 10] have std sqrt(18.75) = 4.330 -> -5/4.330 = -1.1547, +1.1547, 0, 0.
    # (One std over the whole batch, 4.664, would give add +-0.107.)
    assert [got[k] for k in ("a0/0", "a0/1")] == pytest.approx([-1.0, 1.0], abs=1e-5)
    assert [got[k] for k in ("s0/0", "s0/1", "s1/0", "s1/1")] == pytest.approx([-1.1547, 1.1547, 0, 0], abs=1e-4)
    assert out.column("domain").to_pylist() == ["add"] * 2 + ["sub"] * 4


def test_the_distillation_signal_by_hand():
    from unirl.stages.run.distillation import distill_signal

    student, teacher = [-1.0, -0.5, -2.0], [-0.2, -2.0, -2.0]
    # pure: coef * (log p_T - log p_s) per token = 0.8, -1.5, 0
    assert distill_signal(student, teacher, mode="pure", coef=1.0, advantage=7.0) == pytest.approx([0.8, -1.5, 0.0])
    # additive: A + coef * (...) = 0.5 + 0.5 * (0.8, -1.5, 0) = 0.9, -0.25, 0.5
    assert distill_signal(student, teacher, mode="additive", coef=0.5, advantage=0.5) == pytest.approx([0.9, -0.25, 0.5])
    with pytest.raises(ValueError, match="scored 2 tokens, the student sampled 3"):
        distill_signal(student, teacher[:2], mode="pure", coef=1.0, advantage=0.0)


def distilled(teacher_path: str, **more) -> dict:
    return merged(TINY["qwen3"], {"data": mixture(1, 1, add={"teacher": "t"}, sub={"teacher": "t"}),
                                  "reward": {"scorers": [{"name": "exact_match"}]},
                                  "distill": {"teachers": [{"name": "t", "path": teacher_path}]}}, more)


def test_validate_refuses_what_distillation_cannot_take(tmp_path, tiny_weights):
    from unirl.stages.runtime.registry import families

    student = str(tiny_weights("qwen3"))
    fam = families.get("qwen3")
    other = fam.materialize(fam.config.model_validate({"kind": "qwen3", "tiny": {"hidden_size": 32, "num_hidden_layers": 1,
                                                                                  "intermediate_size": 64, "charset": "0123456789+="}}),
                            tmp_path / "other")
    errors = recipe_errors(distilled(str(other)))
    assert errors == [f"distill.teachers.0: teacher 't' has the tokenizer of {other} (16 tokens), the student the tiny "
                      "model's character tokenizer ('0123456789+-*=() ') (21 tokens); a teacher scores the student's token "
                      "ids, so it must share the student's tokenizer"]
    assert recipe_errors(distilled(student, algorithm={"name": "gspo"})) == [
        "algorithm.name: 'gspo' cannot train on-policy distillation of text segments; use an algorithm that takes "
        "per-token advantages (grpo, drpo)"]
    assert recipe_errors(distilled(str(tmp_path / "nowhere"))) == [
        f"distill.teachers.0.path: '{tmp_path / 'nowhere'}' is not a model folder (no config.json or model_index.json); give the local folder "
        "of a model that model.kind loads"]
    # where prefect.yaml is written the folder may not exist yet (another run makes it): not read there
    assert build_recipe(distilled(str(tmp_path / "nowhere")), local_files=False).distill.teachers[0].path == str(tmp_path / "nowhere")
    untaught = distilled(student)
    untaught["data"]["domains"][1].pop("teacher")
    untaught["distill"]["teachers"].append({"name": "u", "path": student})
    assert recipe_errors(untaught) == [
        "distill.mode: pure distillation needs a teacher for every domain; sub has none (name one in its `teacher`, set "
        "distill.teacher, or use mode: additive)"]
    assert recipe_errors(merged(TINY["qwen3"], {"data": mixture(1, 1, add={"teacher": "t"})})) == [
        "data.domains.0.teacher: 't' is not one of distill.teachers (none: add a distill section)"]
    assert "give exactly one of `path`" in recipe_errors(distilled(student, distill={"teachers": [{"name": "t"}]}))[0]
    build_recipe(distilled(student, distill={"mode": "additive"}))  # the student's own folder teaches fine


def test_the_teacher_stage_scores_the_students_tokens_and_distillation_pulls_towards_the_teacher(tmp_path, tiny_weights):
    """Teacher: the tiny model with perturbed weights, saved as a folder. Its log-probs in the teacher
    shards are recomputed with transformers alone; the advantages are coef * (teacher - student) per
    token; and the reverse KL to the teacher falls over pure-distillation iterations."""
    from transformers import AutoModelForCausalLM

    from unirl.stages.run.loop import InProcessLoop
    from unirl.stages.runtime.sample import read_rollouts, read_shard

    student_dir = str(tiny_weights("qwen3"))
    teacher = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for p in teacher.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    teacher.save_pretrained(tmp_path / "teacher")
    from unirl.stages.runtime.tokenizer import load_tokenizer

    load_tokenizer(student_dir).save_pretrained(tmp_path / "teacher")
    recipe = build_recipe(distilled(str(tmp_path / "teacher"), train={"lr": 3e-2},
                                    distill={"coef": 2.0}, rollout={"prompts_per_iteration": 8}))
    loop = InProcessLoop(recipe, student_dir)
    loop.storage.fs.rm = lambda *args, **kwargs: None  # the loop drops a trained iteration's files; read them here
    first = loop.iteration(0)
    assert first["rollout/add/reward_mean"] >= 0 and "rollout/sub/reward_mean" in first
    rollouts = read_rollouts(loop.storage, [join(iter_dir(0), "rollouts/part-000.arrow")])
    taught = read_shard(loop.storage, join(iter_dir(0), "teacher-t/part-000.arrow"), "teacher")
    adv = read_shard(loop.storage, join(iter_dir(0), "advantages.arrow"), "advantages")
    assert taught.num_rows == rollouts.num_rows == adv.num_rows == 32 and set(taught.column("teacher").to_pylist()) == {"t"}
    teacher_lp = dict(zip(taught.column("sample_id").to_pylist(), taught.column("teacher_logprobs").to_pylist()))
    token_adv = dict(zip(adv.column("sample_id").to_pylist(), adv.column("token_advantages").to_pylist()))
    for sid, prompt, response, student_lp in zip(*(rollouts.column(c).to_pylist() for c in (
            "sample_id", "prompt_ids", "response_ids", "response_logprobs"))):
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logits = teacher(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
        assert teacher_lp[sid] == pytest.approx(want.tolist(), abs=1e-5), sid
        assert token_adv[sid] == pytest.approx([2.0 * (t - s) for s, t in zip(student_lp, teacher_lp[sid])], abs=1e-5)

    # The exact reverse KL of the first answer token's distributions, on the held-out prompts:
    # sum_v p_s(v) (log p_s(v) - log p_T(v)), before and after 5 more distillation iterations.
    from unirl.stages.runtime.data import build_prompt_source

    prompts = [loop.worker.policy.encode([p.text])[0] for p in build_prompt_source(recipe.data).heldout("dev")]

    def reverse_kl() -> float:
        out = []
        for ids in prompts:
            with torch.no_grad():
                s = torch.log_softmax(loop.worker.stack.module(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1)
                t = torch.log_softmax(teacher(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1)
            out.append(float((s.exp() * (s - t)).sum()))
        return float(np.mean(out))

    before = reverse_kl()
    for i in range(1, 6):
        loop.iteration(i)
    after = reverse_kl()
    assert after < 0.85 * before, f"reverse KL to the teacher on held-out prompts: {before:.3f} -> {after:.3f}"


def test_distillation_batches_accumulate_into_one_update(tiny_weights):
    """Two iterations' distillation batches (each domain's rows, each with per-token advantages)
    make one optimizer step at the window's end (train.accumulate_rollouts: 2)."""
    from unirl.stages.run.loop import InProcessLoop

    student = str(tiny_weights("qwen3"))
    recipe = build_recipe(distilled(student, iterations=2, train={"accumulate_rollouts": 2}, distill={"mode": "additive"}))
    loop = InProcessLoop(recipe, student)
    first = loop.iteration(0)
    assert "train/loss" not in first and loop.worker.version == 0 and first["distill/taught_frac"] == 1.0
    second = loop.iteration(1)
    assert second["train/accumulated_batches"] == 2 and second["train/grad_norm"] > 0
    assert loop.worker.version == 1 and loop.worker.stack.opt_steps == 1
