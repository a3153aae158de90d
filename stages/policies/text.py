"""The autoregressive text policy: prompts -> token ids (through the chat template when the
tokenizer has one), sampled responses with fp32 log-probs recorded at sampling time
(stages/policies/text_sampling.py), and the trainer's replay of a response: log softmax of a
full forward at the response tokens.

Behaviour policy. Sampling decodes incrementally with a KV cache over left-padded prompts; the
replay is one full forward over right-padded sequences. In fp32 the two differ by rounding only
(docs/extending.md, "The behaviour check"): the default tolerance is 1e-4 (bf16 parameters: 0.1),
a token up to 1e-2 off (bf16: 1.0) is masked out of the loss, and beyond that, or on many
samples, sampling and training did not see the same weights, tokens or positions: the update
fails naming the sample.

Prompts with images (a family that `takes_images`: the Qwen-VL families). The family's
`image_prompts` turns a prompt's text and stored images into token ids (image placeholders
expanded) and a batch into the model's extra inputs (pixel values, patch grids) and its M-RoPE
positions (3, B, T); sampling passes them to the prefill, the replay to its full forward, both
decoded from the shard's PNG bytes (stages/runtime/images.py). Text-only families take neither.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import pyarrow as pa
from pydantic import Field

from unirl.stages.policies import Policy, RolloutBase, samples_table
from unirl.stages.policies.text_sampling import log_probs, sample
from unirl.stages.runtime.config_base import Section
from unirl.stages.runtime.registry import families, policies
from unirl.stages.runtime.seeds import derive_seed
from unirl.stages.runtime.tokenizer import encode_prompt
from unirl.stages.tools.calls import ToolFormat

if TYPE_CHECKING:
    import torch


class PartialRollouts(Section):
    """Partial rollouts (async runs, stages/engines/partial.py): a generation longer than a segment is
    cut and continued, from its prefix, in the producer's next batch by the newer weights."""

    segment_tokens: int = Field(..., ge=1, le=1 << 20, description="New tokens a sample gets per batch; a longer one is "
                                "cut there and goes on in the next batch (below rollout.max_new_tokens).")


class TextRollout(RolloutBase):
    """How text samples are generated."""

    kind: Literal["text"] = Field("text", description="Policy kind (set from the model family).")
    max_new_tokens: int = Field(8, ge=1, description="Generation length cap; longer answers finish as `length`.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (also used for training log-probs).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    partial: PartialRollouts | None = Field(
        None, description="rollout.mode async: cut generations at partial.segment_tokens and finish them in the next "
        "batch under the newer weights (each token records its version; a sample's oldest token at most max_staleness versions before its training, "
        "which must be >= 2); empty: every batch waits for its longest generation.")


def check_partial(recipe: Any) -> None:
    """rollout.partial's rules: an async run on a dedicated engine whose staleness bound lets a cut
    sample be trained one batch later."""
    r = recipe.rollout
    partial = getattr(r, "partial", None)
    if partial is None:
        return
    if r.mode != "async":
        raise ValueError("rollout.partial: partial rollouts are cut by the producer of an async run and finished in its next "
                         "batch; set rollout.mode: async (on a dedicated engine) or drop rollout.partial")
    if r.max_staleness < 2:
        raise ValueError(f"rollout.partial: a cut sample is finished one batch later and trained two updates after its first "
                         f"token, past max_staleness {r.max_staleness}; set rollout.max_staleness >= 2 (it bounds how many "
                         "batches a sample spans)")
    if partial.segment_tokens >= r.max_new_tokens:
        raise ValueError(f"rollout.partial.segment_tokens: {partial.segment_tokens} cuts nothing of rollout.max_new_tokens "
                         f"{r.max_new_tokens}; lower it or drop rollout.partial")
    if r.engine.sync.every != 1:
        raise ValueError(f"rollout.engine.sync.every: {r.engine.sync.every}; partial rollouts continue a cut sample with the "
                         "next update's weights, so the engine loads every one: set sync.every 1")
    if r.dynamic_sampling is not None:
        raise ValueError("rollout.dynamic_sampling: refill rounds and partial rollouts both decide which groups a batch "
                         "holds; use one of them")
    if getattr(recipe, "agent", None) is not None:
        raise ValueError("rollout.partial: an agent's trajectories are sampled turn by turn and not cut; drop rollout.partial")
    if families.get(recipe.model.kind).takes_images:
        raise ValueError(f"rollout.partial: model.kind {recipe.model.kind!r} shows its prompts' images, which a continued "
                         "sample's request does not carry yet; drop rollout.partial")


