"""On-policy distillation of a flow family (`flow_opd`, stages/algorithms/flow_opd.py): the kernel
against hand-computed values, the routing of rows to their domain's teacher, what validate and the
worker refuse, a teacher SFT-trained from the student's initial weights, and short real runs of a
tiny SD3 student against a teacher given as a local folder."""
from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import recipe_errors
from tests.tiny import TINY, merged
from unirl.stages.algorithms.flow_opd import FlowOPD
from unirl.stages.kernels.flow_losses import flow_opd_loss
from unirl.stages.recipe import build_recipe

# -- the kernel ----------------------------------------------------------------------------------


def test_the_kernel_against_hand_computed_values():
    # N = 2 (sample, step) rows of a 2-element latent; weights 1 and 0.5:
    #   mse_0 = ((1-0)^2 + (2-0)^2) / 2 = 2.5;  mse_1 = ((3-1)^2 + (4-1)^2) / 2 = 6.5
    #   loss = (1 * 2.5 + 0.5 * 6.5) / 2 = 2.875;  opd_mse = (2.5 + 6.5) / 2 = 4.5
    #   d loss / d v_s[n] = w_n * 2 * (v_s[n] - v_t[n]) / (2 elements * 2 rows) = w_n * (v_s[n] - v_t[n]) / 2
    #     -> row 0: [0.5, 1.0]; row 1: 0.5 * [2, 3] / 2 = [0.5, 0.75]
    v_s = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    v_t = torch.tensor([[0.0, 0.0], [1.0, 1.0]], requires_grad=True)
    out = flow_opd_loss(v_s, v_t, torch.tensor([1.0, 0.5]))
    assert out.loss.item() == pytest.approx(2.875)
    assert out.metrics == {"opd_mse": pytest.approx(4.5)}
    out.loss.backward()
    assert torch.allclose(v_s.grad, torch.tensor([[0.5, 1.0], [0.5, 0.75]]))
    assert v_t.grad is None  # the teacher is a target, never trained


def test_the_kernel_takes_latents_of_any_rank_and_a_scalar_weight():
    # (N, C, h, w) = (2, 1, 2, 2): row 0 differs by 1 everywhere (mse 1), row 1 by 2 in one of 4
    # elements (mse 4/4 = 1); weight 3: loss = 3 * (1 + 1) / 2 = 3, opd_mse = 1.
    v_t = torch.zeros(2, 1, 2, 2)
    v_s = v_t.clone()
    v_s[0] += 1
    v_s[1, 0, 1, 1] = 2
    out = flow_opd_loss(v_s, v_t, 3.0)
    assert out.loss.item() == pytest.approx(3.0) and out.metrics["opd_mse"] == pytest.approx(1.0)
    assert flow_opd_loss(v_t, v_t).loss.item() == 0.0
    with pytest.raises(ValueError, match="v_teacher has shape"):
        flow_opd_loss(v_s, v_t[:1])
    with pytest.raises(ValueError, match=r"weight must be a float or \(N,\)"):
        flow_opd_loss(v_s, v_t, torch.ones(3))


# -- routing -------------------------------------------------------------------------------------

MIXTURE = {"name": "mixture", "domains": [
    {"name": "single", "data": {"name": "geneval", "kinds": ["single"]}, "teacher": "one"},
    {"name": "pair", "data": {"name": "geneval", "kinds": ["pair"]}, "teacher": "two"}]}


def model_folder(tmp_path: Path) -> str:
    """A folder that passes validate's look at a teacher's `path` (the worker loads real ones)."""
    (tmp_path / "model_index.json").write_text("{}")
    return str(tmp_path)


def opd_recipe(tmp_path: Path, **over):
    return build_recipe(merged(TINY["sd3"], {"algorithm": {"name": "flow_opd"}, "storage": {"root": str(tmp_path / "runs")}}, over))


