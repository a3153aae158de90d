"""The prompt-enhancer demo's data: paraphrases that keep the intent in words the drawer never saw,
a held-out split of phrasings, the imperfect rewriter teacher's colour slip, and the geneval
scorer reading the intent rather than the user's words."""
from __future__ import annotations

import numpy as np
import pytest

from unirl.stages.recipe import build_recipe
from unirl.stages.rewards.base import ScoreBatch
from unirl.stages.rewards.image import GenEvalScorer
from unirl.stages.sources.pe_geneval import PEGenEvalData, PEGenEvalSource, PEPrompts
from unirl.stages.toys.geneval.dataset import COLOURS, SHAPES, all_prompts, parse_prompt, render
from unirl.stages.toys.geneval.paraphrase import PE_CHARSET, paraphrases, split_of, wrong_colour


def test_paraphrases_keep_the_intent_in_other_words():
    said = paraphrases("a red circle")
    assert "paint one crimson disc" in said and "show me a single scarlet ring" in said and "a red circle" not in said
    twos = paraphrases("two blue squares")
    assert "a pair of navy boxes" in twos and "draw 2 azure tiles" in twos
    for intent in all_prompts("single") + all_prompts("count"):
        spec = parse_prompt(intent)
        for text in paraphrases(intent):
            assert set(text) <= set(PE_CHARSET) and len(text) <= 40
            words = text.split()
            assert not any(c in words for c in COLOURS if c != spec.objects[0].colour), text  # no other colour named
            assert not any(s in words for s in SHAPES if s != spec.objects[0].shape), text


def test_heldout_prompts_are_phrasings_never_trained_on_of_intents_the_drawer_knows():
    source = PEPrompts(PEGenEvalData(heldout_size=64))
    held = source.heldout()
    trained = {text for text, _ in source.train}
    assert len(held) == 64 and not {p.text for p in held} & trained
    assert all(split_of(p.text) == "heldout" for p in held)
    drawer_knows = set(all_prompts("single", "train"))
    assert {p.metadata["geneval_prompt"] for p in held} <= drawer_knows
    assert {p.metadata["geneval_prompt"] for p in source.batch(3, 200)} == drawer_knows  # every intent is asked for
    assert [p.text for p in PEPrompts(PEGenEvalData()).batch(3, 5)] == [  # recorded once: a resumed run draws them again
        "show me a single golden circle", "a picture of a single emerald square", "a navy ring", "a single azure wedge",
        "draw a yellow disc"]


def test_dev_and_test_are_disjoint_phrasings_never_trained_on_and_fixed_by_the_seed():
    a, b = PEPrompts(PEGenEvalData(seed=3, heldout_size=8)), PEPrompts(PEGenEvalData(seed=3, heldout_size=8))
    dev, test = a.heldout("dev"), a.heldout("test")
    # Recorded once: evaluations stored under one split stay comparable.
    assert [(p.prompt_id, p.text, p.metadata["answer"]) for p in dev[:4]] == [
        ("heldout-00000", "show me a red disc", "a red circle"), ("heldout-00001", "a picture of one crimson ring", "a red circle"),
        ("heldout-00002", "one scarlet ring", "a red circle"), ("heldout-00003", "paint one crimson ring", "a red circle")]
    assert len(dev) == len(test) == 8 and a.heldout() == dev and test[0].prompt_id == "test-00000"
    assert [p.text for p in test] == [p.text for p in b.heldout("test")]
    assert len({p.text for p in dev} | {p.text for p in test}) == 16  # distinct, and no test phrasing is a dev one
    assert all(split_of(p.text) == "heldout" for p in test)
    assert not {p.text for p in dev + test} & {p.text for it in range(20) for p in a.batch(it, 64)}
    with pytest.raises(ValueError, match="unknown held-out split 'train'"):
        a.heldout("train")


