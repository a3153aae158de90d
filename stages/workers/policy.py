"""What every rank of the worker group holds and does: the FSDP2-sharded policy (and optional
frozen reference), its AdamW optimizer, and the commands generate / train / save / publish.

Data moves only through run storage: commands carry relative paths, never tensors.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from stages.algorithms import grpo_loss, kl
from stages.recipe import Recipe
from stages.sample import join_on_sample_id, metadata, read_rollouts, read_shard, table_from_rows, write_shard
from stages.storage import RunStorage, iter_dir, join
from stages.workers import checkpoint
from stages.workers.sampling import derive_seed, sample


# Token-weighted averages over the batch, reported as train/<key>.
METRIC_KEYS = ("loss", "clip_frac", "clip_frac_low", "clip_frac_high", "approx_kl", "ratio_mean", "kl", "rollout_logp_abs_diff")


class OnPolicyRatioError(RuntimeError):
    """The first update of an iteration saw a ratio != 1: old and new log-probs disagree on-policy."""


def shard_model(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class PolicyWorker:
    def __init__(self, spec: dict[str, Any], mesh: Any, device: torch.device):
        self.recipe = Recipe.model_validate(spec["recipe"])
        self.storage = RunStorage(spec["root"], spec["run"], spec.get("options"))
        self.mesh = mesh
        self.device = device
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.scratch = Path(spec["scratch"]) / f"rank{self.rank}"
        self.scratch.mkdir(parents=True, exist_ok=True)
        base_dir = self._local_weights(spec["init_weights"])
        from stages.models import load_qwen3

        model, self.tokenizer = load_qwen3(base_dir, dtype=self.recipe.model.dtype)
        self.model = shard_model(model.to(device), mesh)
        self.reference = None
        if getattr(self.recipe.algorithm, "kl_coef", 0.0) > 0:
            ref, _ = load_qwen3(base_dir, dtype=self.recipe.model.dtype)
            ref.requires_grad_(False)
            self.reference = shard_model(ref.to(device).eval(), mesh)
        t = self.recipe.train
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay
        )
        self.version = int(spec["init_version"])
        if spec.get("checkpoint") is not None:
            self.version = checkpoint.load(self, int(spec["checkpoint"]))

    def _local_weights(self, rel: str) -> Path:
        if self.storage.local:
            return self.storage.local_path(rel)
        return self.storage.get_dir(rel, self.scratch / "init_weights")

    # -- commands ---------------------------------------------------------------------------
    def execute(self, cmd: str, args: dict[str, Any]) -> dict[str, Any]:
        handler = {
            "ping": self.ping,
            "generate": self.generate,
            "train": self.train,
            "save": self.save,
            "publish": self.publish,
        }.get(cmd)
        if handler is None:
            raise ValueError(f"unknown worker command {cmd!r}")
        return handler(**args)

    def ping(self) -> dict[str, Any]:
        return {"version": self.version, "world_size": self.world}

    def generate(self, iteration: int, requests: str, out_dir: str, greedy: bool = False) -> dict[str, Any]:
        """Sample `group_size` responses per request; each rank writes `out_dir/part-{rank:03d}.arrow`."""
        start = time.perf_counter()
        req = read_shard(self.storage, requests, "requests")
        samples = []
        for gid, prompt, meta, gsize in zip(
            req.column("group_id").to_pylist(), req.column("prompt").to_pylist(),
            req.column("metadata").to_pylist(), req.column("group_size").to_pylist(),
        ):
            samples += [(f"{gid}/{j}", gid, prompt, meta) for j in range(gsize)]
        samples.sort(key=lambda s: s[0])
        mine = samples[self.rank::self.world]
        r = self.recipe.rollout
        prompt_ids = [self.tokenizer(p, add_special_tokens=False).input_ids for _, _, p, _ in mine]
        seeds = [derive_seed(self.recipe.seed, iteration, sid) for sid, _, _, _ in mine]
        self.model.eval()
        out = sample(
            self.model, prompt_ids, seeds, max_new_tokens=r.max_new_tokens, temperature=r.temperature,
            top_p=r.top_p, eos_id=self.tokenizer.eos_token_id, pad_id=self.tokenizer.pad_token_id,
            device=self.device, greedy=greedy,
        )
        rows = []
        for (sid, gid, prompt, meta), pids, resp, lps, reason in zip(
            mine, prompt_ids, out.response_ids, out.logprobs, out.finish_reasons
        ):
            body = resp[:-1] if reason == "stop" else resp
            rows.append({
                "sample_id": sid, "group_id": gid, "iteration": iteration, "policy_version": self.version,
                "parts": ["text"], "metadata": meta, "prompt": prompt, "prompt_ids": pids,
                "response_ids": resp, "response_logprobs": lps, "finish_reason": reason,
                "text": self.tokenizer.decode(body, skip_special_tokens=True),
            })
        rel = join(out_dir, f"part-{self.rank:03d}.arrow")
        write_shard(self.storage, rel, table_from_rows(rows, "rollouts", ["text"]))
        counts = torch.tensor([len(rows), sum(len(x["response_ids"]) for x in rows)], dtype=torch.int64, device=self.device)
        dist.all_reduce(counts)
        return {
            "files": [join(out_dir, f"part-{k:03d}.arrow") for k in range(self.world)],
            "rows": int(counts[0]), "response_tokens": int(counts[1]),
            "policy_version": self.version, "seconds": time.perf_counter() - start,
        }

    # -- training ---------------------------------------------------------------------------
    def _batch_tensors(self, rows: dict[str, list]) -> dict[str, torch.Tensor]:
        """Right-padded prompt+response ids with a mask over response positions of the *labels*
        (logits at position t predict token t+1). Shapes: ids (B, T), mask/labels (B, T-1)."""
        seqs = [p + r for p, r in zip(rows["prompt_ids"], rows["response_ids"])]
        width = max(len(s) for s in seqs)
        pad = self.tokenizer.pad_token_id
        ids = torch.full((len(seqs), width), pad, dtype=torch.long)
        attn = torch.zeros((len(seqs), width), dtype=torch.long)
        mask = torch.zeros((len(seqs), width - 1), dtype=torch.float32)
        for i, (p, s) in enumerate(zip(rows["prompt_ids"], seqs)):
            ids[i, :len(s)] = torch.tensor(s)
            attn[i, :len(s)] = 1
            mask[i, len(p) - 1:len(s) - 1] = 1.0
        return {"ids": ids.to(self.device), "attn": attn.to(self.device), "mask": mask.to(self.device)}

    def _token_logp(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = model(input_ids=batch["ids"], attention_mask=batch["attn"], use_cache=False).logits[:, :-1]
        logp = torch.log_softmax(logits.float() / self.recipe.rollout.temperature, dim=-1)
        return logp.gather(-1, batch["ids"][:, 1:].unsqueeze(-1)).squeeze(-1)

    def _micro_batches(self, rows: dict[str, list], start: int, stop: int) -> list[dict[str, list]]:
        size = self.recipe.train.micro_batch_size
        return [{k: v[i:min(i + size, stop)] for k, v in rows.items()} for i in range(start, stop, size)]

    def train(self, iteration: int, rollouts: list[str], advantages: str) -> dict[str, Any]:
        """One batch: `updates_per_batch` optimizer steps over disjoint mini-batches."""
        start_time = time.perf_counter()
        table = read_rollouts(self.storage, rollouts)
        table = join_on_sample_id(table, read_shard(self.storage, advantages, "advantages"), ["advantage"], self.storage.url(advantages))
        mine = {
            "prompt_ids": table.column("prompt_ids").to_pylist()[self.rank::self.world],
            "response_ids": table.column("response_ids").to_pylist()[self.rank::self.world],
            "rollout_logp": table.column("response_logprobs").to_pylist()[self.rank::self.world],
            "advantage": table.column("advantage").to_pylist()[self.rank::self.world],
        }
        algo, t = self.recipe.algorithm, self.recipe.train
        updates = t.updates_per_batch
        n = len(mine["advantage"])
        bounds = [round(k * n / updates) for k in range(updates + 1)]
        minis = [self._micro_batches(mine, bounds[k], bounds[k + 1]) for k in range(updates)]
        # Every rank must run the same number of forwards (FSDP2 gathers collectively).
        counts = torch.tensor([len(m) for m in minis], dtype=torch.int64, device=self.device)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        self.model.train()
        old: dict[tuple[int, int], torch.Tensor] = {}
        if updates > 1:  # freeze old log-probs of later mini-batches before the first step
            with torch.no_grad():
                for k in range(1, updates):
                    for j in range(int(counts[k])):
                        if j < len(minis[k]):
                            old[(k, j)] = self._token_logp(self.model, self._batch_tensors(minis[k][j]))
                        else:
                            self._dummy_forward(no_grad=True)
        totals: dict[str, float] = {}
        skipped = 0
        grad_norms = []
        for k in range(updates):
            tokens = torch.tensor(
                [sum(len(r) for r in mb["response_ids"]) for mb in minis[k]] or [0], dtype=torch.float64
            ).sum().reshape(1).to(self.device)
            seqs = torch.tensor([float(bounds[k + 1] - bounds[k])], dtype=torch.float64, device=self.device)
            dist.all_reduce(tokens)
            dist.all_reduce(seqs)
            for j in range(int(counts[k])):
                if j >= len(minis[k]):
                    self._dummy_forward(no_grad=False)
                    continue
                mb = minis[k][j]
                batch = self._batch_tensors(mb)
                logp = self._token_logp(self.model, batch)
                old_logp = old.get((k, j), logp.detach())
                adv = torch.tensor(mb["advantage"], dtype=torch.float32, device=self.device)
                out = grpo_loss(
                    logp, old_logp, adv, batch["mask"], clip_low=algo.clip_low, clip_high=algo.clip_high,
                    agg=algo.agg, horizon=self.recipe.rollout.max_new_tokens,
                )
                if k == 0 and (out.metrics["ratio_max"] != 1.0 or out.metrics["ratio_min"] != 1.0):
                    raise OnPolicyRatioError(
                        f"iteration {iteration}: first on-policy update has ratio in "
                        f"[{out.metrics['ratio_min']}, {out.metrics['ratio_max']}], expected exactly 1"
                    )
                loss = out.loss
                mb_tokens = float(batch["mask"].sum())
                metrics = dict(out.metrics)
                if self.reference is not None:
                    with torch.no_grad():
                        ref_logp = self._token_logp(self.reference, batch)
                    kl_tok = kl(logp, ref_logp, algo.kl_estimator)
                    kl_mean = (kl_tok * batch["mask"]).sum() / batch["mask"].sum()
                    loss = loss + algo.kl_coef * kl_mean
                    metrics["kl"] = float(kl_mean.detach())
                share = mb_tokens / float(tokens) if algo.agg == "token_mean" else len(mb["advantage"]) / float(seqs)
                (loss * share * self.world).backward()
                rollout = self._pad_like(mb["rollout_logp"], batch["mask"])
                diff = ((old_logp - rollout).abs() * batch["mask"]).sum()
                metrics["rollout_logp_abs_diff"] = float(diff) / max(mb_tokens, 1.0)
                metrics["loss"] = float(loss.detach())
                for key, value in metrics.items():
                    totals[key] = totals.get(key, 0.0) + value * mb_tokens
                totals["_tokens"] = totals.get("_tokens", 0.0) + mb_tokens
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.max_grad_norm)
            norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
            if math.isfinite(norm):
                self.optimizer.step()
                grad_norms.append(norm)
            else:
                skipped += 1
            self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return self._reduce_metrics(totals, grad_norms, skipped, iteration, start_time)

    def _pad_like(self, lists: list[list[float]], mask: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(mask)
        for i, vals in enumerate(lists):
            idx = torch.nonzero(mask[i]).squeeze(-1)
            out[i, idx] = torch.tensor(vals[: len(idx)], dtype=torch.float32, device=mask.device)
        return out

    def _dummy_forward(self, *, no_grad: bool) -> None:
        """Take part in the collectives of a micro-batch this rank does not have."""
        ids = torch.full((1, 2), self.tokenizer.eos_token_id, dtype=torch.long, device=self.device)
        if no_grad:
            with torch.no_grad():
                self.model(input_ids=ids, use_cache=False)
            return
        (self.model(input_ids=ids, use_cache=False).logits.sum() * 0.0).backward()

    def _reduce_metrics(self, totals, grad_norms, skipped, iteration, start_time) -> dict[str, Any]:
        keys = [k for k in METRIC_KEYS if k != "kl" or self.reference is not None]
        vec = torch.tensor([totals.get(k, 0.0) for k in keys] + [totals.get("_tokens", 0.0)], dtype=torch.float64, device=self.device)
        dist.all_reduce(vec)
        tok = max(float(vec[-1]), 1.0)
        metrics = {k: float(vec[i]) / tok for i, k in enumerate(keys)}
        metrics["grad_norm"] = float(np.mean(grad_norms)) if grad_norms else float("nan")
        metrics["skipped_steps"] = skipped
        metrics["tokens"] = float(vec[-1])
        return {
            "iteration": iteration, "policy_version": self.version, "metrics": metrics,
            "seconds": time.perf_counter() - start_time,
        }

    # -- persistence ------------------------------------------------------------------------
    def save(self) -> dict[str, Any]:
        return checkpoint.save(self)

    def publish(self) -> dict[str, Any]:
        return checkpoint.publish(self)

    def export(self, local: Path, full_state: dict[str, torch.Tensor]) -> None:
        """A Hugging Face model folder (model.safetensors, config, tokenizer) from the full state."""
        from safetensors.torch import save_file

        save_file({k: v.contiguous().clone() for k, v in full_state.items()}, str(local / "model.safetensors"), metadata={"format": "pt"})
        self.model.config.save_pretrained(local)
        self.tokenizer.save_pretrained(local)
