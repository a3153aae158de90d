"""What every rank of the AR worker group holds and does: the FSDP2-sharded policy (optionally
with LoRA adapters; with KL, the reference is the adapter disabled or a frozen copy), AdamW with
an lr schedule, an optional EMA, and the commands generate / train / sft / save / publish.

Data moves only through run storage: commands carry relative paths, never tensors.
"""
from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist

from stages.algorithms import kl
from stages.sample import join_on_sample_id, read_rollouts, read_shard, table_from_rows, write_shard
from stages.storage import join
from stages.models.tokenizer import encode_prompt, uses_chat_template
from stages.workers.base import WorkerBase, shard
from stages.workers.ar_train import EMA, policy_loss, sequence_level, token_batch, token_logp
from stages.workers.sampling import derive_seed, sample

# Token-weighted averages over the batch, reported as train/<key>.
METRIC_KEYS = ("loss", "clip_frac", "clip_frac_low", "clip_frac_high", "approx_kl", "ratio_mean", "kl", "rollout_logp_abs_diff")


class OnPolicyRatioError(RuntimeError):
    """The first update of an iteration saw a ratio != 1: old and new log-probs disagree on-policy."""


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


def add_lora(model: torch.nn.Module, lora: Any) -> torch.nn.Module:
    """Wrap with peft LoRA; a target list that matches no module is an error naming what exists."""
    from peft import LoraConfig, get_peft_model

    targets = lora.target_modules or ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    missing = [t for t in targets if t not in names]
    if len(missing) == len(targets):
        raise ValueError(f"model.lora.target_modules {targets} match no linear layer (available: {', '.join(sorted(names))})")
    return get_peft_model(model, LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=targets, lora_dropout=0.0))


