"""The autoregressive text policy: prompts -> token ids (through the chat template when the
tokenizer has one), sampled responses with fp32 log-probs recorded at sampling time
(stages/policies/text_sampling.py), and the trainer's replay of a response: log softmax of a
full forward at the response tokens.

Behaviour policy. Sampling decodes incrementally with a KV cache over left-padded prompts; the
replay is one full forward over right-padded sequences. In fp32 the two differ by rounding only:
measured on the tiny Qwen3 over 2048 responses, at most 3e-6 (`docs/extending.md`); the default
tolerance is 1e-4 (bf16 parameters: 0.1). A larger difference means sampling and training did not
see the same weights, tokens or positions, and the first update fails naming the sample.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import pyarrow as pa
import torch
from pydantic import Field

from stages.policies import Policy, RolloutBase, policies
from stages.seeds import derive_seed


PREVIEW_ROWS = 16


class TextRollout(RolloutBase):
    """How text samples are generated."""

    kind: Literal["text"] = Field("text", description="Policy kind (set from the model family).")
    max_new_tokens: int = Field(8, ge=1, description="Generation length cap; longer answers finish as `length`.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (also used for training log-probs).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")


def token_batch(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded prompt+response ids and a mask over response positions of the labels
    (logits at position t predict token t+1). Shapes: ids/attn (B, T), mask (B, T-1)."""
    seqs = [p + r for p, r in zip(prompt_ids, response_ids)]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    mask = torch.zeros((len(seqs), width - 1), dtype=torch.float32)
    for i, (p, s) in enumerate(zip(prompt_ids, seqs)):
        ids[i, :len(s)] = torch.tensor(s)
        attn[i, :len(s)] = 1
        mask[i, len(p) - 1:len(s) - 1] = 1.0
    return {"ids": ids.to(device), "attn": attn.to(device), "mask": mask.to(device)}


def token_logp(model: torch.nn.Module, batch: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
    """log softmax(logits / temperature) at the next token, fp32. Returns (B, T-1)."""
    logits = model(input_ids=batch["ids"], attention_mask=batch["attn"], use_cache=False).logits[:, :-1]
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, batch["ids"][:, 1:].unsqueeze(-1)).squeeze(-1)


def pad_like(lists: list[list[float]], mask: torch.Tensor) -> torch.Tensor:
    """Per-sample values over the response positions of `mask` (B, T-1), zeros elsewhere."""
    out = torch.zeros_like(mask)
    for i, vals in enumerate(lists):
        idx = torch.nonzero(mask[i]).squeeze(-1)
        out[i, idx] = torch.tensor(vals[: len(idx)], dtype=torch.float32, device=mask.device)
    return out


@dataclass
class TextBatch:
    """A micro-batch of stored text segments. ids/attn (B, T); mask (B, T-1) over response
    tokens; behaviour (B, T-1): the log-probs recorded at sampling time (0 off the mask);
    advantage (B,); versions (B,): the policy version that sampled each row (None: the trained one)."""

    sample_ids: list[str]
    ids: torch.Tensor
    attn: torch.Tensor
    mask: torch.Tensor
    behaviour: torch.Tensor
    advantage: torch.Tensor
    versions: torch.Tensor | None = None

    def fresh(self, version: int) -> torch.Tensor:
        """(B,) bool: the rows sampled by policy `version` (all of them when versions are not known)."""
        if self.versions is None:
            return torch.ones(len(self.sample_ids), dtype=torch.bool, device=self.mask.device)
        return self.versions == version

    def tokens(self) -> dict[str, torch.Tensor]:
        return {"ids": self.ids, "attn": self.attn, "mask": self.mask}

    @property
    def weight(self) -> float:
        """What the update's metrics are weighted by: response tokens."""
        return float(self.mask.sum())


