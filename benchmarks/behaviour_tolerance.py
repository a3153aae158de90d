"""How far the trainer's replay of a text response is from the log-probs the sampler recorded:
incremental KV-cache decoding over left-padded prompts against one full forward over right-padded
sequences. Trainside, the two see the same weights and tokens, so the difference is rounding; the
text policy's default `rollout.behaviour_tolerance` is set well above what this prints.

    python benchmarks/behaviour_tolerance.py [--responses 2048] [--max-new-tokens 16] [--dtype float32]

Samples `--responses` responses of the tiny Qwen3 (from its random init, one GRPO step between
batches of 512, at temperature 1, on prompts of varied length) through the worker in this process and prints the
largest and mean |replay - record| over every response token.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--responses", type=int, default=2048)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    import numpy as np
    import torch

    from unirl.stages.policies.text import TextPolicy
    from unirl.stages.recipe import load_recipe
    from unirl.stages.run import iteration as it
    from unirl.stages.runtime.sample import read_rollouts
    from unirl.stages.runtime.storage import RunStorage
    from unirl.stages.workers.worker import Worker

    work = Path(tempfile.mkdtemp(prefix="unirl-tolerance-"))
    prompts, group = 64, 8
    recipe = load_recipe(REPO / "recipes/ar/tiny.yaml", [
        f"storage.root={work}", f"model.dtype={args.dtype}", f"rollout.max_new_tokens={args.max_new_tokens}",
        f"rollout.prompts_per_iteration={prompts}", f"rollout.group_size={group}", "train.micro_batch_size=64",
        "data.digits=3", "data.operands=3", "data.operators=[+, -, '*']", "reward.scorers=[{name: integer_format}]",
        "rollout.behaviour_tolerance=1.0",  # measure, do not stop
    ])
    from unirl.stages.run.record import initial_weights

    storage = RunStorage(str(work), "run")
    spec = {"recipe": recipe.model_dump(mode="json"), "root": str(work), "run": "run",
            "init_weights": initial_weights(storage, recipe), "scratch": str(work / "scratch")}
    worker = Worker(spec, None, torch.device("cpu"))
    largest, total, tokens, responses = 0.0, 0.0, 0, 0
    i = 0
    while responses < args.responses:
        requests = it.write_requests(storage, recipe, i)["files"][0]
        gen = worker.generate(iteration=i, requests=requests, out_dir=f"iter-{i:06d}/rollouts")
        adv = it.advantages(storage, recipe, i, it.score(storage, recipe, i, gen["files"])["files"])
        table = read_rollouts(storage, gen["files"])
        batches = worker.policy.batches(table, [list(range(table.num_rows))], np.zeros(table.num_rows), "")
        with torch.no_grad():
            for b in batches:
                replay = worker.policy.replay(worker.stack.module, b)
                diff = ((replay - b.behaviour).abs() * b.mask)
                largest = max(largest, float(diff.max()))
                total += float(diff.sum())
                tokens += int(b.mask.sum())
        responses += table.num_rows
        worker.train(iteration=i, rollouts=gen["files"], advantages=adv["files"][0])
        i += 1
    print(f"{args.dtype}: {responses} responses, {tokens} tokens, {i} policies (GRPO steps between): "
          f"max |replay - record| {largest:.3g}, mean {total / max(tokens, 1):.3g}; "
          f"default tolerance {TextPolicy.default_tolerance(args.dtype):g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