def token_batch(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded prompt+response ids and a mask over response positions of the labels
    (logits at position t predict token t+1). Shapes: ids/attn (B, T), mask (B, T-1)."""
    import torch  # start-up time: loaded on first use, not when a recipe is read

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


def token_logp(model: torch.nn.Module, batch: dict[str, torch.Tensor], temperature: float,
               inputs: dict[str, torch.Tensor] | None = None, banned: torch.Tensor | None = None,
               chunk: int | None = None, packed: bool = False) -> torch.Tensor:
    """log softmax(logits / temperature) at the next token, fp32. Returns (B, T-1). `inputs`: the
    model's other inputs for these rows (a VLM's pixel values, grids and M-RoPE positions);
    `banned`: token ids the sampler never draws, at probability 0 as there (text_sampling.log_probs).
    `chunk` (`train.logprob_chunk_tokens`): only on `batch["mask"]`'s positions (0 elsewhere), from
    the last hidden states, the output head applied `chunk` tokens at a time (`chunked_logp`): no
    (rows, tokens, vocabulary) tensor is ever whole. `packed` (`train.packing`, text rows): one
    forward over the rows without their padding (`packed_logp`), chunked too when `chunk` is set."""
    if packed:
        return packed_logp(model, batch, temperature, banned, chunk)
    if chunk:
        return chunked_logp(model, batch, temperature, inputs, banned, chunk)
    logits = model(input_ids=batch["ids"], attention_mask=batch["attn"], use_cache=False, **(inputs or {})).logits[:, :-1]
    logp = log_probs(logits, temperature, banned)
    return logp.gather(-1, batch["ids"][:, 1:].unsqueeze(-1)).squeeze(-1)


def packed_logp(model: torch.nn.Module, batch: dict[str, torch.Tensor], temperature: float, banned: torch.Tensor | None,
                chunk: int | None) -> torch.Tensor:
    """`token_logp` of right-padded rows through one forward without padding (`train.packing`): the
    rows' tokens concatenated into one sequence whose positions restart at 0 for each row and no
    attention mask, from which transformers keeps attention inside each row (a block-diagonal
    causal mask; flash-attention's varlen kernel on GPU). The log-probs come back in the padded
    layout, on the mask's positions (0 elsewhere): what the losses read is unchanged."""
    import torch  # start-up time: loaded on first use, not when a recipe is read

    lengths = batch["attn"].sum(-1).tolist()
    device = batch["ids"].device
    ids = torch.cat([batch["ids"][i, :n] for i, n in enumerate(lengths)])[None]
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
    on = batch["mask"] > 0
    rows, cols = on.nonzero(as_tuple=True)
    offsets = torch.tensor([0, *lengths[:-1]], device=device).cumsum(0)
    at = offsets[rows] + cols  # where each padded mask position is in the packed sequence
    targets = ids[0, at + 1]
    if not chunk:
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0, at]
        out = torch.zeros(on.shape, dtype=torch.float32, device=device)
        return out.index_put((rows, cols), log_probs(logits, temperature, banned).gather(-1, targets.unsqueeze(-1)).squeeze(-1))
    with hidden_states_out(model) as head:
        hidden = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
    return scored_logp(on, hidden, hidden[at], targets, head, temperature, banned, chunk)


