"""Held-out toy-GenEval evaluation of a flow model's weights folder: sample every held-out prompt
with the deterministic ODE sampler from fixed noise, decode, and score with the toy detector.

    python -m unirl.stages.diffusion.evaluate WEIGHTS_DIR [--family sd3] [--prompts 64] [--samples 2] [--seed 0] [--steps 10]

prints one JSON line: strict (the GenEval score, in [0, 1]) and its components, overall and per
prompt kind. The held-out prompts are `unirl.stages.toys.geneval.sample_prompts(n, seed, "heldout")`, which
no training stream ever yields.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from unirl.stages.diffusion.model import PromptCache, bind
from unirl.stages.diffusion.sampling import make_plan, sample
from unirl.stages.diffusion.sde import initial_noise

EVAL_SEED = 20250


def heldout_prompts(n: int, seed: int = EVAL_SEED) -> list[str]:
    from unirl.stages.toys.geneval import sample_prompts

    return sample_prompts(n, seed, split="heldout")


@torch.no_grad()
def generate_images(family: Any, bundle: Any, prompts: list[str], sampler: Any, *, seed: int, image_size: int | None = None,
                    batch: int = 64, module: Any = None) -> np.ndarray:
    """uint8 (len(prompts), H, W, 3): the ODE sample of each prompt from noise seeded by (seed, index)."""
    size = image_size or sampler.image_size or family.default_image_size(bundle)
    shape = family.latent_shape(bundle, size)
    plan = make_plan(sampler, seed=seed, iteration=0, latent_tokens=family.latent_tokens(bundle, shape), deterministic=True)
    cache = PromptCache(family, bundle)
    out = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        noise = torch.stack([initial_noise(shape, base_seed=seed, sample_id=f"eval/{i + k}", init_same_noise=False)[0]
                             for k in range(len(chunk))])
        velocity = bind(family, bundle, cache(chunk, sampler), sampler.guidance_scale, module)
        traj = sample(velocity, noise.to(bundle.device), plan, [0] * len(chunk), store=[plan.num_steps])
        out.append(family.decode(bundle, traj.final).numpy())
    return np.concatenate(out)


def geneval_report(images: np.ndarray, prompts: list[str]) -> dict[str, float]:
    """Mean strict score and components, overall and per prompt kind (`strict/<kind>`)."""
    from unirl.stages.toys.geneval import parse_prompt, score

    scores = [score(im, p) for im, p in zip(images, prompts)]
    report = {k: float(np.mean([getattr(s, k) for s in scores])) for k in ("strict", "object", "colour", "count", "position")}
    kinds: dict[str, list[float]] = {}
    for s, p in zip(scores, prompts):
        kinds.setdefault(parse_prompt(p).kind, []).append(s.strict)
    report.update({f"strict/{k}": float(np.mean(v)) for k, v in sorted(kinds.items())})
    report["images"] = float(len(prompts))
    return report


def evaluate(family: Any, bundle: Any, sampler: Any, *, prompts: int = 64, samples: int = 2, seed: int = 0,
             module: Any = None) -> dict[str, float]:
    """Held-out strict score of `bundle` (or of `module` with the bundle's VAE and encoders)."""
    texts = heldout_prompts(prompts)
    texts = [t for t in texts for _ in range(samples)]
    return geneval_report(generate_images(family, bundle, texts, sampler, seed=seed, module=module), texts)


def main(argv: list[str] | None = None) -> int:
    from unirl.stages.models.family import families
    from unirl.stages.policies.flow import FlowSampler

    parser = argparse.ArgumentParser(prog="python -m unirl.stages.diffusion.evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument("weights", help="diffusers folder of a flow model (e.g. RUN/weights/v000040)")
    parser.add_argument("--family", default="sd3", help="model family of the folder (model.kind)")
    parser.add_argument("--prompts", type=int, default=64, help="held-out prompts")
    parser.add_argument("--samples", type=int, default=2, help="images per prompt")
    parser.add_argument("--seed", type=int, default=0, help="noise seed")
    parser.add_argument("--steps", type=int, default=10, help="ODE steps")
    parser.add_argument("--shift", type=float, default=3.0, help="sigma shift")
    args = parser.parse_args(argv)
    if not (Path(args.weights) / "model_index.json").is_file():
        print(f"error: {args.weights} is not a diffusers weights folder (no model_index.json)", file=sys.stderr)
        return 2
    family = families.get(args.family)
    bundle = family.load(Path(args.weights), family.config(path=args.weights), "cpu")
    sampler = FlowSampler(num_steps=args.steps, shift=args.shift)
    print(json.dumps(evaluate(family, bundle, sampler, prompts=args.prompts, samples=args.samples, seed=args.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
