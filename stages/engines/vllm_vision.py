"""Prompts with images through vLLM (the families that `takes_images`: qwen2_5_vl, qwen3_vl): the
rows of VLLMWire, each prompt sent with its images and each row carrying them, as trainside rows do.

Route. vLLM's tokens-in endpoint `/inference/v1/generate` (0.32: one of the scale-out endpoints,
served with `--enable-scale-out`; vllm/entrypoints/scale_out/token_in_token_out/) takes a prompt as
`token_ids` with its images as `content_parts` (`{"type": "image_url", "url": "data:image/png;base64,..."}`)
and vLLM's own `sampling_params` (n, seed, temperature, ..., `logprobs: 0`); it answers each
choice's `token_ids` with `logprobs.content` (the token id and log-prob of every sampled token)
and, with `return_token_ids`, the prompt's ids as vLLM's multimodal processor expanded them. The
other routes do not fit: `/v1/completions` takes token ids but no images; `/v1/chat/completions`
takes images but renders the prompt from messages with the server's chat template, so the ids it
conditions on are its own and an agent's later turn (token ids) cannot be sent at all.

Placeholders. vLLM's Qwen-VL processors replace an image's one `<|image_pad|>` in the prompt with
one per merged patch group of the image (t * h * w / merge^2, `_get_prompt_updates`), which is how
ImagePrompts.encode expands them for the trainer. So a request carries the row's prompt with each
image's run of placeholders cut to one, and the ids vLLM answers it conditioned on must be the
row's: a server whose image processor cuts an image otherwise (other min/max pixels) is an error
naming the sample, never rows the trainer would replay with other image tokens.

Banned tokens. The trainer samples and replays with the image marker tokens at probability 0
(ImagePrompts.banned); a request biases them by -100 (`logit_bias`, applied before vLLM's
processed log-probs), so the distribution vLLM samples and reports is the trainer's to e^-100.

Bounds. A request is refused before it is sent when its JSON would pass the engine server's
request limit (stages/engines/limits.py `max_request_bytes`, 16 MiB): a prompt's images are sent
once per request, as base64. An answer must hold exactly the samples asked for, each at most
`max_tokens` tokens with one log-prob per token, or the batch fails naming the sample.
"""
from __future__ import annotations

import base64
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from unirl.stages.engines.client import EngineError
from unirl.stages.engines.limits import Limits
from unirl.stages.engines.vllm import VLLMWire, batched_requests, unchanged_version
from unirl.stages.models.family import get_family

BANNED_BIAS = -100.0  # OpenAI's and vLLM's bound for a logit bias: e^-100 of the mass, the trainer's 0
NO_LOGPROB = -9999.0  # what vLLM answers for a sampled token without a log-prob (or a NaN one)
Shown = tuple[list[bytes], list[tuple[int, int, int]]]  # a group's PNG bytes and (t, h, w) patch grids


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def collapsed(ids: list[int], image_token: int, counts: list[int], where: str) -> list[int]:
    """`ids` with each image's run of `image_token` cut to one (what vLLM expands again); the runs
    must be the images' token counts, in order."""
    out: list[int] = []
    runs: list[int] = []
    for position, token in enumerate(ids):
        if token == image_token and position and ids[position - 1] == image_token:
            runs[-1] += 1
            continue
        if token == image_token:
            runs.append(1)
        out.append(token)
    if runs != counts:
        raise EngineError(f"{where}: the prompt holds image placeholder runs of {runs} tokens for images of {counts} "
                          "tokens; its token ids were written for other images (or another image processor)")
    return out


