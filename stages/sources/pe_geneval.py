"""`data.name: pe_geneval`: toy-GenEval intents said in words the drawer never saw
(stages/toys/geneval/paraphrase.py), for prompt-enhancer pipelines (docs/pipelines.md). Each prompt's
metadata carries its intent (`geneval_prompt`, what the `geneval` scorer scores the image against)
and the canonical prompt as the rewriter's `answer`."""
from __future__ import annotations

import random
from typing import Any, Literal

from pydantic import Field, model_validator

from unirl.stages.runtime.config_base import Section
from unirl.stages.runtime.data import Prompt, check_split
from unirl.stages.runtime.registry import sources
from unirl.stages.runtime.seeds import derive_seed
from unirl.stages.sources import Source
from unirl.stages.toys.geneval.dataset import all_prompts
from unirl.stages.toys.geneval.paraphrase import PE_CHARSET, paraphrase_pool, wrong_colour


class PEGenEvalData(Section):
    """Paraphrased toy-GenEval prompts: the user's words for an intent the drawer knows."""

    name: Literal["pe_geneval"] = "pe_geneval"
    seed: int = Field(1234, ge=0, description="Seed of the prompt stream and of the dev and test draws.")
    heldout_size: int = Field(
        64, ge=0, description="Size of each of the dev and test splits (never trained on): distinct held-out phrasings "
        "of the same intents, drawn from a pool of 300 (single), 613 (count) or 913 (both).")
    kinds: list[Literal["single", "count"]] = Field(
        ["single"], min_length=1,
        description="Intent kinds: single (one object) or count (two or three of one object). The intents are the "
        "toy-GenEval train split's (those a drawer warm-started on `data.name: geneval` has seen).")

    @model_validator(mode="after")
    def _check_size(self) -> PEGenEvalData:
        held = len(heldout_pool(tuple(self.kinds)))
        if 2 * self.heldout_size > held:
            raise ValueError(f"data.heldout_size: kinds {', '.join(self.kinds)} have {held} held-out phrasings, too few for "
                             f"two disjoint splits (dev and test) of {self.heldout_size}; lower it to {held // 2} at most")
        return self


def heldout_pool(kinds: tuple[str, ...]) -> list[tuple[str, str]]:
    """(paraphrase, intent) pairs never trained on, of the train-split intents of `kinds`."""
    return paraphrase_pool(intents_of(kinds), "heldout")


def intents_of(kinds: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(t for kind in kinds for t in all_prompts(kind, "train"))


class PEPrompts:
    """Training prompts by (seed, iteration) from the train paraphrases; fixed dev and test sets of
    distinct held-out paraphrases: dev as the single held-out set was drawn, test among the rest."""

    def __init__(self, cfg: PEGenEvalData):
        self.seed = cfg.seed
        self.train = paraphrase_pool(intents_of(tuple(cfg.kinds)), "train")
        held = heldout_pool(tuple(cfg.kinds))
        dev = random.Random(f"pe-heldout-{cfg.seed}").sample(held, cfg.heldout_size)
        taken = {text for text, _ in dev}
        test = random.Random(f"pe-test-{cfg.seed}").sample([pair for pair in held if pair[0] not in taken], cfg.heldout_size)
        self._splits = {"dev": [self.prompt(f"heldout-{i:05d}", *pair) for i, pair in enumerate(dev)],
                        "test": [self.prompt(f"test-{i:05d}", *pair) for i, pair in enumerate(test)]}

    @staticmethod
    def prompt(prompt_id: str, text: str, intent: str) -> Prompt:
        return Prompt(prompt_id, text, {"geneval_prompt": intent, "answer": intent})

    def heldout(self, split: str = "dev") -> list[Prompt]:
        return list(self._splits[check_split(split)])

    def batch(self, iteration: int, n: int) -> list[Prompt]:
        rng = random.Random(derive_seed(self.seed, "train", iteration))
        return [self.prompt(f"it{iteration:06d}-{i:05d}", *self.train[rng.randrange(len(self.train))]) for i in range(n)]


@sources.register("pe_geneval")
class PEGenEvalSource(Source):
    name = "pe_geneval"
    config = PEGenEvalData

    @classmethod
    def build(cls, cfg: PEGenEvalData) -> PEPrompts:
        return PEPrompts(cfg)

    @classmethod
    def check(cls, recipe: Any) -> None:
        """A tiny character-level rewriter must have every character of the prompts and rewrites
        (others read as <unk>); a drawer's warm start cannot learn from text records."""
        if recipe.sft is not None and recipe.sft.source == "synthetic" and recipe.rollout.kind != "text":
            raise ValueError("data.name: pe_geneval's synthetic records are (paraphrase, canonical prompt) text; a "
                             f"{recipe.model.kind} warm start needs images: give it its own data (data.name: geneval)")
        charset = getattr(getattr(recipe.model, "tiny", None), "charset", None)
        missing = "".join(sorted(set(PE_CHARSET) - set(charset or PE_CHARSET)))
        if missing and not recipe.model.path:
            raise ValueError(f"model.tiny.charset: lacks {missing!r}, characters of data.name pe_geneval's prompts and "
                             f"rewrites; set it to {PE_CHARSET!r}")

    @classmethod
    def sft_records(cls, recipe: Any) -> list[dict[str, Any]]:
        """`sft.examples` (paraphrase, canonical prompt) records of the train paraphrases; `sft.noise`
        of them carry an imperfect teacher's slip that only the image reveals: the wrong colour."""
        prompts = cls.build(recipe.data).batch(0, recipe.sft.examples)
        rng = random.Random(f"sft-noise-{recipe.sft.seed}")
        return [{"prompt": p.text, "response": wrong_colour(p.metadata["answer"]) if rng.random() < recipe.sft.noise
                 else p.metadata["answer"]} for p in prompts]