def test_each_row_is_taught_by_its_domains_teacher(tmp_path):
    folder = model_folder(tmp_path)
    recipe = opd_recipe(tmp_path, data=MIXTURE, distill={"teachers": [{"name": "one", "path": folder},
                                                                       {"name": "two", "path": folder}]})
    algo = FlowOPD(recipe.algorithm, recipe)

    class Policy:  # a teacher's velocity is its own constant, on the rows it is given
        def velocity(self, module, prompts):
            return lambda x, sigma: torch.full_like(x, module.value)

    teachers = {"one": SimpleNamespace(value=1.0), "two": SimpleNamespace(value=2.0)}
    ctx = SimpleNamespace(policy=Policy(), world=1, teacher=teachers.__getitem__)
    x = torch.zeros(3, 4, 2, 2)
    batch = SimpleNamespace(sample_ids=["a", "b", "c"], prompts=["p", "q", "r"], domains=["pair", "single", "pair"],
                            plan=SimpleNamespace(sigmas=torch.tensor([1.0, 0.5, 0.0])), at=lambda step: x)
    assert algo.routes(batch) == [("one", [1]), ("two", [0, 2])]
    v = algo.teacher_velocity(ctx, batch, 0, x)
    assert v[:, 0, 0, 0].tolist() == [2.0, 1.0, 2.0] and torch.equal(v, v[:, :1, :1, :1].expand_as(v))
    batch.domains = ["pair", "other", "pair"]
    with pytest.raises(ValueError, match="sample 'b': domain 'other' has no distillation teacher"):
        algo.routes(batch)


# -- what validate refuses -----------------------------------------------------------------------


def test_flow_opd_needs_a_distill_section_of_pure_distillation(tmp_path):
    assert recipe_errors(merged(TINY["sd3"], {"algorithm": {"name": "flow_opd"}})) == [
        "distill: algorithm 'flow_opd' regresses the student on teachers' velocities; add a `distill` section with its "
        "teachers (see recipes/distill/flow.yaml)"]
    folder = model_folder(tmp_path)
    errors = recipe_errors(merged(TINY["sd3"], {"algorithm": {"name": "flow_opd"},
                                                "distill": {"mode": "additive", "teachers": [{"name": "t", "path": folder}]}}))
    assert errors == ["distill.mode: flow_opd is pure distillation (the teacher's velocity is the whole target; no reward "
                      "enters the loss); set `mode: pure`"]
    # a likelihood algorithm cannot distill a flow model
    errors = recipe_errors(merged(TINY["sd3"], {"algorithm": {"name": "flow_grpo"},
                                                "distill": {"teachers": [{"name": "t", "path": folder}]}}))
    assert any("algorithm.name: 'flow_grpo' cannot train on-policy distillation of latent segments; use flow_opd" in e
               for e in errors)


def test_every_row_needs_a_teacher(tmp_path):
    folder = model_folder(tmp_path)
    data = copy.deepcopy(MIXTURE)
    data["domains"][1].pop("teacher")
    errors = recipe_errors(merged(TINY["sd3"], {"algorithm": {"name": "flow_opd"}, "data": data,
                                                "distill": {"teachers": [{"name": "one", "path": folder},
                                                                         {"name": "two", "path": folder}]}}))
    assert any("pair has none" in e for e in errors), errors
    # one teacher of several domains: distill.teacher, or the only teacher, teaches every row
    opd_recipe(tmp_path, data=data, distill={"teachers": [{"name": "one", "path": folder}]})


def test_a_teacher_trained_from_the_base_model_would_learn_another_latent_space(tmp_path):
    sft = {"examples": 8, "steps": 2, "noise": 0.0}
    errors = recipe_errors(merged(TINY["sd3"], {"algorithm": {"name": "flow_opd"}, "sft": sft,
                                                "distill": {"teachers": [{"name": "t", "sft": sft}]}}))
    assert errors == [
        "distill.teachers.0.init: teacher 't' would start its SFT from the base model and learn a VAE of its own "
        "(model.vae_warmup), so its velocities would be in another latent space than the student's; set `init: student` "
        "(its SFT starts from the student's initial weights and keeps their VAE)"]
    recipe = opd_recipe(tmp_path, sft=sft, distill={"teachers": [{"name": "t", "sft": sft, "init": "student"}]})
    from unirl.stages.distill import teacher_recipe

    own = teacher_recipe(recipe, recipe.distill.teachers[0])
    assert own.model.vae_warmup.steps == 0  # the student's VAE is kept
    # the teacher's own recipe (its SFT and evaluation, in a worker group of its own) has no teacher
    assert own.distill is None and type(own).model_validate(own.model_dump(mode="json")).algorithm.name != "flow_opd"
    assert recipe.model.vae_warmup.steps is None
    # a bigger teacher in the student's latent space: the student's VAE and text encoders, a transformer of its own
    opd_recipe(tmp_path, sft=sft, distill={"teachers": [{"name": "t", "sft": sft, "init": "student", "tiny": {"num_layers": 2}}]})
    errors = recipe_errors(merged(TINY["sd3"], {"algorithm": {"name": "flow_opd"}, "model": {"vae_warmup": {"steps": 0}},
                                                "distill": {"teachers": [{"name": "t", "sft": sft,
                                                                          "tiny": {"num_layers": 2, "text_hidden": 32}}]}}))
    assert errors == ["distill.teachers.0.tiny: text_hidden change the teacher's VAE or text encoders, but a flow teacher "
                      "runs on the student's latents and text conditioning; only num_layers, num_heads, head_dim, "
                      "patch_size may differ"]
    opd_recipe(tmp_path, model={"vae_warmup": {"steps": 0}}, distill={"teachers": [{"name": "t", "sft": sft,
                                                                                     "tiny": {"num_layers": 2}}]})
    assert any("`init` describe a teacher trained with `sft`" in e for e in recipe_errors(merged(TINY["sd3"], {
        "algorithm": {"name": "flow_opd"}, "distill": {"teachers": [{"name": "t", "path": model_folder(tmp_path),
                                                                     "init": "student"}]}})))