def choices_of(answer: Any, prompt_ids: list[int], n: int, max_tokens: int, where: str) -> list[tuple[list[int], list[float], str]]:
    """(token ids, log-probs, finish reason) of each of the `n` samples of a /inference/v1/generate
    answer (vLLM's GenerateTokensResponse), in order, once the answer is known to have conditioned
    on `prompt_ids` and to hold what was asked; else EngineError naming `where`."""
    if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list):
        raise EngineError(f"{where}: the answer has no list of choices (not vLLM's /inference/v1/generate)")
    got = answer.get("prompt_token_ids")
    if not isinstance(got, list):
        raise EngineError(f"{where}: the answer has no prompt_token_ids (return_token_ids was sent): the server is not "
                          "vLLM 0.32 or later")
    if got != prompt_ids:
        differs = next((i for i, (a, b) in enumerate(zip(got, prompt_ids)) if a != b), min(len(got), len(prompt_ids)))
        raise EngineError(f"{where}: vLLM conditioned on a prompt of {len(got)} tokens, the row's has {len(prompt_ids)} "
                          f"(first difference at token {differs}): "
                          "its image processor cuts the images into other patch grids than the trainer's; serve the "
                          "run's weights folder with its preprocessor_config.json and no --mm-processor-kwargs")
    choices = answer["choices"]
    indices = sorted(c.get("index", -1) if isinstance(c, dict) else -1 for c in choices)
    if indices != list(range(n)):
        raise EngineError(f"{where}: the answer holds choices {indices[:8]} for n={n} samples")
    out = []
    for choice in sorted(choices, key=lambda c: c["index"]):
        ids, content = choice.get("token_ids"), (choice.get("logprobs") or {}).get("content")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise EngineError(f"{where}: choice {choice['index']} has no list of token ids")
        if len(ids) > max_tokens:
            raise EngineError(f"{where}: choice {choice['index']} holds {len(ids)} tokens, over the {max_tokens} asked for")
        if not isinstance(content, list) or len(content) != len(ids):
            raise EngineError(f"{where}: choice {choice['index']} has {len(content) if isinstance(content, list) else 0} "
                              f"log-probs for {len(ids)} tokens (logprobs: 0 was sent)")
        if [e.get("token_id") if isinstance(e, dict) else None for e in content] != ids:
            raise EngineError(f"{where}: choice {choice['index']}: the log-probs' token ids are not its token ids")
        lps = [e.get("logprob") for e in content]
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > NO_LOGPROB for x in lps):
            raise EngineError(f"{where}: choice {choice['index']}: a sampled token has no finite log-prob (vLLM answers "
                              f"{NO_LOGPROB} for one it did not compute)")
        reason = choice.get("finish_reason")
        if reason not in ("stop", "length"):
            raise EngineError(f"{where}: choice {choice['index']} ended with finish_reason {reason!r} (not stop/length): "
                              "the server aborted it")
        out.append((ids, [float(x) for x in lps], reason))
    return out