def test_a_heldout_size_the_phrasings_cannot_give_twice_is_named():
    assert PEGenEvalData(kinds=["single"], heldout_size=150).heldout_size == 150
    for kinds, pool in ((["single"], 300), (["count"], 613), (["single", "count"], 913)):
        with pytest.raises(ValueError, match=f"data.heldout_size: kinds {', '.join(kinds)} have {pool} held-out phrasings, "
                                             f"too few for two disjoint splits \\(dev and test\\) of {pool // 2 + 1}"):
            PEGenEvalData(kinds=kinds, heldout_size=pool // 2 + 1)


def test_the_imperfect_teacher_writes_the_wrong_colour_and_nothing_else():
    recipe = build_recipe({
        "name": "r", "data": {"name": "pe_geneval"}, "reward": {"scorers": [{"name": "geneval"}]},
        "compose": {"kind": "pipeline", "parts": [
            {"name": "rewriter", "model": {"kind": "qwen3", "tiny": {"charset": PE_CHARSET}}, "algorithm": {"name": "grpo"},
             "sft": {"examples": 2000, "noise": 0.3}},
            {"name": "drawer", "model": {"kind": "sd3"}, "algorithm": {"name": "flow_grpo"}}]}})
    from unirl.stages.compose.pipeline import part_recipe

    records = PEGenEvalSource.sft_records(part_recipe(recipe, "rewriter", "r"))
    prompts = {p.text: p.metadata["answer"] for p in PEPrompts(recipe.data).batch(0, 2000)}
    slipped = [r for r in records if r["response"] != prompts[r["prompt"]]]
    assert 0.25 < len(slipped) / len(records) < 0.35
    assert all(r["response"] == wrong_colour(prompts[r["prompt"]]) for r in slipped)
    assert wrong_colour("a yellow square") == "a red square"


def test_geneval_scores_the_image_against_the_intent_not_the_words():
    image = render("a blue square", size=32, seed=1)
    batch = ScoreBatch(sample_ids=["s"], prompts=["draw one navy box"], texts=None, images=[image], videos=None,
                       metadata=[{"geneval_prompt": "a blue square"}], finish_reasons=None)
    assert GenEvalScorer("strict")(batch).scores.tolist() == [1.0]
    wrong = ScoreBatch(sample_ids=["s"], prompts=["a blue square"], texts=None, images=[image], videos=None,
                       metadata=[{"geneval_prompt": "a red square"}], finish_reasons=None)
    assert np.array_equal(GenEvalScorer("strict")(wrong).scores, [0.0])


def test_a_rewriter_whose_characters_miss_the_prompts_is_refused_naming_the_field():
    from unirl.stages.recipe import RecipeError

    recipe = {"name": "r", "data": {"name": "pe_geneval"}, "reward": {"scorers": [{"name": "geneval"}]},
              "compose": {"kind": "pipeline", "parts": [
                  {"name": "rewriter", "model": {"kind": "qwen3"}, "algorithm": {"name": "grpo"}},
                  {"name": "drawer", "model": {"kind": "sd3"}, "algorithm": {"name": "flow_grpo"}}]}}
    try:
        build_recipe(recipe)
    except RecipeError as exc:
        assert any(e.startswith("compose.parts.0.model.tiny.charset: lacks 'abcdefghijklmnopqrstuvwxyz'") for e in exc.errors), exc.errors
    else:
        raise AssertionError("a rewriter without letters was accepted")


def test_a_drawer_warm_started_on_the_paraphrases_is_refused_naming_its_data():
    from unirl.stages.recipe import RecipeError

    recipe = {"name": "r", "data": {"name": "pe_geneval"}, "reward": {"scorers": [{"name": "geneval"}]},
              "compose": {"kind": "pipeline", "parts": [
                  {"name": "rewriter", "model": {"kind": "qwen3", "tiny": {"charset": PE_CHARSET}}, "algorithm": {"name": "grpo"}},
                  {"name": "drawer", "model": {"kind": "sd3"}, "algorithm": {"name": "flow_grpo"}, "sft": {"steps": 10}}]}}
    try:
        build_recipe(recipe)
    except RecipeError as exc:
        assert any(e.startswith("compose.parts.1.data.name: pe_geneval's synthetic records are") for e in exc.errors), exc.errors
    else:
        raise AssertionError("a drawer warm start on text records was accepted")
    recipe["compose"]["parts"][1]["data"] = {"name": "geneval", "kinds": ["single"]}
    build_recipe(recipe)