def scored_logp(on: torch.Tensor, hidden: torch.Tensor, states: torch.Tensor, targets: torch.Tensor, head: torch.nn.Module,
                temperature: float, banned: torch.Tensor | None, chunk: int) -> torch.Tensor:
    """The log-probs of `targets` from `states` (`head_logp`) in the padded layout of mask `on`
    (B, T-1), 0 off it; with nothing to score, zeros still on a graph through `hidden`, as the
    whole path's are."""
    import torch  # start-up time: loaded on first use, not when a recipe is read

    out = torch.zeros(on.shape, dtype=torch.float32, device=hidden.device)
    if len(targets) == 0:
        return out + hidden.sum() * 0.0
    return out.index_put((*on.nonzero(as_tuple=True),), head_logp(head, states, targets, temperature, banned, chunk))


def head_logp(head: torch.nn.Module, states: torch.Tensor, targets: torch.Tensor, temperature: float,
              banned: torch.Tensor | None, chunk: int) -> torch.Tensor:
    """fp32 log-probs of `targets` (N,) under `head` applied to `states` (N, H), `chunk` rows at a
    time, each chunk's logits dropped after its log-probs and made again in the backward (a
    non-reentrant checkpoint per chunk): at most one chunk's (chunk, vocabulary) logits live at once."""
    import torch  # start-up time: loaded on first use, not when a recipe is read
    from torch.utils.checkpoint import checkpoint  # start-up time: loaded on first use

    def part(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return log_probs(head(h), temperature, banned).gather(-1, t.unsqueeze(-1)).squeeze(-1)

    return torch.cat([checkpoint(part, states[i:i + chunk], targets[i:i + chunk], use_reentrant=False)
                      for i in range(0, len(targets), chunk)])


@contextmanager
def hidden_states_out(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Inside the block the model's forward gives its last hidden states where it gave logits:
    its output head (`get_output_embeddings`, a Linear) passes its input through. The forward
    still runs as the whole model's (FSDP2's root hooks gather the root's parameters, the head's
    among them, and keep them for the backward), so the head applied after it is the model's own.
    Yields the head."""
    import torch  # start-up time: loaded on first use, not when a recipe is read

    find: Any = getattr(model, "get_output_embeddings", None)
    head = find() if callable(find) else None
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"train.logprob_chunk_tokens: {type(model).__name__} has no linear output head "
                         "(get_output_embeddings) to apply chunk by chunk; leave it empty for this model")
    passthrough: Any = head
    passthrough.forward = lambda x: x  # an instance attribute over the class's forward, removed below
    try:
        yield head
    finally:
        del passthrough.forward


def chunked_logp(model: torch.nn.Module, batch: dict[str, torch.Tensor], temperature: float,
                 inputs: dict[str, torch.Tensor] | None, banned: torch.Tensor | None, chunk: int) -> torch.Tensor:
    """`token_logp` on the mask's positions, `chunk` tokens at a time (`scored_logp`) from the
    padded forward's last hidden states."""
    with hidden_states_out(model) as head:
        hidden = model(input_ids=batch["ids"], attention_mask=batch["attn"], use_cache=False, **(inputs or {})).logits[:, :-1]
    on = batch["mask"] > 0
    return scored_logp(on, hidden, hidden[on], batch["ids"][:, 1:][on], head, temperature, banned, chunk)


def pad_like(lists: list[list[float]], mask: torch.Tensor) -> torch.Tensor:
    """Per-sample values over the response positions of `mask` (B, T-1), zeros elsewhere."""
    import torch  # start-up time: loaded on first use, not when a recipe is read

    out = torch.zeros_like(mask)
    for i, vals in enumerate(lists):
        idx = torch.nonzero(mask[i]).squeeze(-1)
        out[i, idx] = torch.tensor(vals[: len(idx)], dtype=torch.float32, device=mask.device)
    return out


def token_prompts(requests: pa.Table) -> dict[str, list[int]]:
    """group id -> the prompt's token ids, for requests that give them (`prompt_ids`)."""
    if "prompt_ids" not in requests.schema.names:
        return {}
    return {g: ids for g, ids in zip(requests.column("group_id").to_pylist(), requests.column("prompt_ids").to_pylist())
            if ids is not None}


def grids_of(stored: list[list[int]]) -> list[tuple[int, int, int]]:
    return [(int(t), int(h), int(w)) for t, h, w in stored]


@dataclass
class TextBatch:
    """A micro-batch of stored text segments. ids/attn (B, T); mask (B, T-1) over response
    tokens; behaviour (B, T-1): the log-probs recorded at sampling time (0 off the mask);
    advantage (B,), or (B, T-1) per token (on-policy distillation); inputs: the model's other inputs
    (prompts with images), None for text; versions (B, T-1): the
    policy version that sampled each response token (None: the trained one)."""

    sample_ids: list[str]
    ids: torch.Tensor
    attn: torch.Tensor
    mask: torch.Tensor
    behaviour: torch.Tensor
    advantage: torch.Tensor
    inputs: dict[str, torch.Tensor] | None = None
    versions: torch.Tensor | None = None

    def fresh(self, version: int) -> torch.Tensor:
        """(B, T-1) float: 1 at the response tokens policy `version` sampled (every response token
        when versions are not known)."""
        if self.versions is None:
            return self.mask.clone()
        return (self.versions == version).float() * self.mask

    def tokens(self) -> dict[str, torch.Tensor]:
        return {"ids": self.ids, "attn": self.attn, "mask": self.mask}

    @property
    def weight(self) -> float:
        """What the update's metrics are weighted by: response tokens."""
        return float(self.mask.sum())


def context_length(model: Any) -> int | None:
    """The longest sequence a text family's model takes (`max_position_embeddings` of its tiny
    architecture or of `config.json` under `model.path`, a VLM's from its text config); None when
    not known (no config file yet: loading reports that)."""
    if getattr(model, "path", None):
        config = Path(model.path) / "config.json"
        try:
            with config.open("rb") as f:
                data = json.loads(f.read(1 << 20))
        except (OSError, ValueError):
            return None
        data = data if isinstance(data, dict) else {}
        found = data.get("max_position_embeddings") or (data.get("text_config") or {}).get("max_position_embeddings")
        return found if isinstance(found, int) else None
    tiny = getattr(model, "tiny", None)
    return getattr(tiny, "max_position_embeddings", None) or getattr(getattr(tiny, "text", None), "max_position_embeddings", None)


@policies.register("text")
class TextPolicy(Policy):
    kind = "text"
    segment = "text"
    weight_name = "tokens"
    rollout_config = TextRollout
    columns = {
        "prompt_ids": pa.list_(pa.int32()),
        "response_ids": pa.list_(pa.int32()),
        "response_logprobs": pa.list_(pa.float32()),
        "finish_reason": pa.string(),
        "text": pa.string(),
    }
    wire = "unirl.stages.engines.text_wire:TextWire"
    server_backend = "unirl.stages.engine_server.text:TextBackend"

    @classmethod
    def default_tolerance(cls, dtype: str) -> float:
        return 1e-4 if dtype == "float32" else 0.1

    @classmethod
    def default_mask_limit(cls, dtype: str) -> float | None:
        # 100x the tolerance: incremental decoding's rounding reached 1.1e-4 on one token in
        # thousands (docs/extending.md, "The behaviour check"); a misaligned position, mask or
        # temperature moves log-probs by 1e-2 and far more.
        return 1e-2 if dtype == "float32" else 1.0

    @classmethod
    def check(cls, recipe: Any) -> None:
        context = context_length(recipe.model)
        if context is not None and recipe.rollout.max_new_tokens >= context:
            raise ValueError(f"rollout.max_new_tokens: {recipe.rollout.max_new_tokens} does not fit the model's context of "
                             f"{context} tokens (max_position_embeddings), prompt included; ask for fewer")
        family = families.get(recipe.model.kind)
        if recipe.train.packing and (family.takes_images or family.policy != "text"):
            raise ValueError(f"train.packing: model.kind {recipe.model.kind!r} is not packed (a vision-language model's rows "
                             "carry images and M-RoPE positions; a unified model's backbone is not a transformers decoder); "
                             "leave packing off (train.max_tokens_per_micro_batch still cuts by tokens)")
        if recipe.train.logprob_chunk_tokens and family.policy != "text":
            raise ValueError(f"train.logprob_chunk_tokens: model.kind {recipe.model.kind!r}'s backbone has no transformers "
                             "output head to apply chunk by chunk; leave it empty")
        check_partial(recipe)
        overlong = recipe.reward.overlong
        if overlong.truncated == "soft" and overlong.buffer > recipe.rollout.max_new_tokens:
            raise ValueError(
                f"reward.overlong.buffer: {overlong.buffer} is longer than rollout.max_new_tokens "
                f"({recipe.rollout.max_new_tokens}); the soft penalty ramp must fit inside the length cap"
            )

    @classmethod
    def log_preview(cls, recipe: Any, tracker: Any, storage: Any, iteration: int) -> str | None:
        """A table of the iteration's first samples, one per group first: prompt, response, why it
        ended (`stop`, `length`; an agent's reason), reward and its components, advantage, version
        (MLflow `tables/samples/step-N.json`)."""
        def cells(table: pa.Table, i: int) -> dict[str, Any]:
            row = {"response": table.column("text")[i].as_py()}
            if "finish_reason" in table.column_names:
                row["finish_reason"] = table.column("finish_reason")[i].as_py()
            return row

        columns = samples_table(storage, iteration, ["text", "finish_reason"], cells)
        return None if columns is None else tracker.log_table(iteration, columns, "samples")

    @classmethod
    def samples(cls, requests: pa.Table, where: str) -> list[tuple[Any, ...]]:
        """As every policy's, plus each sample's images ((PNG bytes, grids, the requests file) or
        None) and its prompt's token ids where the request gives them (`prompt_ids`, else None)."""
        base = super().samples(requests, where)
        ids = token_prompts(requests)
        if "images" not in requests.schema.names:
            return [(*s, None, ids.get(s[1])) for s in base]
        by_group = {g: (pngs, grids_of(grids), where) for g, pngs, grids in zip(
            requests.column("group_id").to_pylist(), requests.column("images").to_pylist(),
            requests.column("image_grids").to_pylist())}
        return [(*s, by_group[s[1]], ids.get(s[1])) for s in base]

    def __init__(self, family: Any, bundle: Any, recipe: Any, device: torch.device):
        import torch  # start-up time: loaded on first use, not when a recipe is read

        from unirl.stages.runtime.tokenizer import uses_chat_template

        # As the flow policy: Adam's squared averages of tiny gradients turn denormal over a long
        # warm start, and CPU kernels touching denormals run many times slower (a tiny Qwen3's SFT
        # went from 45 to 1.5 steps/s after 300 steps).
        torch.set_flush_denormal(True)
        self.family, self.bundle, self.recipe, self.device = family, bundle, recipe, device
        self.tokenizer = bundle.tokenizer
        self.use_chat = uses_chat_template(self.tokenizer, recipe.model.chat_template)
        self.cfg: TextRollout = recipe.rollout
        self.images = family.image_prompts(bundle, self.use_chat, device) if family.takes_images else None
        self.banned = None if self.images is None else torch.tensor(self.images.banned, dtype=torch.long)
        self.chunk: int | None = recipe.train.logprob_chunk_tokens  # log-probs chunk by chunk (token_logp)
        self.packed = recipe.train.packing  # text rows' forward without padding (token_logp)

    def canary(self, module: Any) -> dict[str, Any] | None:
        """The run's canary tokens and the module's log-probs of them at temperature 1 (fp32)."""
        import torch  # start-up time: loaded on first use, not when a recipe is read

        from unirl.stages.runtime.canary import canary_tokens

        vocab = min(len(self.tokenizer), module.get_input_embeddings().num_embeddings)
        tokens = canary_tokens(vocab, set(self.tokenizer.all_special_ids), context_length(self.recipe.model))
        t = torch.tensor([tokens], device=self.device)
        with torch.no_grad():
            logprobs = token_logp(module, {"ids": t, "attn": torch.ones_like(t)}, 1.0)[0].float().cpu().tolist()
        return {"tokens": tokens, "logprobs": logprobs}

    # -- conditions -----------------------------------------------------------------------------
    def encode(self, prompts: list[str]) -> list[list[int]]:
        """Token ids of each prompt, through the chat template when the recipe/tokenizer uses one."""
        encoded = {p: encode_prompt(self.tokenizer, p, self.use_chat) for p in dict.fromkeys(prompts)}
        return [encoded[p] for p in prompts]

    def _prefill_inputs(self, images: list[list[Any]]) -> Any:
        """What the sampler's prefill adds for rows showing `images` (None: text-only prompts)."""
        if self.images is None:
            return None
        return lambda ids, attn: self.images.inputs(ids, attn, images)

    def _forward_inputs(self, t: dict[str, torch.Tensor], images: list[list[Any]]) -> dict[str, torch.Tensor] | None:
        """A full forward's extra inputs for the rows of `t` showing `images`: pixel values, grids
        and the M-RoPE positions of prompt and response (None: text-only prompts)."""
        if self.images is None:
            return None
        extra, positions = self.images.inputs(t["ids"], t["attn"], images)
        return {**extra, "position_ids": positions}

    # -- sampling -------------------------------------------------------------------------------
    def rollout(self, module: Any, samples: list[tuple[str, str, str, Any, Any, Any]], *, iteration: int, seed_tag: str,
                greedy: bool, stack: Any, transitions: bool) -> list[dict[str, Any]]:
        """One response per (sample id, group id, prompt, metadata, images, token ids) of this rank,
        all in one batch; a prompt's images (PNG bytes and grids) are copied into its rows; a prompt
        given as token ids is sampled from them as they are."""
        c = self.cfg
        seeds = [derive_seed(self.recipe.seed, seed_tag, iteration, s[0]) for s in samples]
        shown: list[list[Any]] = []
        if self.images is None:
            prompt_ids = self.encode([s[2] for s in samples])
        else:
            prompt_ids = [self.images.encode(s[2], s[4][1]) for s in samples]
            shown = [self.images.decode(s[4][0], s[4][1], f"{s[4][2]}: sample {s[0]!r}") for s in samples]
            if not samples:  # this rank still runs the vision tower in every forward of the others
                stand_in, image = self.images.stand_in()
                prompt_ids, shown, seeds = [stand_in], [image], [0]
        if samples:  # token prompts (an agent's next turn) as they are given
            prompt_ids = [p if s[5] is None else list(s[5]) for p, s in zip(prompt_ids, samples)]
        module.eval()
        out = sample(
            module, prompt_ids, seeds, max_new_tokens=c.max_new_tokens, temperature=c.temperature, top_p=c.top_p,
            eos_id=self.tokenizer.eos_token_id, pad_id=self.tokenizer.pad_token_id, device=self.device, greedy=greedy,
            inputs=self._prefill_inputs(shown), banned=self.banned,
        )
        rows = []
        for (sid, gid, prompt, meta, images, _), pids, resp, lps, reason in zip(samples, prompt_ids, out.response_ids,
                                                                                out.logprobs, out.finish_reasons):
            body = resp[:-1] if reason == "stop" else resp
            rows.append({
                "sample_id": sid, "group_id": gid, "metadata": meta, "prompt": prompt, "prompt_ids": pids,
                "response_ids": resp, "response_logprobs": lps, "finish_reason": reason,
                "text": self.tokenizer.decode(body, skip_special_tokens=True),
            })
            if images is not None:
                rows[-1].update(images=images[0], image_grids=[list(g) for g in images[1]])
        return rows

    @staticmethod
    def counters(rows: list[dict[str, Any]]) -> dict[str, int]:
        return {"response_tokens": sum(len(r["response_ids"]) for r in rows)}

    # -- replay ---------------------------------------------------------------------------------
    def batches(self, table: pa.Table, chunks: list[list[int]], advantages: Any, where: str) -> list[TextBatch]:
        """Micro-batches of a rollout table (sorted by sample id): one per chunk of row indices."""
        import torch  # start-up time: loaded on first use, not when a recipe is read

        names = ["sample_id", "prompt_ids", "response_ids", "response_logprobs", "policy_version"]
        masked = "response_mask" in table.schema.names
        if masked:
            names.append("response_mask")
        per_token = "token_versions" in table.schema.names  # partial rollouts: a version per response token
        if per_token:
            names.append("token_versions")
        if self.images is not None:
            names += ["images", "image_grids"]
            if "images" not in table.schema.names:
                raise ValueError(f"{where}: the rollouts carry no 'images' column; model.kind {self.recipe.model.kind!r} "
                                 "replays every sample with the images of its prompt")
        cols = {n: table.column(n).to_pylist() for n in names}
        out = []
        for rows in chunks:
            def take(name: str, rows: list[int] = rows) -> list:
                return [cols[name][r] for r in rows]

            t = token_batch(take("prompt_ids"), take("response_ids"), self.tokenizer.pad_token_id, self.device)
            behaviour = pad_like(take("response_logprobs"), t["mask"])  # over every response position, in order
            if masked:  # tool and template tokens of an agent's trajectory are context, not trained
                own = pad_like([[float(m) for m in (ms or [])] or [1.0] * len(r)
                                for ms, r in zip(take("response_mask"), take("response_ids"))], t["mask"])
                t["mask"], behaviour = t["mask"] * own, behaviour * own
            if rows and isinstance(advantages[rows[0]], list):  # per token (on-policy distillation): (B, T-1)
                adv = pad_like([advantages[r] for r in rows], t["mask"])
            else:
                adv = torch.tensor([float(advantages[r]) for r in rows], dtype=torch.float32, device=self.device)
            shown = [] if self.images is None else [
                self.images.decode(pngs, grids_of(grids), f"{where}: sample {sid!r}")
                for sid, pngs, grids in zip(take("sample_id"), take("images"), take("image_grids"))]
            inputs = self._forward_inputs(t, shown)
            versions = [tv if per_token and tv else [v] * len(r)
                        for tv, v, r in zip(take("token_versions") if per_token else take("policy_version"),
                                            take("policy_version"), take("response_ids"))]
            out.append(TextBatch(take("sample_id"), t["ids"], t["attn"], t["mask"], behaviour, adv, inputs,
                                 pad_like([[float(v) for v in vs] for vs in versions], t["mask"]).long()))
        return out

    def stand_in(self, template: Any) -> TextBatch:
        """A one-sample batch (an eos and a token) for ranks short of micro-batches: its weight is 0."""
        import torch  # start-up time: loaded on first use, not when a recipe is read

        eos = self.tokenizer.eos_token_id
        # With images, a blank one: every rank runs the vision tower (FSDP2 gathers its blocks collectively).
        prompt, shown = ([eos], []) if self.images is None else self.images.stand_in()
        t = token_batch([prompt], [[eos]], self.tokenizer.pad_token_id, self.device)
        return TextBatch(["stand-in"], t["ids"], t["attn"], t["mask"], torch.zeros_like(t["mask"]),
                         torch.zeros(1, device=self.device), self._forward_inputs(t, [shown]))

    def template(self, batch: TextBatch | None, stack: Any) -> Any:
        return None

    def replay(self, module: Any, batch: TextBatch, selection: Any = None) -> torch.Tensor:
        """log pi(response token | prefix) under `module`, fp32: (B, T-1), meaningful on the mask."""
        return token_logp(module, batch.tokens(), self.cfg.temperature, batch.inputs, self.banned, self.chunk, self.packed)

    def teacher_scores(self, teacher: Any, batch: TextBatch) -> list[list[float]]:
        """A teacher's log-probs of each row's response tokens (at the sampling temperature, as the
        student's record), in order: what on-policy distillation compares the student's with."""
        logp = token_logp(teacher, batch.tokens(), self.cfg.temperature, batch.inputs, self.banned, self.chunk, self.packed)
        return [logp[i][batch.mask[i] > 0].float().cpu().tolist() for i in range(len(batch.sample_ids))]

    def decode(self, response_ids: list[int]) -> str:
        return self.tokenizer.decode(response_ids, skip_special_tokens=True)

    def check_batch(self, batch: TextBatch, iteration: int, algorithm: Any, where: str) -> None:
        """Nothing to check before replaying text: the behaviour check compares every token."""

    # -- supervised warm start ------------------------------------------------------------------
    @classmethod
    def sft_spec(cls, recipe: Any) -> tuple[Any, Any]:
        """AdamW at `sft.lr`, constant, no EMA: the optimizer of the warm start."""
        from unirl.stages.train.stack import OptimizerSpec  # start-up time: it loads torch

        return OptimizerSpec(lr=recipe.sft.lr, total=recipe.sft.steps, max_grad_norm=recipe.train.max_grad_norm), None

    def sft_setup(self, table: pa.Table, where: str, stack: Any, seed: int) -> dict[str, Any]:
        """Encode the records (prompt, response) once: responses end in eos."""
        if "response" not in table.schema.names:
            raise ValueError(f"{where}: SFT records for a language model need a 'response' column")
        eos = self.tokenizer.eos_token_id
        self._sft_images: list[list[Any]] = []
        if self.images is None:
            self._sft_prompts = self.encode(table.column("prompt").to_pylist())
        else:
            if "images" not in table.schema.names:
                raise ValueError(f"{where}: SFT records for model.kind {self.recipe.model.kind!r} need the prompts' images")
            grids = [grids_of(g) for g in table.column("image_grids").to_pylist()]
            self._sft_prompts = [self.images.encode(p, g) for p, g in zip(table.column("prompt").to_pylist(), grids)]
            self._sft_images = [self.images.decode(pngs, g, f"{where}: record {i + 1}")
                                for i, (pngs, g) in enumerate(zip(table.column("images").to_pylist(), grids))]
        self._sft_responses = [self.tokenizer(r, add_special_tokens=False).input_ids + [eos] for r in table.column("response").to_pylist()]
        self._sft_masks: list[list[int]] | None = None
        if "turns" in table.schema.names:  # agents' transcripts: only the assistant turns are learned

            fmt = ToolFormat(self.tokenizer, self.use_chat)
            self._sft_masks = [[1] * len(r) for r in self._sft_responses]
            for i, turns in enumerate(table.column("turns").to_pylist()):
                if turns is not None:
                    self._sft_responses[i], self._sft_masks[i] = fmt.transcript(json.loads(turns))
        return {}

    def sft_loss(self, module: Any, step: int, *, seed: int, batch_size: int, stack: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-entropy on the response tokens of step `step`'s records (a seeded permutation per
        epoch, split across ranks), as this rank's share of the batch mean: (loss to backpropagate
        times world, its value summed over ranks)."""
        import numpy as np  # start-up time: numpy loads on first use, not when a recipe is read
        import torch  # start-up time: loaded on first use, not when a recipe is read

        n = len(self._sft_prompts)
        order = np.random.default_rng(derive_seed(seed, "sft-epoch", (step * batch_size) // n)).permutation(n)
        idx = stack.my_share([int(order[(step * batch_size + i) % n]) for i in range(batch_size)])
        batch = token_batch([self._sft_prompts[i] for i in idx], [self._sft_responses[i] for i in idx],
                            self.tokenizer.pad_token_id, self.device)
        inputs = self._forward_inputs(batch, [self._sft_images[i] for i in idx] if self.images is not None else [])
        if self._sft_masks is not None:  # tool turns of a transcript are context
            batch["mask"] = batch["mask"] * pad_like([[float(m) for m in self._sft_masks[i]] for i in idx], batch["mask"])
        logp = token_logp(module, batch, 1.0, inputs, self.banned, self.chunk, self.packed)
        tokens = torch.tensor([float(batch["mask"].sum())], dtype=torch.float64, device=self.device)
        stack.all_reduce(tokens)
        loss = -(logp * batch["mask"]).sum() / float(tokens)
        return loss * stack.world, loss
