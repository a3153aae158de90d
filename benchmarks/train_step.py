"""One train step of a language model at Qwen3-0.6B's geometry, with each memory knob of
docs/scaling.md, side by side: tokens per second and peak memory, and `unirl validate --memory`'s
estimate beside each measured peak.

The model: Qwen3-0.6B's published geometry (vocabulary 151,936, hidden 1,024, 16 query and 8
key/value heads of 128, MLP 3,072, tied embeddings), random init, `--layers` decoder layers (28 is
the real model; a CPU takes minutes a step there, so the default is fewer: the layers, the head and
the log-probs scale as stated in docs/scaling.md). The batch: `--rows` rows whose lengths follow a
long tail (log-normal, clipped to [--min-len, --max-len]; a quarter prompt, the rest response),
the same for every configuration (`--seed`). One step: the rows cut into micro-batches as the knob
says (`micro_batch_size` rows, or a token budget), each micro-batch's token log-probs
(stages/policies/text.py `token_logp`, as training computes them) into a policy-gradient loss
with unit advantages at its share of the batch's tokens, backward, one AdamW step.

Each configuration runs in a fresh process; its peak is that process's peak RSS (VmHWM) less its
RSS before the model was built (the interpreter and libraries), so it compares with the estimate's
terms. tokens/s = the batch's tokens / the step's wall seconds (forward, backward, optimizer).

    python benchmarks/train_step.py                       # every configuration, 2 layers, 16 rows of 64-1024 tokens
    python benchmarks/train_step.py --layers 28 --rows 64 --max-len 2048   # the issue's size (long on a CPU)
    python benchmarks/train_step.py --flow                # SD3.5-medium's blocks, with and without checkpointing

`--flow`: the SD3 transformer at Stable Diffusion 3.5 Medium's published widths (benchmarks/released.py:
24 heads of 64, joint attention over 4,096-wide text features, dual attention; random init) with
`--blocks` of its 24 blocks, `--flow-rows` rows of one `--image-size` latent each (and 333 text
tokens, SD3's two CLIPs and T5), `--flow-micro` rows a micro-batch: per micro-batch one transformer
forward at a random noise level (stages/models/sd3.py `forward`, as the flow losses call it), a
squared-error loss at its share of the rows, backward; one AdamW step. tokens/s counts image and
text tokens. The estimate beside it is the transformer's terms of `unirl validate --memory` for the
same recipe (the frozen text encoders and VAE are not loaded here, so not counted).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GEOMETRY = {"vocab_size": 151936, "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
            "intermediate_size": 3072, "tie_word_embeddings": True, "max_position_embeddings": 40960}
# name -> train knobs (micro_batch_size rows, or a token budget)
CONFIGS = {
    "padded": {"micro_batch_size": 4},
    "padded+ckpt+chunk": {"micro_batch_size": 4, "activation_checkpointing": True, "logprob_chunk_tokens": 1024},
    "budget": {"max_tokens_per_micro_batch": 4096},
    "budget+packing": {"max_tokens_per_micro_batch": 4096, "packing": True},
    "budget+packing+ckpt+chunk": {"max_tokens_per_micro_batch": 4096, "packing": True, "activation_checkpointing": True,
                                  "logprob_chunk_tokens": 1024},
}


FLOW_CONFIGS = {"flow": {}, "flow+ckpt": {"activation_checkpointing": True}}
TEXT_TOKENS = 77 + 256  # SD3's two CLIPs' tokens, then T5's


def lengths(rows: int, low: int, high: int, seed: int) -> list[tuple[int, int]]:
    """(prompt, response) tokens of each row: log-normal total lengths clipped to [low, high]."""
    import numpy as np

    rng = np.random.default_rng(seed)
    total = np.clip(rng.lognormal(mean=np.log(low * 3), sigma=0.9, size=rows), low, high).astype(int)
    return [(max(1, int(t) // 4), int(t) - max(1, int(t) // 4)) for t in total]


def vm_hwm() -> int:
    """This process's peak resident bytes (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_hwm() -> None:
    """Start VmHWM over from the current resident size (Linux: writing 5 to clear_refs)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def one(config: str, layers: int, rows: list[tuple[int, int]], seed: int) -> dict:
    """One configuration, in this process: the step's seconds and peak bytes above the baseline."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from unirl.stages.policies.text import token_batch, token_logp
    from unirl.stages.train.stack import checkpoint_blocks, micro_batches, token_micro_batches

    knobs = CONFIGS[config]
    reset_hwm()
    base = vm_hwm()
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**GEOMETRY, num_hidden_layers=layers)).train()
    if knobs.get("activation_checkpointing"):
        checkpoint_blocks([m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, GEOMETRY["vocab_size"], (p,), generator=g).tolist() for p, _ in rows]
    responses = [torch.randint(0, GEOMETRY["vocab_size"], (r,), generator=g).tolist() for _, r in rows]
    index = list(range(len(rows)))
    if "max_tokens_per_micro_batch" in knobs:
        (groups,) = token_micro_batches(index, [p + r for p, r in rows], knobs["max_tokens_per_micro_batch"],
                                        packed=bool(knobs.get("packing")))
    else:
        (groups,) = micro_batches(index, knobs["micro_batch_size"])
    total = sum(r for _, r in rows)
    start = time.perf_counter()
    for group in groups:
        batch = token_batch([prompts[i] for i in group], [responses[i] for i in group], 0, torch.device("cpu"))
        logp = token_logp(model, batch, 1.0, chunk=knobs.get("logprob_chunk_tokens"), packed=bool(knobs.get("packing")))
        (-(logp * batch["mask"]).sum() / total).backward()
    optimizer.step()
    seconds = time.perf_counter() - start
    padded = (sum(sum(r) for r in rows) if knobs.get("packing")  # no padding at all
              else sum(len(group) * max(sum(rows[i]) for i in group) for group in groups))
    return {"config": config, "seconds": seconds, "tokens": sum(p + r for p, r in rows), "padded_tokens": padded,
            "micro_batches": len(groups), "peak_bytes": vm_hwm() - base}


