"""`data.name: pe_geneval`: toy-GenEval intents said in words the drawer never saw
(stages/geneval/paraphrase.py), for prompt-enhancer pipelines (docs/pipelines.md). Each prompt's
metadata carries its intent (`geneval_prompt`, what the `geneval` scorer scores the image against)
and the canonical prompt as the rewriter's `answer`."""
from __future__ import annotations

import random
from typing import Any, Literal

from pydantic import Field

from stages.config_base import Section
from stages.data import Prompt
from stages.seeds import derive_seed
from stages.sources import Source, sources


class PEGenEvalData(Section):
    """Paraphrased toy-GenEval prompts: the user's words for an intent the drawer knows."""

    name: Literal["pe_geneval"] = "pe_geneval"
    seed: int = Field(1234, description="Seed of the prompt stream and of the held-out draw.")
    heldout_size: int = Field(64, ge=0, description="Held-out prompts: phrasings never trained on, of the same intents.")
    kinds: list[Literal["single", "count"]] = Field(
        ["single"], min_length=1,
        description="Intent kinds: single (one object) or count (two or three of one object). The intents are the "
        "toy-GenEval train split's (those a drawer warm-started on `data.name: geneval` has seen).")


class PEPrompts:
    """Training prompts by (seed, iteration) from the train paraphrases; a fixed held-out set."""

    def __init__(self, cfg: PEGenEvalData):
        from stages.geneval.dataset import all_prompts
        from stages.geneval.paraphrase import paraphrase_pool

        intents = tuple(t for kind in cfg.kinds for t in all_prompts(kind, "train"))
        self.seed = cfg.seed
        self.train = paraphrase_pool(intents, "train")
        held = paraphrase_pool(intents, "heldout")
        rng = random.Random(f"pe-heldout-{cfg.seed}")
        picked = rng.sample(held, min(cfg.heldout_size, len(held)))
        self._heldout = [self.prompt(f"heldout-{i:05d}", *pair) for i, pair in enumerate(picked)]

    @staticmethod
    def prompt(prompt_id: str, text: str, intent: str) -> Prompt:
        return Prompt(prompt_id, text, {"geneval_prompt": intent, "answer": intent})

    def heldout(self) -> list[Prompt]:
        return list(self._heldout)

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
        from stages.geneval.paraphrase import PE_CHARSET

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
        from stages.geneval.paraphrase import wrong_colour

        prompts = cls.build(recipe.data).batch(0, recipe.sft.examples)
        rng = random.Random(f"sft-noise-{recipe.sft.seed}")
        return [{"prompt": p.text, "response": wrong_colour(p.metadata["answer"]) if rng.random() < recipe.sft.noise
                 else p.metadata["answer"]} for p in prompts]
