import numpy as np
import pytest

from tests.tiny_reward_models import random_images
from unirl.stages.rewards import ScoreBatch, ScorerError, build_scorer, run_scorer
from unirl.stages.rewards.vlm_judge import parse_score


def test_parse_score_maps_to_unit_interval():
    assert parse_score("7", 0, 10) == 0.7
    assert parse_score("Score: 8.5/10", 0, 10) == 0.85
    assert parse_score("3", 1, 5) == 0.5
    assert parse_score("great", 0, 10) is None
    assert parse_score("11", 0, 10) is None
    assert parse_score("-1", 0, 10) is None


def batch(n: int, images: bool = True) -> ScoreBatch:
    return ScoreBatch([f"j/{i}" for i in range(n)], [f"prompt {i}" for i in range(n)],
                      texts=[f"answer {i}" for i in range(n)],
                      images=random_images(n, size=(56, 56)) if images else None)


def test_judge_score_is_parsed_and_normalized(judge_dir):
    judge = build_scorer("vlm_judge", model_path=str(judge_dir), device="cpu", batch_size=2)
    with_images = run_scorer(judge, batch(3))
    assert with_images.scores.shape == (3,)
    np.testing.assert_array_equal(with_images.scores, [0.7] * 3)  # answer "7 7 ...", range 0-10
    assert judge.answers(batch(1))[0].split()[0] == "7"
    text_only = run_scorer(judge, batch(2, images=False))
    np.testing.assert_array_equal(text_only.scores, [0.7, 0.7])
    ranged = build_scorer("vlm_judge", model_path=str(judge_dir), device="cpu", min_score=5, max_score=9)
    np.testing.assert_allclose(run_scorer(ranged, batch(2)).scores, [0.5, 0.5])


def test_unparseable_answer_is_an_error_naming_the_sample(mute_judge_dir):
    judge = build_scorer("vlm_judge", model_path=str(mute_judge_dir), device="cpu")
    with pytest.raises(ScorerError, match=r"no score in \[0, 10\] in the answer for sample 'j/0': 'great"):
        run_scorer(judge, batch(2))


def test_out_of_range_answer_is_an_error(judge_dir):
    judge = build_scorer("vlm_judge", model_path=str(judge_dir), device="cpu", max_score=5)
    with pytest.raises(ScorerError, match=r"no score in \[0, 5\]"):
        run_scorer(judge, batch(1))


def test_a_vision_language_policys_own_tiny_model_judges_its_answers(tiny_weights, tmp_path):
    """The qwen3_vl family's tiny model, taught by the family's own SFT to answer 7 to the judge's
    question, published as a plain folder, judges that family's rollouts: it is shown the image
    each rollout's prompt showed (with its M-RoPE positions: Qwen3-VL refuses an image without
    them), and every answer parses to 7 / 10."""
    import torch

    from tests.tiny import TINY, merged
    from unirl.stages.recipe import build_recipe
    from unirl.stages.rewards.vlm_judge import DEFAULT_QUESTION
    from unirl.stages.run import iteration as it
    from unirl.stages.runtime.sample import read_rollouts, read_shard, table_from_rows, write_shard
    from unirl.stages.runtime.storage import RunStorage
    from unirl.stages.toys.toy_vqa import ToyVQA
    from unirl.stages.workers.worker import Worker

    family = "qwen3_vl"
    base = merged(TINY[family], {"storage": {"root": str(tmp_path)}})
    teach = build_recipe(merged(base, {"sft": {"steps": 30, "batch_size": 8, "lr": 1e-2}}))
    storage = RunStorage(str(tmp_path), "judge")

    def worker(recipe, weights, mode):
        spec = {"recipe": recipe.model_dump(mode="json"), "root": str(tmp_path), "run": "judge", "mode": mode,
                "weights_dir": str(weights), "scratch": str(tmp_path / f"scratch-{mode}")}
        return Worker(spec, None, torch.device("cpu"))

    prompts = ToyVQA(seed=9, heldout_size=0).batch(0, 24)
    rows = [{"prompt": DEFAULT_QUESTION.format(prompt=p.text, text="", min_score=0, max_score=10), "response": "7"}
            for p in prompts]
    rows = it.with_image_grids(teach, rows, [p.images for p in prompts], [p.prompt_id for p in prompts])
    write_shard(storage, "sft/judge.arrow", table_from_rows(rows, "sft"))
    teacher = worker(teach, tiny_weights(family), "sft")
    teacher.sft(data="sft/judge.arrow", steps=30, batch_size=8, seed=0)
    teacher.publish()
    judge = storage.local_path(storage.weights_rel(0))

    recipe = build_recipe(merged(base, {"reward": {"scorers": [{"name": "vlm_judge", "params": {
        "model_path": str(judge), "device": "cpu", "max_new_tokens": 2}}]}}))
    policy = worker(recipe, tiny_weights(family), "rl")
    requests = it.write_requests(storage, recipe, 0)["files"][0]
    gen = policy.generate(iteration=0, requests=requests, out_dir="iter-000000/rollouts")
    table = read_rollouts(storage, gen["files"], columns=it.SCORED_COLUMNS)
    batch = it.score_batch(table)
    shown = [read_shard(storage, requests, "requests").column("images")[0].as_py()[0]]
    assert batch.images[0].tobytes() == it.decode_png(shown[0]).tobytes()  # the prompt's image
    it.score(storage, recipe, 0, gen["files"])
    rewards = read_shard(storage, "iter-000000/rewards.arrow", "rewards").column("reward").to_pylist()
    assert rewards == [0.7] * 12
