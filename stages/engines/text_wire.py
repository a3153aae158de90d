"""Text rollouts through an engine's /generate: the text policy's prompt encoding (chat template
and all) on the client, one batched request with a `sampling_seed` per sample derived exactly as
trainside sampling derives it, and SGLang's answer mapped onto the text segment of a rollout row.

The recorded behaviour log-prob of a token is the engine's `output_token_logprobs` entry: SGLang
returns log softmax(logits / temperature) there by default (unless SGLANG_RETURN_ORIGINAL_LOGPROB
is set, docs/engines.md), the quantity the trainer replays.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from unirl.stages.engines.client import EngineClient, EngineError, finish_reason
from unirl.stages.runtime.seeds import derive_seed
from unirl.stages.runtime.tokenizer import encode_prompt, load_tokenizer, uses_chat_template


class TextWire:
    segment = "text"
    reports_version = True  # meta_info.weight_version on every response, /model_info weight_version

    @classmethod
    def for_engine(cls, engine: Any) -> TextWire:
        """The wire of a dedicated engine: the tokenizer of the run's initial weights."""
        return cls(engine.recipe, engine.local(engine.storage.weights_rel(0)))

    def __init__(self, recipe: Any, tokenizer_dir: Path):
        self.recipe = recipe
        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.use_chat = uses_chat_template(self.tokenizer, recipe.model.chat_template)

    def encode(self, prompts: list[str]) -> list[list[int]]:
        encoded = {p: encode_prompt(self.tokenizer, p, self.use_chat) for p in dict.fromkeys(prompts)}
        return [encoded[p] for p in prompts]

    def prompt_ids(self, samples: list[tuple[str, str, str, Any]], token_prompts: dict[str, list[int]] | None) -> list[list[int]]:
        """Each sample's prompt tokens: the request's token ids where it gives them, else its text encoded."""
        encoded = self.encode([p for _, _, p, _ in samples])
        given = token_prompts or {}
        return [list(given[gid]) if gid in given else ids for (_, gid, _, _), ids in zip(samples, encoded)]

    def sampling(self, samples: list[tuple[str, str, str, Any]], *, iteration: int, seed_tag: str, greedy: bool,
                 length: str = "max_new_tokens", seed: str = "sampling_seed",
                 budgets: dict[str, int] | None = None) -> list[dict[str, Any]]:
        """Each sample's sampling parameters, its seed derived as trainside sampling derives it
        (`length`, `seed`: the engine's names for the length cap and the seed; `budgets`: a
        sample's own length cap, where it has one)."""
        c, budgets = self.recipe.rollout, budgets or {}
        return [{"temperature": 0.0 if greedy else c.temperature, "top_p": c.top_p, length: budgets.get(sid, c.max_new_tokens),
                 "stop_token_ids": [self.tokenizer.eos_token_id], seed: derive_seed(self.recipe.seed, seed_tag, iteration, sid)}
                for sid, _, _, _ in samples]

    def inputs(self, samples: list[tuple[str, str, str, Any]], token_prompts: dict[str, list[int]] | None,
               continuations: dict[str, tuple[list[int], int]] | None) -> tuple[list[list[int]], list[list[int]], dict[str, int]]:
        """(each sample's prompt ids as its row records them, the ids the engine continues, the
        samples' own length caps): a continued sample (`continuations`: sample id -> (its prompt
        and the response so far, new tokens at most), stages/engines/partial.py) goes on from its prefix."""
        prompt_ids = self.prompt_ids(samples, token_prompts)
        if not continuations:
            return prompt_ids, prompt_ids, {}
        fed = [list(continuations[sid][0]) if sid in continuations else ids for (sid, _, _, _), ids in zip(samples, prompt_ids)]
        return prompt_ids, fed, {sid: n for sid, (_, n) in continuations.items()}

    def rollout(self, client: EngineClient, samples: list[tuple[str, str, str, Any]], *, iteration: int, seed_tag: str,
                greedy: bool, lora: str | None, transitions: bool, token_prompts: dict[str, list[int]] | None = None,
                continuations: dict[str, tuple[list[int], int]] | None = None) -> list[dict[str, Any]]:
        """One row per (sample id, group id, prompt, metadata); `policy_version` is the version the
        engine reports for each response; a continued sample's row holds the new tokens alone."""
        eos = self.tokenizer.eos_token_id
        prompt_ids, fed, budgets = self.inputs(samples, token_prompts, continuations)
        params = self.sampling(samples, iteration=iteration, seed_tag=seed_tag, greedy=greedy, budgets=budgets)
        outs = client.generate(fed, params, lora_path=lora, rid=f"it{iteration:06d}-{seed_tag or 'rollout'}")
        if len(outs) != len(samples):
            raise EngineError(f"rollout engine at {client.url}: {len(outs)} responses for {len(samples)} prompts")
        rows = []
        for (sid, gid, prompt, meta), pids, out in zip(samples, prompt_ids, outs):
            info = out["meta_info"]
            where = f"rollout engine at {client.url}, sample {sid!r}"
            pairs = info.get("output_token_logprobs")
            if pairs is None:
                raise EngineError(f"{where}: no output_token_logprobs in the answer (return_logprob was sent)")
            resp = [int(p[1]) for p in pairs]
            lps = [float(p[0]) for p in pairs]
            ids = out.get("output_ids")
            if ids is not None and list(ids)[:len(resp)] != resp:
                raise EngineError(f"{where}: output_ids {list(ids)[:8]} disagree with output_token_logprobs' tokens {resp[:8]}")
            reason = finish_reason(info, where)
            body = resp[:-1] if reason == "stop" and resp and resp[-1] == eos else resp
            rows.append({
                "sample_id": sid, "group_id": gid, "metadata": meta, "prompt": prompt, "prompt_ids": pids,
                "response_ids": resp, "response_logprobs": lps, "finish_reason": reason,
                "text": self.tokenizer.decode(body, skip_special_tokens=True),
                "policy_version": reported_version(info.get("weight_version"), where),
            })
        return rows

    @staticmethod
    def counters(rows: list[dict[str, Any]]) -> dict[str, int]:
        return {"response_tokens": sum(len(r["response_ids"]) for r in rows)}


def reported_version(value: Any, where: str) -> int:
    """The unirl policy version an engine reports (`weight_version`, a string)."""
    try:
        return int(str(value))
    except ValueError:
        raise EngineError(f"{where}: the engine serves weight_version {value!r}, not a unirl policy version; load "
                          "published weights into it first (the sync task does, with weight_version set)") from None
