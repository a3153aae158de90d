"""How far the trainer's replay of long multi-turn trajectories is from the sampler's record, by
context position and by log-prob: the rounding the behaviour check's three levels are sized for
(docs/extending.md, "The behaviour check").

    python benchmarks/behaviour_rounding.py [--rows 64] [--turns 3] [--threads 1 2] [--seeds 0 1 2]

Trajectories as an agent's (stages/tools/agent.py): each assistant turn is sampled by the text
policy's sampler (stages/policies/text_sampling.py: a left-padded prefill of the whole context so
far, then incremental decoding with a KV cache), a 20-token tool turn is appended between turns,
and the whole trajectory is replayed in one right-padded forward (stages/policies/text.py, micro-
batches of 16) as the trainer does. The model is the agentic quickstart's tiny Qwen3 geometry
with its output layer scaled so that logits reach a trained model's range (|logit| ~ 10; a random
init's are ~0.1, where the log-probs barely round at all).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
VOCAB, EOS, PAD, TOOL_TOKENS = 64, 1, 0, 20


def tiny_agent_model(seed: int, logit_scale: float = 60.0) -> torch.nn.Module:
    """The agentic quickstart's tiny Qwen3 geometry, seeded, with `logit_scale` on its output layer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                         num_key_value_heads=1, head_dim=32, intermediate_size=128,
                                         max_position_embeddings=512, tie_word_embeddings=False)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    return model


def multi_turn(model: torch.nn.Module, rows: int, turns: int, seed: int, max_new_tokens: int = 80):
    """Sample `rows` trajectories of `turns` assistant turns. Returns (prompts, responses, own, records):
    per row the first prompt's ids, everything after it, 1/0 per response token (the policy's own
    / a tool's), and the sampler's log-probs on those positions (0 on tool tokens)."""
    from unirl.stages.policies.text_sampling import sample

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, 12, (rows,), generator=gen).tolist()
    contexts = [torch.randint(2, VOCAB, (n,), generator=gen).tolist() for n in lengths]
    prompts = [list(c) for c in contexts]
    own: list[list[int]] = [[] for _ in contexts]
    records: list[list[float]] = [[] for _ in contexts]
    for turn in range(turns):
        out = sample(model, contexts, [1000 * seed + 100 * turn + i for i in range(rows)], max_new_tokens=max_new_tokens,
                     temperature=1.0, top_p=1.0, eos_id=EOS, pad_id=PAD, device=torch.device("cpu"))
        for i, (resp, lps) in enumerate(zip(out.response_ids, out.logprobs)):
            tool = torch.randint(2, VOCAB, (TOOL_TOKENS,), generator=gen).tolist() if turn < turns - 1 else []
            contexts[i] = contexts[i] + resp + tool
            own[i] += [1] * len(resp) + [0] * len(tool)
            records[i] += list(lps) + [0.0] * len(tool)
    return prompts, [c[len(p):] for c, p in zip(contexts, prompts)], own, records


def replay_diffs(model: torch.nn.Module, prompts, responses, own, records, micro_batch: int = 16):
    """|replay - record| of every policy token, with its position in the trajectory and its recorded
    log-prob: three 1-D tensors."""
    from unirl.stages.policies.text import token_batch, token_logp

    diffs, positions, logps = [], [], []
    for lo in range(0, len(prompts), micro_batch):
        hi = min(lo + micro_batch, len(prompts))
        batch = token_batch(prompts[lo:hi], responses[lo:hi], PAD, torch.device("cpu"))
        with torch.no_grad():
            replayed = token_logp(model, batch, 1.0)
        for j, i in enumerate(range(lo, hi)):
            start = len(prompts[i]) - 1
            mine = torch.tensor(own[i], dtype=torch.bool)
            record = torch.tensor(records[i])
            diffs.append((replayed[j, start:start + len(responses[i])] - record)[mine].abs())
            positions.append((torch.arange(len(responses[i])) + len(prompts[i]))[mine])
            logps.append(record[mine])
    return torch.cat(diffs), torch.cat(positions), torch.cat(logps)


def table(d: torch.Tensor, key: torch.Tensor, edges: list[float], label: str) -> list[str]:
    lines = [f"  {label:<18} {'tokens':>7} {'mean':>9} {'p99.9':>9} {'max':>9} {'>1e-4':>6}"]
    for lo, hi in zip(edges[:-1], edges[1:]):
        sel = (key >= lo) & (key < hi)
        if sel.any():
            x = d[sel]
            lines.append(f"  [{lo:g}, {hi:g}){'':<{max(0, 16 - len(f'[{lo:g}, {hi:g})'))}} {int(sel.sum()):7d} "
                         f"{float(x.mean()):9.2e} {float(x.quantile(0.999)):9.2e} {float(x.max()):9.2e} {int((x > 1e-4).sum()):6d}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    for threads in args.threads:
        torch.set_num_threads(threads)
        d, pos, lp = [], [], []
        for seed in args.seeds:
            model = tiny_agent_model(seed)
            x, p, lps = replay_diffs(model, *multi_turn(model, args.rows, args.turns, seed))
            d.append(x)
            pos.append(p)
            lp.append(lps)
        diffs, positions, logps = torch.cat(d), torch.cat(pos).float(), torch.cat(lp)
        print(f"threads {threads}: {diffs.numel()} policy tokens, {len(args.seeds)} seeds x {args.rows} trajectories of "
              f"{args.turns} turns; largest |replay - record| {float(diffs.max()):.2e}, mean {float(diffs.mean()):.2e}")
        print("\n".join(table(diffs, positions, [0, 64, 128, 192, 256, 320, 400], "position")))
        print("\n".join(table(diffs, -logps, [0, 0.01, 0.1, 1, 3, 10, 100], "-log-prob")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