class VLLMVisionWire(VLLMWire):
    """VLLMWire for prompts with images: the family's prompt encoder (no weights) writes the
    prompts, each request carries its prompt's images, each row the images and their grids."""

    def __init__(self, recipe: Any, tokenizer_dir: Path):
        self.recipe = recipe
        self.images = get_family(recipe.model.kind).prompt_encoder(Path(tokenizer_dir), recipe.model.chat_template)
        self.tokenizer, self.use_chat = self.images.tokenizer, self.images.use_chat
        self._shown: dict[str, Shown] | None = None

    @contextmanager
    def showing(self, requests: Any, where: str) -> Iterator[None]:
        """Each group's images, from the request shard `requests` (its file: `where`), for the
        rollouts sampled inside."""
        if "images" not in requests.schema.names or "image_grids" not in requests.schema.names:
            raise EngineError(f"{where}: the requests carry no images; model.kind {self.recipe.model.kind!r} shows every "
                              "prompt its images (write the requests with this recipe)")
        self._shown = {gid: (list(pngs), [(int(t), int(h), int(w)) for t, h, w in grids]) for gid, pngs, grids in zip(
            requests.column("group_id").to_pylist(), requests.column("images").to_pylist(),
            requests.column("image_grids").to_pylist())}
        try:
            yield
        finally:
            self._shown = None

    def shown(self, gid: str, sid: str) -> Shown:
        if self._shown is None or gid not in self._shown:
            raise EngineError(f"sample {sid!r}: no images were shown for its group {gid!r} (VLLM.generate shows the "
                              "request shard's)")
        return self._shown[gid]

    def prompt_ids(self, samples: list[tuple[str, str, str, Any]], token_prompts: dict[str, list[int]] | None) -> list[list[int]]:
        """Each sample's prompt ids with its images' placeholders expanded (ImagePrompts.encode), or
        the request's token ids where it gives them (an agent's later turn)."""
        given, encoded = token_prompts or {}, {}
        for sid, gid, prompt, _ in samples:
            if gid not in given and gid not in encoded:
                encoded[gid] = self.images.encode(prompt, self.shown(gid, sid)[1])
        return [list(given[gid]) if gid in given else list(encoded[gid]) for _, gid, _, _ in samples]

    def bodies(self, samples: list[tuple[str, str, str, Any]], prompt_ids: list[list[int]], params: list[dict[str, Any]], *,
               greedy: bool, group_seed: Any, model: str, where: str) -> tuple[list[dict[str, Any]], list[list[int]]]:
        """The /inference/v1/generate bodies of `samples` and, for each, the positions its choices
        fill: requests as VLLMWire's (a group's samples in one, `n` of them) but one prompt each,
        greedy ones too."""
        if greedy:
            requests = [([ids], {**p, "n": 1}) for ids, p in zip(prompt_ids, params)]
            order = [[position] for position in range(len(samples))]
        else:
            requests, order = batched_requests(samples, prompt_ids, params, greedy=False, group_seed=group_seed)
        bias = {str(t): BANNED_BIAS for t in self.images.banned}
        cap = Limits.max_request_bytes
        bodies = []
        for (prompts, p), positions in zip(requests, order):
            sid, gid = samples[positions[0]][:2]
            at = f"{where}, sample {sid!r}"
            pngs, grids = self.shown(gid, sid)
            urls = [data_url(png) for png in pngs]
            size = sum(len(u) for u in urls) + 8 * len(prompts[0]) + 1024
            if size > cap:
                raise EngineError(f"{at}: its request would carry about {size} bytes (its {len(pngs)} image(s) as "
                                  f"base64), over the {cap} bytes a request may (stages/engines/limits.py "
                                  "max_request_bytes); store smaller images with the prompts")
            bodies.append({
                "model": model, "token_ids": collapsed(prompts[0], self.images.image_token_id, [self.images.tokens(g) for g in grids], at),
                "content_parts": [{"type": "image_url", "url": url} for url in urls],
                "sampling_params": {**p, "logprobs": 0, "logit_bias": bias}, "return_token_ids": True,
            })
        return bodies, order

    def rollout(self, client: Any, samples: list[tuple[str, str, str, Any]], *, iteration: int, seed_tag: str,
                greedy: bool, lora: str | None, transitions: bool, token_prompts: dict[str, list[int]] | None = None,
                continuations: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """One row per (sample id, group id, prompt, metadata) as VLLMWire's, with its prompt's
        images (PNG bytes) and patch grids, as trainside rows carry them for the trainer's replay."""
        where = f"{client.name} at {client.url}"
        if continuations:
            raise EngineError(f"{where}: partial rollouts of prompts with images are not sampled through vLLM; sample "
                              f"model.kind {self.recipe.model.kind!r} without rollout.partial")
        eos = self.tokenizer.eos_token_id
        prompt_ids = self.prompt_ids(samples, token_prompts)
        params = self.sampling(samples, iteration=iteration, seed_tag=seed_tag, greedy=greedy, length="max_tokens", seed="seed")
        bodies, order = self.bodies(samples, prompt_ids, params, greedy=greedy, model=lora or client.model, where=where,
                                    group_seed=lambda gid: self.group_seed(iteration, seed_tag, gid))
        answers, version = unchanged_version(client, iteration, lambda: client.generate_tokens(bodies))
        rows: list[dict[str, Any]] = [{}] * len(samples)
        for body, positions, answer in zip(bodies, order, answers):
            first = positions[0]
            outs = choices_of(answer, prompt_ids[first], len(positions), int(body["sampling_params"]["max_tokens"]),
                              f"{where}, sample {samples[first][0]!r}")
            for position, (resp, lps, reason) in zip(positions, outs):
                sid, gid, prompt, meta = samples[position]
                pngs, grids = self.shown(gid, sid)
                text = resp[:-1] if reason == "stop" and resp and resp[-1] == eos else resp
                rows[position] = {
                    "sample_id": sid, "group_id": gid, "metadata": meta, "prompt": prompt, "prompt_ids": prompt_ids[position],
                    "response_ids": resp, "response_logprobs": lps, "finish_reason": reason,
                    "text": self.tokenizer.decode(text, skip_special_tokens=True), "policy_version": version,
                    "images": pngs, "image_grids": [list(g) for g in grids],
                }
        return rows
