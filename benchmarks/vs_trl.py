"""unirl vs TRL's GRPOTrainer, side by side in one run, at the quickstart geometry and at multiples
of its batch.

Both start from the same SFT weights (made once by `unirl sft`), train on the same prompts in the
same order (prompts per step x group size completions, same max new tokens, lr, clip range, loss
aggregation, the same micro-batch size with gradient accumulation to one optimizer step per
batch, no KL), and are scored by the same greedy held-out evaluation. Prints steady-state seconds
per iteration (median after the warm-up iterations) for both with the ratio, and held-out accuracy
before and after the same number of iterations, for each `--scale` (prompts per iteration times
the scale).

    pip install -e ".[bench]"
    python benchmarks/vs_trl.py --iterations 20 --scale 1 4 16

unirl's time is the whole product path: the Prefect flow run per iteration, Arrow shards through
storage, the torchrun worker group. TRL's is its in-process trainer step (generation included).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _runs import iteration_metrics, steady_state

REPO = Path(__file__).resolve().parents[1]
# our `algorithm.agg` -> TRL's `loss_type` with the same normalization
TRL_LOSS = {"token_mean": "dapo", "seq_mean_token_mean": "grpo", "seq_mean_token_sum_norm": "dr_grpo"}
QUICKSTART = REPO / "recipes" / "ar" / "quickstart.yaml"


def unirl(args: list[str], env: dict[str, str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "unirl.flows.cli", *args], cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"unirl {' '.join(args)} failed:\n{proc.stderr[-4000:]}")


def greedy_accuracy(model, tokenizer, prompts) -> float:
    """Greedy exact match on held-out prompts, the same code for both trainers' models."""
    import torch

    from unirl.stages.rewards.rules import extract_answer

    model.eval()
    correct = 0
    with torch.no_grad():
        for p in prompts:
            ids = tokenizer(p.text, add_special_tokens=False, return_tensors="pt").input_ids
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
            text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            correct += extract_answer(text) == p.metadata["answer"]
    return correct / len(prompts)


def run_trl(sft_dir: Path, recipe, iterations: int, out: Path) -> tuple[list[float], object, object]:
    """TRL's trainer on `recipe`'s geometry: one optimizer step per batch of prompts x group size
    completions, generated at once, in micro-batches of `train.micro_batch_size` (as unirl's)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from unirl.stages.models import load_tokenizer
    from unirl.stages.runtime.data import build_prompt_source

    r, a, t = recipe.rollout, recipe.algorithm, recipe.train
    source = build_prompt_source(recipe.data)
    rows = [{"prompt": p.text, "answer": p.metadata["answer"]} for i in range(iterations) for p in source.batch(i, r.prompts_per_iteration)]
    tokenizer = load_tokenizer(sft_dir)
    model = AutoModelForCausalLM.from_pretrained(str(sft_dir), dtype=torch.float32)

    def exact_match(completions, answer, **_):
        return [float(c.strip() == x) for c, x in zip(completions, answer)]

    class Timer(TrainerCallback):
        def __init__(self):
            self.times, self._t = [], 0.0

        def on_step_begin(self, *args, **kwargs):
            self._t = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            self.times.append(time.perf_counter() - self._t)

    timer = Timer()
    batch = r.prompts_per_iteration * r.group_size
    micro = min(t.micro_batch_size, batch)
    while batch % micro or micro % r.group_size:  # TRL needs whole groups per micro-batch
        micro -= 1
    config = GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro,
        num_generations=r.group_size, max_completion_length=r.max_new_tokens, temperature=r.temperature,
        learning_rate=t.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm, num_iterations=1, beta=0.0, loss_type=TRL_LOSS[a.agg],
        epsilon=a.clip_low, epsilon_high=a.clip_high, max_steps=iterations, shuffle_dataset=False,
        logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=recipe.seed, disable_tqdm=True,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=[exact_match], args=config, train_dataset=Dataset.from_list(rows),
                          processing_class=tokenizer, callbacks=[timer])
    trainer.train()
    return timer.times, trainer.model, tokenizer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3, help="iterations left out of the steady state")
    parser.add_argument("--scale", type=int, nargs="+", default=[1], help="multiples of the quickstart's prompts per iteration")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("overrides", nargs="*", help="recipe overrides for both, e.g. rollout.group_size=8")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from unirl.stages.models import load_qwen3
    from unirl.stages.recipe import load_recipe
    from unirl.stages.runtime.data import build_prompt_source

    work = Path(args.workdir or tempfile.mkdtemp(prefix="unirl-vs-trl-"))
    env = {**os.environ, "PREFECT_HOME": str(work / "prefect"), "PREFECT_LOGGING_LEVEL": "WARNING"}
    root = work / "runs"
    base = load_recipe(QUICKSTART, args.overrides)
    unirl(["sft", str(QUICKSTART), f"storage.root={root}", "--run-name", "sft", *args.overrides], env)
    sft_dir = root / "sft" / "weights" / "v000000"
    heldout = build_prompt_source(base.data).heldout()
    sft_model, tokenizer = load_qwen3(sft_dir)
    sft_acc = greedy_accuracy(sft_model, tokenizer, heldout)

    rows = []
    for scale in args.scale:
        overrides = [*args.overrides, f"rollout.prompts_per_iteration={base.rollout.prompts_per_iteration * scale}"]
        recipe = load_recipe(QUICKSTART, overrides)
        name = f"ours-x{scale}"
        unirl(["run", str(QUICKSTART), f"storage.root={root}", "--run-name", name, f"model.path={sft_dir}", "sft=null",
               "eval.enabled=false", f"iterations={args.iterations}", f"checkpoint_every={args.iterations}", *overrides], env)
        steady = steady_state(iteration_metrics(root / name, args.iterations), args.warmup)  # wall time between commits
        ours_s = statistics.median(m["time/wall_s"] for m in steady)
        inside = statistics.median(m["time/iteration_s"] for m in steady)
        trl_times, trl_model, _ = run_trl(sft_dir, recipe, args.iterations, work / f"trl-x{scale}")
        ours_model, _ = load_qwen3(root / name / "weights" / f"v{args.iterations:06d}")
        rows.append((scale, recipe.rollout, ours_s, inside, statistics.median(trl_times[args.warmup:]),
                     greedy_accuracy(ours_model, tokenizer, heldout), greedy_accuracy(trl_model, tokenizer, heldout)))

    r = base.rollout
    print(f"geometry 1x: {r.prompts_per_iteration} prompts x {r.group_size} samples, max_new_tokens {r.max_new_tokens}, "
          f"micro-batch {base.train.micro_batch_size}, lr {base.train.lr}, {args.iterations} iterations, "
          f"1 update per batch, {os.cpu_count()} cores; held-out accuracy after SFT {sft_acc:.3f}")
    print(f"{'scale':>5s} {'samples':>8s} {'unirl s/it':>11s} {'TRL s/it':>9s} {'ratio':>6s} {'unirl acc':>10s} "
          f"{'TRL acc':>8s} {'unirl inside':>13s}")
    for scale, rollout, ours_s, inside, trl_s, ours_acc, trl_acc in rows:
        print(f"{scale:>4d}x {rollout.prompts_per_iteration * rollout.group_size:8d} {ours_s:11.3f} {trl_s:9.3f} "
              f"{ours_s / trl_s:6.2f} {ours_acc:10.3f} {trl_acc:8.3f} {inside:13.3f}")
    print("(ratio: unirl / TRL seconds per iteration; unirl inside: its iteration flow runs' own clock, without their "
          "creation and the run loop)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