@policies.register("text")
class TextPolicy(Policy):
    kind = "text"
    segment = "text"
    weight_name = "tokens"
    rollout_config = TextRollout

    @classmethod
    def default_tolerance(cls, dtype: str) -> float:
        return 1e-4 if dtype == "float32" else 0.1

    @classmethod
    def check(cls, recipe: Any) -> None:
        overlong = recipe.reward.overlong
        if overlong.truncated == "soft" and overlong.buffer > recipe.rollout.max_new_tokens:
            raise ValueError(
                f"reward.overlong.buffer: {overlong.buffer} is longer than rollout.max_new_tokens "
                f"({recipe.rollout.max_new_tokens}); the soft penalty ramp must fit inside the length cap"
            )

    @classmethod
    def log_preview(cls, recipe: Any, tracker: Any, storage: Any, iteration: int) -> str | None:
        """A table of the iteration's first samples, one per group first: prompt, response, reward,
        advantage (MLflow `tables/samples/step-N.json`)."""
        from stages.sample import read_rollouts, read_shard

        gen = storage.stage_manifest(iteration, "generate")
        if gen is None:
            return None
        table = read_rollouts(storage, gen["files"], columns=["sample_id", "group_id", "prompt", "text"])
        values = {}
        for stage, column in (("score", "reward"), ("advantage", "advantage")):
            manifest = storage.stage_manifest(iteration, stage)
            if manifest is not None:
                shard = read_shard(storage, manifest["files"][0], "rewards" if stage == "score" else "advantages")
                values[column] = dict(zip(shard.column("sample_id").to_pylist(), shard.column(column).to_pylist()))
        ids, groups = table.column("sample_id").to_pylist(), table.column("group_id").to_pylist()
        seen: set[str] = set()
        first = [i for i, g in enumerate(groups) if not (g in seen or seen.add(g))]
        pick = (first + [i for i in range(len(ids)) if i not in first])[:PREVIEW_ROWS]
        prompts, texts = table.column("prompt").to_pylist(), table.column("text").to_pylist()
        columns = {"sample_id": [ids[i] for i in pick], "prompt": [prompts[i] for i in pick],
                   "response": [texts[i] for i in pick]}
        for column, by_id in values.items():
            columns[column] = [by_id.get(ids[i]) for i in pick]
        return tracker.log_table(iteration, columns, "samples")

    def __init__(self, family: Any, bundle: Any, recipe: Any, device: torch.device):
        from stages.models.tokenizer import uses_chat_template

        self.family, self.bundle, self.recipe, self.device = family, bundle, recipe, device
        self.tokenizer = bundle.tokenizer
        self.use_chat = uses_chat_template(self.tokenizer, recipe.model.chat_template)
        self.cfg: TextRollout = recipe.rollout

    # -- conditions -----------------------------------------------------------------------------
    def encode(self, prompts: list[str]) -> list[list[int]]:
        """Token ids of each prompt, through the chat template when the recipe/tokenizer uses one."""
        from stages.models.tokenizer import encode_prompt

        encoded = {p: encode_prompt(self.tokenizer, p, self.use_chat) for p in dict.fromkeys(prompts)}
        return [encoded[p] for p in prompts]

    # -- sampling -------------------------------------------------------------------------------
    def rollout(self, module: Any, samples: list[tuple[str, str, str, Any]], *, iteration: int, seed_tag: str,
                greedy: bool, stack: Any, transitions: bool) -> list[dict[str, Any]]:
        """One response per (sample id, group id, prompt, metadata) of this rank, all in one batch."""
        from stages.policies.text_sampling import sample

        c = self.cfg
        prompt_ids = self.encode([p for _, _, p, _ in samples])
        seeds = [derive_seed(self.recipe.seed, seed_tag, iteration, sid) for sid, _, _, _ in samples]
        module.eval()
        out = sample(
            module, prompt_ids, seeds, max_new_tokens=c.max_new_tokens, temperature=c.temperature, top_p=c.top_p,
            eos_id=self.tokenizer.eos_token_id, pad_id=self.tokenizer.pad_token_id, device=self.device, greedy=greedy,
        )
        rows = []
        for (sid, gid, prompt, meta), pids, resp, lps, reason in zip(samples, prompt_ids, out.response_ids, out.logprobs, out.finish_reasons):
            body = resp[:-1] if reason == "stop" else resp
            rows.append({
                "sample_id": sid, "group_id": gid, "metadata": meta, "prompt": prompt, "prompt_ids": pids,
                "response_ids": resp, "response_logprobs": lps, "finish_reason": reason,
                "text": self.tokenizer.decode(body, skip_special_tokens=True),
            })
        return rows

    @staticmethod
    def counters(rows: list[dict[str, Any]]) -> dict[str, int]:
        return {"response_tokens": sum(len(r["response_ids"]) for r in rows)}

    # -- replay ---------------------------------------------------------------------------------
    def batches(self, table: pa.Table, chunks: list[list[int]], advantages: Any, where: str) -> list[TextBatch]:
        """Micro-batches of a rollout table (sorted by sample id): one per chunk of row indices."""
        cols = {n: table.column(n).to_pylist()
                for n in ("sample_id", "prompt_ids", "response_ids", "response_logprobs", "policy_version")}
        out = []
        for rows in chunks:
            take = lambda name: [cols[name][r] for r in rows]  # noqa: E731
            t = token_batch(take("prompt_ids"), take("response_ids"), self.tokenizer.pad_token_id, self.device)
            adv = torch.tensor([float(advantages[r]) for r in rows], dtype=torch.float32, device=self.device)
            out.append(TextBatch(take("sample_id"), t["ids"], t["attn"], t["mask"],
                                 pad_like(take("response_logprobs"), t["mask"]), adv,
                                 torch.tensor(take("policy_version"), dtype=torch.int64, device=self.device)))
        return out

    def stand_in(self, template: Any) -> TextBatch:
        """A one-sample batch (an eos and a token) for ranks short of micro-batches: its weight is 0."""
        eos = self.tokenizer.eos_token_id
        t = token_batch([[eos]], [[eos]], self.tokenizer.pad_token_id, self.device)
        return TextBatch(["stand-in"], t["ids"], t["attn"], t["mask"], torch.zeros_like(t["mask"]),
                         torch.zeros(1, device=self.device))

    def template(self, batch: TextBatch | None, stack: Any) -> Any:
        return None

    def replay(self, module: Any, batch: TextBatch, selection: Any = None) -> torch.Tensor:
        """log pi(response token | prefix) under `module`, fp32: (B, T-1), meaningful on the mask."""
        return token_logp(module, batch.tokens(), self.cfg.temperature)

    def decode(self, response_ids: list[int]) -> str:
        return self.tokenizer.decode(response_ids, skip_special_tokens=True)

    def check_batch(self, batch: TextBatch, iteration: int, algorithm: Any, where: str) -> None:
        """Nothing to check before replaying text: the behaviour check compares every token."""

    # -- supervised warm start ------------------------------------------------------------------
    @classmethod
    def sft_spec(cls, recipe: Any) -> tuple[Any, Any]:
        """AdamW at `sft.lr`, constant, no EMA: the optimizer of the warm start."""
        from stages.train.stack import OptimizerSpec

        return OptimizerSpec(lr=recipe.sft.lr, total=recipe.sft.steps, max_grad_norm=recipe.train.max_grad_norm), None

    def sft_setup(self, table: pa.Table, where: str, stack: Any, seed: int) -> dict[str, Any]:
        """Encode the records (prompt, response) once: responses end in eos."""
        if "response" not in table.schema.names:
            raise ValueError(f"{where}: SFT records for a language model need a 'response' column")
        eos = self.tokenizer.eos_token_id
        self._sft_prompts = self.encode(table.column("prompt").to_pylist())
        self._sft_responses = [self.tokenizer(r, add_special_tokens=False).input_ids + [eos] for r in table.column("response").to_pylist()]
        return {}

    def sft_loss(self, module: Any, step: int, *, seed: int, batch_size: int, stack: Any) -> tuple[torch.Tensor, float]:
        """Cross-entropy on the response tokens of step `step`'s records (a seeded permutation per
        epoch, split across ranks), as this rank's share of the batch mean: (loss to backpropagate
        times world, its value summed over ranks)."""
        import numpy as np

        n = len(self._sft_prompts)
        order = np.random.default_rng(derive_seed(seed, "sft-epoch", (step * batch_size) // n)).permutation(n)
        idx = stack.my_share([int(order[(step * batch_size + i) % n]) for i in range(batch_size)])
        batch = token_batch([self._sft_prompts[i] for i in idx], [self._sft_responses[i] for i in idx],
                            self.tokenizer.pad_token_id, self.device)
        logp = token_logp(module, batch, 1.0)
        tokens = torch.tensor([float(batch["mask"].sum())], dtype=torch.float64, device=self.device)
        stack.all_reduce(tokens)
        loss = -(logp * batch["mask"]).sum() / float(tokens)
        return loss * stack.world, loss