def test_the_shipped_flow_distillation_reads_the_weights_its_teacher_run_writes():
    # recipes/distill/flow.yaml distills recipes/distill/flow_teacher.yaml's warm start from its last
    # weights: changing the teacher run's name, root or length must move the paths with it
    from unirl.stages.recipe import load_recipe

    repo = Path(__file__).resolve().parents[2]
    teacher_run = load_recipe(repo / "recipes" / "distill" / "flow_teacher.yaml")
    student = load_recipe(repo / "recipes" / "distill" / "flow.yaml", local_files=False)  # made by the teacher run
    weights = Path(teacher_run.storage.root) / teacher_run.name / "weights"
    assert Path(student.model.path) == weights / "v000000"
    assert [Path(t.path) for t in student.distill.teachers] == [weights / f"v{teacher_run.iterations:06d}"]
    assert student.model.kind == teacher_run.model.kind and student.data == teacher_run.data
    assert student.rollout.sampler.num_steps == teacher_run.rollout.sampler.num_steps


def test_a_teacher_with_init_student_starts_from_the_students_initial_weights(tiny_weights, tmp_path, monkeypatch):
    import json

    from unirl.flows import sft as S
    from unirl.flows.shapes import warm_start_one
    from unirl.stages.distill import teacher_recipe
    from unirl.stages.models.flow_folder import latent_space_differences
    from unirl.stages.runtime.storage import RunStorage
    from unirl.stages.train.manifests import MANIFEST, verify_weights_dir, write_weights_dir

    student, teacher = RunStorage(str(tmp_path), "run"), RunStorage(str(tmp_path), "run.teacher-t")
    with pytest.raises(ValueError, match="the student's initial weights are missing"):
        S.student_base(student, teacher)
    write_weights_dir(student, tiny_weights("sd3"), student.weights_rel(0), {"version": 0})
    S.student_base(student, teacher)  # the student's initial weights, whole
    copy = teacher.local_path(S.BASE)
    verify_weights_dir(copy)
    assert teacher.read_json(f"{S.BASE}/{MANIFEST}")["source"] == student.url(student.weights_rel(0))
    assert latent_space_differences(tiny_weights("sd3"), copy) == []
    assert (copy / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes() == (
        tiny_weights("sd3") / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes()
    # a bigger teacher: its own fresh transformer beside the student's VAE and text encoders
    sft = {"examples": 8, "steps": 2}
    recipe = opd_recipe(tmp_path, sft=sft, distill={"teachers": [{"name": "t", "sft": sft, "init": "student",
                                                                   "tiny": {"num_layers": 2}}]})
    bigger = RunStorage(str(tmp_path), "run.teacher-big")
    S.student_base(student, bigger, teacher_recipe(recipe, recipe.distill.teachers[0]))
    base = bigger.local_path(S.BASE)
    verify_weights_dir(base)
    assert json.loads((base / "transformer" / "config.json").read_text())["num_layers"] == 2
    assert latent_space_differences(tiny_weights("sd3"), base) == []
    # the run's warm start: base-initialised teachers, the student's SFT, then student-initialised teachers
    calls = []
    monkeypatch.setattr("unirl.flows.shapes.train_teachers", lambda r, n, t, init="base": calls.append(f"teachers-{init}"))
    monkeypatch.setattr("unirl.flows.shapes.run_sft", lambda r, s, t: calls.append("student-sft"))
    warm_start_one(recipe, "run", student, None)
    assert calls == ["teachers-base", "student-sft", "teachers-student"]


# -- real runs -------------------------------------------------------------------------------------


def loop_of(tmp_path: Path, student: Path, teacher: Path, **over):
    from unirl.stages.run.loop import InProcessLoop

    recipe = opd_recipe(tmp_path, **merged({"iterations": 3, "distill": {"teachers": [{"name": "t", "path": str(teacher)}]}}, over))
    return InProcessLoop(recipe, str(student))


def test_a_teacher_in_another_latent_space_is_refused(tiny_weights, tmp_path):
    from tests.tiny import CASES
    from unirl.stages.runtime.registry import families

    student = tiny_weights("sd3")
    fam = families.get("sd3")
    bundle = fam.load(student, fam.config.model_validate(CASES["sd3"]["model"]), "cpu")
    with torch.no_grad():
        next(bundle.vae.parameters()).add_(0.1)  # e.g. a VAE warmed up on other images
    fam.export(bundle, tmp_path / "teacher", bundle.module.state_dict(), lora=None)
    with pytest.raises(ValueError, match=r"distillation teacher 't' .*: its vae/diffusion_pytorch_model.safetensors "
                                         r"differ from the student's .*the student's latent space"):
        loop_of(tmp_path, student, tmp_path / "teacher")


def test_a_teacher_equal_to_the_student_teaches_nothing(tiny_weights, tmp_path):
    """The teacher's velocity takes the same conditioning and states as the student's: with the
    student's own weights it is the student's, bit for bit, so the loss and its gradient are 0."""
    student = tiny_weights("sd3")
    loop = loop_of(tmp_path, student, student)
    grads: list[torch.Tensor] = []
    step = loop.worker.stack.step
    loop.worker.stack.step = lambda: grads.extend(p.grad.clone() for p in loop.worker.stack.trainable) or step()
    m = loop.iteration(0)
    assert m["train/opd_mse"] == 0.0 and m["train/behaviour_logp_max_abs_diff"] == 0.0
    assert grads and all(not g.any() for g in grads)


def test_distillation_pulls_the_student_to_its_teacher(tiny_weights, teacher_weights, tmp_path):
    """A teacher that is the student perturbed: the first gradient points from the student towards
    the teacher's weights, and the velocity MSE on the student's own states falls over iterations."""
    student, teacher = tiny_weights("sd3"), teacher_weights("sd3")
    loop = loop_of(tmp_path, student, teacher)
    towards = [t.detach() - s.detach() for s, t in zip(loop.worker.stack.trainable, loop.worker.teachers["t"].parameters())]
    grads: list[torch.Tensor] = []
    step = loop.worker.stack.step
    loop.worker.stack.step = lambda: grads.extend(p.grad.clone() for p in loop.worker.stack.trainable) or step()
    mse = [loop.iteration(i)["train/opd_mse"] for i in range(3)]
    g = torch.cat([x.reshape(-1) for x in grads[:len(towards)]])
    d = torch.cat([x.reshape(-1) for x in towards])
    # -g . d = |J d|^2 > 0 to first order; a direction unrelated to d has a cosine of about 1/sqrt(D)
    # with it (D = 3e5 weights: 0.002)
    cos = float(torch.nn.functional.cosine_similarity(-g, d, dim=0))
    assert cos > 10 / d.numel() ** 0.5, f"descent does not lead to the teacher (cosine {cos:.4f})"
    assert mse[-1] < 0.85 * mse[0], mse
    assert 0.0 < mse[0]


def test_two_domains_are_taught_by_their_own_teachers(tiny_weights, teacher_weights, tmp_path):
    """A mixture of two domains: `single` rows regress on a perturbed teacher, `pair` rows on a
    teacher that is the student itself, so at every stored state the target of a `pair` row is
    the student's own velocity and that of a `single` row is not."""
    student = tiny_weights("sd3")
    teachers = {"teachers": [{"name": "one", "path": str(teacher_weights("sd3"))}, {"name": "two", "path": str(student)}]}
    loop = loop_of(tmp_path, student, student, data=MIXTURE, distill=teachers, rollout={"prompts_per_iteration": 4})
    algo, policy, module = loop.worker.algorithm, loop.worker.policy, loop.worker.stack.module
    seen: dict[str, list[float]] = {}
    targets = algo.teacher_velocity

    def checked(ctx, batch, step, like):
        out = targets(ctx, batch, step, like)
        with torch.no_grad():
            own = policy.state_velocity(module, batch, step)
        for i, domain in enumerate(batch.domains):
            seen.setdefault(domain, []).append(float((out[i] - own[i].float()).abs().max()))
        return out

    algo.teacher_velocity = checked
    m = loop.iteration(0)
    assert m["train/opd_mse"] > 0 and m["train/behaviour_logp_max_abs_diff"] == 0.0
    assert set(seen) == {"single", "pair"}
    # equal but for rounding: a teacher's forward takes only its own rows, in a smaller batch
    assert max(seen["pair"]) < 1e-5 and min(seen["single"]) > 1e-2, seen
