"""unirl vs TRL's GRPOTrainer, side by side in one run, at the quickstart geometry.

Both start from the same SFT weights (made once by `unirl sft`), train on the same prompts in the
same order (prompts per step x group size completions, same max new tokens, lr, clip range, loss
aggregation, one update per batch, no KL), and are scored by the same greedy held-out evaluation. Prints steady-state
seconds per iteration (median after the warm-up iterations) for both with the ratio, and held-out
accuracy before and after the same number of iterations.

    pip install -e ".[bench]"
    python benchmarks/vs_trl.py --iterations 20

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
    proc = subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"unirl {' '.join(args)} failed:\n{proc.stderr[-4000:]}")


def greedy_accuracy(model, tokenizer, prompts) -> float:
    """Greedy exact match on held-out prompts, the same code for both trainers' models."""
    import torch

    from stages.rewards.rules import extract_answer

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
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from stages.data import build_prompt_source
    from stages.models import load_tokenizer

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
    config = GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=r.prompts_per_iteration * r.group_size,
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
    parser.add_argument("--workdir", default=None)
    parser.add_argument("overrides", nargs="*", help="recipe overrides for both, e.g. rollout.group_size=8")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from stages.data import build_prompt_source
    from stages.models import load_qwen3
    from stages.recipe import load_recipe

    work = Path(args.workdir or tempfile.mkdtemp(prefix="unirl-vs-trl-"))
    env = {**os.environ, "PREFECT_HOME": str(work / "prefect"), "PREFECT_LOGGING_LEVEL": "WARNING"}
    root = work / "runs"
    recipe = load_recipe(QUICKSTART, args.overrides)
    unirl(["sft", str(QUICKSTART), f"storage.root={root}", "--run-name", "sft", *args.overrides], env)
    sft_dir = root / "sft" / "weights" / "v000000"
    heldout = build_prompt_source(recipe.data).heldout()

    ours_args = ["run", str(QUICKSTART), f"storage.root={root}", "--run-name", "ours", f"model.path={sft_dir}",
                 "sft=null", "eval.enabled=false", f"iterations={args.iterations}", f"checkpoint_every={args.iterations}", *args.overrides]
    unirl(ours_args, env)
    ours = iteration_metrics(root / "ours", args.iterations)
    trl_times, trl_model, tokenizer = run_trl(sft_dir, recipe, args.iterations, work / "trl")

    sft_model, _ = load_qwen3(sft_dir)
    ours_model, _ = load_qwen3(root / "ours" / "weights" / f"v{args.iterations:06d}")
    acc = {name: greedy_accuracy(m, tokenizer, heldout) for name, m in (("sft", sft_model), ("unirl", ours_model), ("trl", trl_model))}
    steady = steady_state(ours, args.warmup)  # wall time between commits: the whole flow run
    ours_s = statistics.median(m["time/wall_s"] for m in steady)
    inside = statistics.median(m["time/iteration_s"] for m in steady)
    trl_s = statistics.median(trl_times[args.warmup:])
    r = recipe.rollout
    print(f"geometry: {r.prompts_per_iteration} prompts x {r.group_size} samples, max_new_tokens {r.max_new_tokens}, "
          f"lr {recipe.train.lr}, {args.iterations} iterations, 1 update per batch, {os.cpu_count()} cores")
    print(f"{'':8s} {'s/iter (steady)':>16s} {'held-out acc':>13s} {'gain vs SFT':>12s}")
    print(f"{'SFT':8s} {'':>16s} {acc['sft']:13.3f}")
    for name, secs in (("unirl", ours_s), ("TRL", trl_s)):
        a = acc[name.lower()]
        print(f"{name:8s} {secs:16.3f} {a:13.3f} {a - acc['sft']:+12.3f}")
    print(f"ratio unirl/TRL seconds per iteration: {ours_s / trl_s:.2f}")
    print(f"(unirl inside its iteration flow runs, without their creation and the run loop: {inside:.3f} s/iter)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