def one_flow(name: str, blocks: int, rows: int, micro: int, image_size: int, seed: int) -> dict:
    """One flow configuration, in this process: the step's seconds and peak bytes above the baseline."""
    import torch
    from diffusers import SD3Transformer2DModel
    from released import SD35_MEDIUM_TRANSFORMER

    from unirl.stages.models.sd3 import SD3
    from unirl.stages.train.stack import checkpoint_blocks

    reset_hwm()
    base = vm_hwm()
    torch.manual_seed(seed)
    config = SD35_MEDIUM_TRANSFORMER
    model = SD3Transformer2DModel.from_config({**config, "num_layers": blocks}).train()
    if FLOW_CONFIGS[name].get("activation_checkpointing"):
        checkpoint_blocks(SD3.fsdp_units(model))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    side = image_size // 8
    g = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    for first in range(0, rows, micro):
        n = min(micro, rows - first)
        x = torch.randn((n, config["in_channels"], side, side), generator=g)
        cond = (torch.randn((n, TEXT_TOKENS, config["joint_attention_dim"]), generator=g),
                torch.randn((n, config["pooled_projection_dim"]), generator=g))
        v = SD3.forward(None, model, x, torch.rand((n,), generator=g), cond, None)
        (((v - x) ** 2).mean() * n / rows).backward()
    optimizer.step()
    seconds = time.perf_counter() - start
    tokens = rows * ((side // config["patch_size"]) ** 2 + TEXT_TOKENS)
    return {"config": name, "seconds": seconds, "tokens": tokens, "padded_tokens": tokens,
            "micro_batches": -(-rows // micro), "peak_bytes": vm_hwm() - base}


def estimate_flow(config: str, blocks: int, micro: int, image_size: int) -> int:
    """The transformer's terms of `unirl validate --memory` for this configuration (no frozen parts)."""
    from released import sd35_medium

    from unirl.stages.recipe import load_recipe
    from unirl.stages.run.memory import estimate as terms

    folder = sd35_medium(Path(tempfile.mkdtemp(prefix="unirl-train-step-")), num_layers=blocks)
    knobs = [f"train.{k}={str(v).lower()}" for k, v in {"activation_checkpointing": False, **FLOW_CONFIGS[config]}.items()]
    recipe = load_recipe(REPO / "docs" / "recipes" / "sd35-medium-lora-flow-grpo.yaml",
                         [f"model.path={folder}", "model.dtype=float32", "model.lora=null", "train.nproc_per_node=1",
                          f"train.micro_batch_size={micro}", f"rollout.sampler.image_size={image_size}",
                          "rollout.sampler.guidance_scale=1.0", *knobs])
    return sum(line.bytes for line in terms(recipe, 1) if line.what != "frozen models")


def estimate(config: str, layers: int, rows: list[tuple[int, int]]) -> int:
    """`unirl validate --memory`'s peak for this configuration (its train step), prompts and
    responses of the batch's longest row."""
    from unirl.stages.recipe import load_recipe
    from unirl.stages.run.memory import estimate as terms

    folder = Path(tempfile.mkdtemp(prefix="unirl-train-step-"))
    (folder / "config.json").write_text(json.dumps({**GEOMETRY, "num_hidden_layers": layers}))
    prompt, response = max(rows, key=sum)
    knobs = [f"train.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in CONFIGS[config].items()]
    recipe = load_recipe(REPO / "recipes" / "ar" / "tiny.yaml", [f"model.path={folder}", f"rollout.max_new_tokens={response}", *knobs])
    lines = terms(recipe, prompt)
    return sum(line.bytes for line in lines if not line.what.startswith("KV cache"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--flow", action="store_true", help="the SD3.5-medium transformer step instead")
    p.add_argument("--blocks", type=int, default=2, help="--flow: transformer blocks (24 is the real model)")
    p.add_argument("--flow-rows", type=int, default=4)
    p.add_argument("--flow-micro", type=int, default=2)
    p.add_argument("--image-size", type=int, default=512)
    p.add_argument("--one", help=argparse.SUPPRESS)  # a configuration in this process (what the parent starts)
    args = p.parse_args()
    if args.flow:
        return main_flow(args)
    rows = lengths(args.rows, args.min_len, args.max_len, args.seed)
    if args.one:
        print(json.dumps(one(args.one, args.layers, rows, args.seed)))
        return 0
    print(f"Qwen3-0.6B geometry, {args.layers} layer(s); {args.rows} rows of {min(map(sum, rows))}-{max(map(sum, rows))} tokens "
          f"({sum(map(sum, rows))} in all); OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')}", flush=True)
    argv = ["--layers", str(args.layers), "--rows", str(args.rows), "--min-len", str(args.min_len), "--max-len", str(args.max_len),
            "--seed", str(args.seed)]
    return table(args.configs, argv, lambda config: estimate(config, args.layers, rows), "padded tokens", "padded")


def table(configs: list[str], argv: list[str], estimate_of: Any, tokens: str, first_name: str) -> int:
    """Each configuration in a fresh process (`argv` and `--one`), a row each: its tokens/s beside
    the first's, its peak beside `estimate_of(config)`."""
    print(f"| configuration | micro-batches | {tokens} | tokens/s | x {first_name} | peak GiB | estimate GiB | estimate / peak |")
    print("|---|---|---|---|---|---|---|---|")
    first = None
    for config in configs:
        out = subprocess.run([sys.executable, __file__, *argv, "--one", config], capture_output=True, text=True, cwd=REPO)
        if out.returncode != 0:
            print(f"| {config} | failed: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode} |", flush=True)
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        rate = r["tokens"] / r["seconds"]
        first = first or rate
        est = estimate_of(config)
        print(f"| {config} | {r['micro_batches']} | {r['padded_tokens']} | {rate:.0f} | {rate / first:.2f} | "
              f"{r['peak_bytes'] / 2**30:.2f} | {est / 2**30:.2f} | {est / r['peak_bytes']:.2f} |", flush=True)
    return 0

def main_flow(args: argparse.Namespace) -> int:
    flow = ["--flow", "--blocks", str(args.blocks), "--flow-rows", str(args.flow_rows), "--flow-micro", str(args.flow_micro),
            "--image-size", str(args.image_size), "--seed", str(args.seed)]
    if args.one:
        print(json.dumps(one_flow(args.one, args.blocks, args.flow_rows, args.flow_micro, args.image_size, args.seed)))
        return 0
    print(f"SD3.5-medium transformer widths, {args.blocks} of 24 blocks; {args.flow_rows} rows of {args.image_size} px "
          f"({args.flow_micro} a micro-batch) + {TEXT_TOKENS} text tokens; fp32; "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')}", flush=True)
    return table(list(FLOW_CONFIGS), flow, lambda config: estimate_flow(config, args.blocks, args.flow_micro, args.image_size),
                 "tokens", "plain")

if __name__ == "__main__":
    sys.exit(main())