class PolicyWorker(WorkerBase):
    def __init__(self, spec: dict[str, Any], mesh: Any, device: torch.device):
        super().__init__(spec, mesh, device)
        from stages.models import load_qwen3

        m = self.recipe.model
        model, self.tokenizer = load_qwen3(self.base_dir, dtype=m.dtype)
        self.lora = m.lora
        if self.lora is not None:
            model = add_lora(model, self.lora)
        self.model = shard(model.to(device), decoder_layers(model), mesh)
        self.reference = None
        if getattr(self.recipe.algorithm, "kl_coef", 0.0) > 0 and self.lora is None:
            ref, _ = load_qwen3(self.base_dir, dtype=m.dtype)
            ref.requires_grad_(False)
            self.reference = shard(ref.to(device).eval(), decoder_layers(ref), mesh)
        t = self.recipe.train
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)
        self.ema = EMA(self.model, t.ema.decay) if t.ema else None
        self.use_chat = uses_chat_template(self.tokenizer, m.chat_template)
        self.restore(spec)

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a prompt, through the chat template when the recipe/tokenizer uses one."""
        return encode_prompt(self.tokenizer, text, self.use_chat)

    # -- commands ---------------------------------------------------------------------------
    def generate(
        self, iteration: int, requests: str, out_dir: str, greedy: bool = False, seed_tag: str = "", use_ema: bool = False
    ) -> dict[str, Any]:
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
        encoded = {p: self.encode_prompt(p) for p in {p for _, _, p, _ in mine}}  # once per prompt, not per sample
        prompt_ids = [encoded[p] for _, _, p, _ in mine]
        seeds = [derive_seed(self.recipe.seed, seed_tag, iteration, sid) for sid, _, _, _ in mine]
        self.model.eval()
        with self.ema_weights() if use_ema else nullcontext():
            out = sample(
                self.model, prompt_ids, seeds, max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                top_p=r.top_p, eos_id=self.tokenizer.eos_token_id, pad_id=self.tokenizer.pad_token_id,
                device=self.device, greedy=greedy,
            )
        rows = []
        for (sid, gid, prompt, meta), pids, resp, lps, reason in zip(mine, prompt_ids, out.response_ids, out.logprobs, out.finish_reasons):
            body = resp[:-1] if reason == "stop" else resp
            rows.append({
                "sample_id": sid, "group_id": gid, "iteration": iteration, "policy_version": self.version,
                "parts": ["text"], "metadata": meta, "prompt": prompt, "prompt_ids": pids,
                "response_ids": resp, "response_logprobs": lps, "finish_reason": reason,
                "text": self.tokenizer.decode(body, skip_special_tokens=True),
            })
        write_shard(self.storage, join(out_dir, f"part-{self.rank:03d}.arrow"), table_from_rows(rows, "rollouts", ["text"]))
        counts = torch.tensor([len(rows), sum(len(x["response_ids"]) for x in rows)], dtype=torch.int64, device=self.device)
        dist.all_reduce(counts)
        return {
            "files": [join(out_dir, f"part-{k:03d}.arrow") for k in range(self.world)],
            "rows": int(counts[0]), "response_tokens": int(counts[1]),
            "policy_version": self.version, "seconds": time.perf_counter() - start,
        }

    # -- RL training ------------------------------------------------------------------------
    @contextmanager
    def reference_policy(self) -> Iterator[torch.nn.Module]:
        """The frozen reference: the adapter disabled with LoRA (no second copy), else the copy."""
        if self.lora is not None:
            with self.model.disable_adapter():
                yield self.model
        else:
            yield self.reference

    @contextmanager
    def ema_weights(self) -> Iterator[None]:
        if self.ema is None:
            raise ValueError("evaluating EMA weights needs train.ema")
        backup = {n: p.detach().clone() for n, p in self.model.named_parameters() if n in self.ema.shadow}
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                if n in self.ema.shadow:
                    p.copy_(self.ema.shadow[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in self.model.named_parameters():
                    if n in backup:
                        p.copy_(backup[n])

    def _micro_batches(self, rows: dict[str, list], start: int, stop: int) -> list[dict[str, list]]:
        size = self.recipe.train.micro_batch_size
        return [{k: v[i:min(i + size, stop)] for k, v in rows.items()} for i in range(start, stop, size)]

    def _batch(self, mb: dict[str, list]) -> dict[str, torch.Tensor]:
        return token_batch(mb["prompt_ids"], mb["response_ids"], self.tokenizer.pad_token_id, self.device)

    def train(self, iteration: int, rollouts: list[str], advantages: str) -> dict[str, Any]:
        """One batch: `updates_per_batch` optimizer steps over disjoint mini-batches. Old
        log-probs of every mini-batch are frozen before the first step."""
        start_time = time.perf_counter()
        table = read_rollouts(self.storage, rollouts)
        adv_table = read_shard(self.storage, advantages, "advantages")
        kept = set(adv_table.column("sample_id").to_pylist())
        if len(kept) < table.num_rows:  # dynamic sampling dropped groups
            import pyarrow.compute as pc

            table = table.filter(pc.is_in(table.column("sample_id"), value_set=adv_table.column("sample_id")))
        table = join_on_sample_id(table, adv_table, ["advantage"], self.storage.url(advantages))
        pick = slice(self.rank, None, self.world)
        mine = {
            "prompt_ids": table.column("prompt_ids").to_pylist()[pick],
            "response_ids": table.column("response_ids").to_pylist()[pick],
            "rollout_logp": table.column("response_logprobs").to_pylist()[pick],
            "advantage": table.column("advantage").to_pylist()[pick],
        }
        algo, t = self.recipe.algorithm, self.recipe.train
        temperature, horizon = self.recipe.rollout.temperature, self.recipe.rollout.max_new_tokens
        updates, n = t.updates_per_batch, len(mine["advantage"])
        bounds = [round(k * n / updates) for k in range(updates + 1)]
        minis = [self._micro_batches(mine, bounds[k], bounds[k + 1]) for k in range(updates)]
        # Every rank must run the same number of forwards (FSDP2 gathers collectively).
        counts = torch.tensor([len(m) for m in minis], dtype=torch.int64, device=self.device)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        self.model.train()
        old: dict[tuple[int, int], torch.Tensor] = {}
        with torch.no_grad():  # freeze old log-probs of later mini-batches before any step
            for k in range(1, updates):
                for j in range(int(counts[k])):
                    if j < len(minis[k]):
                        old[(k, j)] = token_logp(self.model, self._batch(minis[k][j]), temperature)
                    else:
                        self._dummy_forward(no_grad=True)
        totals: dict[str, float] = {}
        grad_norms, skipped = [], 0
        by_seq = sequence_level(algo)
        for k in range(updates):
            tokens = float(sum(sum(len(r) for r in mb["response_ids"]) for mb in minis[k]))
            sizes = torch.tensor([tokens, float(bounds[k + 1] - bounds[k])], dtype=torch.float64, device=self.device)
            dist.all_reduce(sizes)
            for j in range(int(counts[k])):
                if j >= len(minis[k]):
                    self._dummy_forward(no_grad=False)
                    continue
                mb = minis[k][j]
                batch = self._batch(mb)
                logp = token_logp(self.model, batch, temperature)
                old_logp = old.get((k, j), logp.detach())
                adv = torch.tensor(mb["advantage"], dtype=torch.float32, device=self.device)
                out = policy_loss(algo, logp, old_logp, adv, batch["mask"], horizon)
                if k == 0 and (out.metrics["ratio_max"] != 1.0 or out.metrics["ratio_min"] != 1.0):
                    raise OnPolicyRatioError(
                        f"iteration {iteration}: first on-policy update has ratio in "
                        f"[{out.metrics['ratio_min']}, {out.metrics['ratio_max']}], expected exactly 1"
                    )
                loss, metrics = out.loss, dict(out.metrics)
                mb_tokens = float(batch["mask"].sum())
                if algo.kl_coef > 0:
                    with torch.no_grad(), self.reference_policy() as ref:
                        ref_logp = token_logp(ref, batch, temperature)
                    kl_mean = (kl(logp, ref_logp, algo.kl_estimator) * batch["mask"]).sum() / batch["mask"].sum()
                    loss = loss + algo.kl_coef * kl_mean
                    metrics["kl"] = float(kl_mean.detach())
                share = len(mb["advantage"]) / float(sizes[1]) if by_seq else mb_tokens / float(sizes[0])
                (loss * share * self.world).backward()
                rollout = self._pad_like(mb["rollout_logp"], batch["mask"])
                metrics["rollout_logp_abs_diff"] = float(((old_logp - rollout).abs() * batch["mask"]).sum()) / max(mb_tokens, 1.0)
                metrics["loss"] = float(loss.detach())
                for key, value in metrics.items():
                    totals[key] = totals.get(key, 0.0) + value * mb_tokens
                totals["_tokens"] = totals.get("_tokens", 0.0) + mb_tokens
            norm = self._optimizer_step()
            if np.isfinite(norm):
                grad_norms.append(norm)
            else:
                skipped += 1
        self.version += 1
        metrics = self._reduce_metrics(totals)
        metrics.update({
            "grad_norm": float(np.mean(grad_norms)) if grad_norms else float("nan"), "skipped_steps": skipped,
            "lr": self.optimizer.param_groups[0]["lr"],
        })
        return {"iteration": iteration, "policy_version": self.version, "metrics": metrics, "seconds": time.perf_counter() - start_time}

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

    def _reduce_metrics(self, totals: dict[str, float]) -> dict[str, float]:
        keys = [k for k in METRIC_KEYS if k != "kl" or self.recipe.algorithm.kl_coef > 0]
        vec = torch.tensor([totals.get(k, 0.0) for k in keys] + [totals.get("_tokens", 0.0)], dtype=torch.float64, device=self.device)
        dist.all_reduce(vec)
        tok = max(float(vec[-1]), 1.0)
        metrics = {k: float(vec[i]) / tok for i, k in enumerate(keys)}
        metrics["tokens"] = float(vec[-1])
        return metrics

    # -- supervised warm start --------------------------------------------------------------
    def sft(self, data: str, steps: int, batch_size: int, lr: float, seed: int, start_step: int = 0) -> dict[str, Any]:
        """Steps [start_step, start_step + steps) of cross-entropy on response tokens only, over
        records `data` (prompt, response). Batch of step s: a seeded permutation of the records,
        split across ranks; its own AdamW at `lr`, so RL starts with a fresh optimizer."""
        start = time.perf_counter()
        table = read_shard(self.storage, data, "sft")
        if "response" not in table.schema.names:
            raise ValueError(f"{self.storage.url(data)}: SFT records for a language model need a 'response' column")
        prompts = [self.encode_prompt(p) for p in table.column("prompt").to_pylist()]
        eos = self.tokenizer.eos_token_id
        responses = [self.tokenizer(r, add_special_tokens=False).input_ids + [eos] for r in table.column("response").to_pylist()]
        if not hasattr(self, "_sft_optimizer"):
            self._sft_optimizer = torch.optim.AdamW(self.trainable, lr=lr, weight_decay=0.0)
        n = len(prompts)
        losses = []
        self.model.train()
        for step in range(start_step, start_step + steps):
            order = np.random.default_rng(derive_seed(seed, "sft-epoch", (step * batch_size) // n)).permutation(n)
            idx = [int(order[(step * batch_size + i) % n]) for i in range(batch_size)][self.rank::self.world]
            batch = token_batch([prompts[i] for i in idx], [responses[i] for i in idx], self.tokenizer.pad_token_id, self.device)
            logp = token_logp(self.model, batch, 1.0)
            tokens = torch.tensor([float(batch["mask"].sum())], dtype=torch.float64, device=self.device)
            dist.all_reduce(tokens)
            loss = -(logp * batch["mask"]).sum() / float(tokens)
            (loss * self.world).backward()
            torch.nn.utils.clip_grad_norm_(self.trainable, self.recipe.train.max_grad_norm)
            self._sft_optimizer.step()
            self._sft_optimizer.zero_grad(set_to_none=True)
            total = loss.detach().to(torch.float64).reshape(1)
            dist.all_reduce(total)
            losses.append(float(total))
        return {"loss": float(np.mean(losses)), "last_loss": losses[-1], "steps": start_step + steps, "seconds": time.perf_counter() - start}

    # -- publication ------------------------------------------------------------------------
    def export(self, local: Path, full_state: dict[str, torch.Tensor]) -> None:
        """A Hugging Face model folder (model.safetensors, config, tokenizer) from the full state;
        LoRA adapters are merged, so the folder is a plain `model.path` for the next recipe.
        With an EMA, its weights go to `ema/` the same way."""
        from safetensors.torch import save_file

        def write(folder: Path, state: dict[str, torch.Tensor]) -> None:
            folder.mkdir(parents=True, exist_ok=True)
            if self.lora is not None:
                state = self._merged(state)
            save_file({k: v.contiguous().clone() for k, v in state.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})
            config = self.model.config if self.lora is None else self.model.get_base_model().config
            config.save_pretrained(folder)
            self.tokenizer.save_pretrained(folder)

        write(local, full_state)
        if self.ema is not None and getattr(self, "_ema_full", None) is not None:
            write(local / "ema", {**full_state, **self._ema_full})

    def _merged(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Base weights with the LoRA update folded in (W + B A * alpha / r), in base names."""
        from stages.models import load_qwen3

        base, _ = load_qwen3(self.base_dir)
        peft_model = add_lora(base, self.lora)
        missing, unexpected = peft_model.load_state_dict(state, strict=False)
        if unexpected:
            raise ValueError(f"LoRA export: unexpected keys {unexpected[:3]}")
        return peft_model.merge_and_unload().state_dict()
