"""Text generation of the engine server: requests (prompt token ids, sampling params, an optional
LoRA adapter) from every concurrent /generate call queue up, and a batcher thread samples
compatible ones together with the text policy's own sampler (stages/policies/text_sampling.py),
so the behaviour log-probs are the quantity the trainer replays: log softmax(logits / T) at the
sampled token, fp32. Each request draws from its own generator (`sampling_seed`), so a response
does not depend on the batch it was sampled in. Every prompt is checked (token ids, the model's
context, the server's limits: stages/engines/limits.py) before it joins the queue, so a bad
one is refused alone and never fails the batch it would have been sampled in.
"""
from __future__ import annotations

import math
import queue
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from unirl.stages.engine_server.core import EngineCore, EngineRequestError
from unirl.stages.engines.limits import SEED_BOUND, Limits, integer, number, over, over_context, shown, text_field
from unirl.stages.policies.text_sampling import sample
from unirl.stages.runtime.faults import fault_point

SAMPLING_PARAMS = ("temperature", "top_p", "max_new_tokens", "stop_token_ids", "sampling_seed")


@dataclass
class TextRequest:
    input_ids: list[int]
    temperature: float
    top_p: float
    max_new_tokens: int
    eos_id: int
    seed: int
    lora: str | None
    rid: str
    prompt_logprobs: bool = False  # logprob_start_len 0: the answer carries input_token_logprobs
    future: Future = field(default_factory=Future)

    @property
    def key(self) -> tuple[Any, ...]:
        """Requests with the same key are sampled in one batch (each to its own max_new_tokens)."""
        return (self.temperature, self.top_p, self.eos_id, self.lora)


def context_of(module: Any) -> int | None:
    """The longest sequence the served model takes: its config's max_position_embeddings (a VLM's
    in its text config; max_text_len where a family names it so); None when the config does not say."""
    config = getattr(module, "config", None)
    for part in (config, getattr(config, "text_config", None)):
        for name in ("max_position_embeddings", "max_text_len"):
            found = getattr(part, name, None)
            if isinstance(found, int):
                return found
    return None


class TextBackend:
    """The queue and the batcher thread. `max_batch`: requests sampled together at most;
    `wait_s`: how long the first request of a batch waits for others to join."""

    route = "/generate"

    @classmethod
    def serve(cls, core: EngineCore, *, max_batch: int, wait_s: float, limits: Limits) -> TextBackend:
        return cls(core, max_batch=max_batch, wait_s=wait_s, limits=limits)

    def __init__(self, core: EngineCore, *, max_batch: int, wait_s: float, limits: Limits):
        self.core, self.max_batch, self.wait_s, self.limits = core, max_batch, wait_s, limits
        module = core.base_module()
        self.vocab = module.get_input_embeddings().num_embeddings
        self.context = context_of(module)
        self.eos_id = core.policy.tokenizer.eos_token_id
        self.queue: queue.Queue[TextRequest] = queue.Queue()
        self.batches = 0
        threading.Thread(target=self._loop, name="engine-batcher", daemon=True).start()

    def parse(self, body: dict[str, Any]) -> list[TextRequest]:
        """GenerateReqInput (the subset served: `input_ids`, one or a list; `sampling_params`, one
        dict or one per prompt; `lora_path`; `rid`) -> one checked TextRequest per prompt."""
        ids = body.get("input_ids")
        if body.get("text") is not None or ids is None:
            raise EngineRequestError("the engine server takes token ids: send `input_ids` (the client tokenizes)")
        if not isinstance(ids, list) or not ids:
            raise EngineRequestError("input_ids: a list of token ids, or a list of such lists, is required")
        if not isinstance(ids[0], list):
            ids = [ids]
        if len(ids) > self.limits.max_prompts:
            raise over("input_ids: prompts in one request", len(ids), "max_prompts", self.limits.max_prompts, 413)
        params = body.get("sampling_params") or {}
        params = params if isinstance(params, list) else [params] * len(ids)
        loras = body.get("lora_path")
        loras = loras if isinstance(loras, list) else [loras] * len(ids)
        start = body.get("logprob_start_len", -1)
        if start not in (-1, 0) or type(start) is not int:
            raise EngineRequestError(f"logprob_start_len: {shown(start)}: the engine server answers input log-probs from "
                                     "position 0 (0) or none (-1)")
        rids = body.get("rid")
        if not isinstance(rids, list):
            base = text_field(rids, "rid") if rids else uuid.uuid4().hex
            rids = [f"{base}-{i}" for i in range(len(ids))]
        if not len(ids) == len(params) == len(loras) == len(rids):
            raise EngineRequestError(f"{len(ids)} prompts, {len(params)} sampling_params, {len(loras)} lora_path, {len(rids)} rid")
        requests = [self._request(prompt, p, lora, rid) for prompt, p, lora, rid in zip(ids, params, loras, rids)]
        for r in requests:
            r.prompt_logprobs = start == 0
        return requests

    def _request(self, prompt: Any, p: Any, lora: Any, rid: Any) -> TextRequest:
        """One prompt checked: everything that could fail its batch is refused here."""
        where = f"request {shown(text_field(rid, 'rid'))}"
        if not isinstance(p, dict):
            raise EngineRequestError(f"{where}: sampling_params must be an object")
        unknown = sorted(set(p) - set(SAMPLING_PARAMS))
        if unknown:
            raise EngineRequestError(f"sampling_params {unknown[:5]} are not served by the engine server "
                                     f"(served: {', '.join(SAMPLING_PARAMS)})")
        if not isinstance(prompt, list) or not prompt:
            raise EngineRequestError(f"{where}: input_ids must be a non-empty list of token ids")
        if not all(type(t) is int for t in prompt) or min(prompt) < 0 or max(prompt) >= self.vocab:
            raise EngineRequestError(f"{where}: input_ids must be token ids in [0, {self.vocab}) (the served model's vocabulary)")
        if self.context is not None and len(prompt) > self.context:
            raise over_context(f"{where}: a prompt of {len(prompt)} tokens", self.context, 413)
        new = integer(p.get("max_new_tokens", 128), f"{where}: sampling_params.max_new_tokens", 1, 1 << 62)
        if new > self.limits.max_new_tokens:
            raise over(f"{where}: sampling_params.max_new_tokens", new, "max_new_tokens", self.limits.max_new_tokens)
        if self.context is not None and len(prompt) + new > self.context:
            raise over_context(f"{where}: {len(prompt)} prompt tokens + max_new_tokens {new}", self.context, 400)
        stops = p.get("stop_token_ids") or [self.eos_id]
        if not isinstance(stops, list) or len(stops) != 1:
            raise EngineRequestError(f"{where}: stop_token_ids {shown(stops)}: the engine server stops on one token")
        top_p = number(p.get("top_p", 1.0), f"{where}: sampling_params.top_p", 0.0, 1.0)
        if top_p == 0.0:
            raise EngineRequestError(f"{where}: sampling_params.top_p must be above 0")
        if lora is not None and text_field(lora, f"{where}: lora_path") not in self.core.adapters:
            raise EngineRequestError(f"lora_path {shown(lora)} is not a loaded adapter (loaded: {sorted(self.core.adapters)})")
        seed = p.get("sampling_seed")
        return TextRequest(list(prompt), number(p.get("temperature", 1.0), f"{where}: sampling_params.temperature", 0.0, math.inf),
                           top_p, new, integer(stops[0], f"{where}: stop_token_ids", 0, self.vocab),
                           uuid.uuid4().int % SEED_BOUND if seed is None else integer(seed, f"{where}: sampling_seed", 0, SEED_BOUND),
                           lora, rid)

    def submit(self, requests: list[TextRequest]) -> list[dict[str, Any]]:
        for r in requests:
            self.queue.put(r)
        return [r.future.result() for r in requests]

    def abort_queued(self) -> int:
        """Answer every queued request with finish_reason abort (pause_generation mode abort)."""
        n = 0
        while True:
            try:
                r = self.queue.get_nowait()
            except queue.Empty:
                return n
            r.future.set_result(self._response(r, [], [], {"type": "abort", "message": "generation paused"}, self.core.version))
            n += 1

    def _loop(self) -> None:
        held: list[TextRequest] = []
        while True:
            first = held.pop(0) if held else self.queue.get()
            deadline = time.monotonic() + self.wait_s
            batch = [first]
            while len(batch) < self.max_batch:
                try:
                    nxt = self.queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                (batch if nxt.key == first.key else held).append(nxt)
            self.core.wait_running()
            try:
                self._run(batch)
            except Exception as exc:  # noqa: BLE001 - every waiting request gets the error
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(exc)

    def _run(self, batch: list[TextRequest]) -> None:
        fault_point("engine-generate", owner=False)  # the engine killed mid-generate (benchmarks/faults.py)
        core = self.core
        with core.lock:
            first = batch[0]
            policy = core.policy
            greedy = first.temperature == 0.0
            with core.adapter_scope(first.lora):
                caps = [r.max_new_tokens for r in batch]
                out = sample(core.module, [r.input_ids for r in batch], [r.seed for r in batch], caps=caps,
                             max_new_tokens=max(caps), temperature=1.0 if greedy else first.temperature,
                             top_p=first.top_p, eos_id=first.eos_id, pad_id=policy.tokenizer.pad_token_id,
                             device=core.device, greedy=greedy, prompt_logprobs=[r.prompt_logprobs for r in batch])
                inputs = {id(r): lps for r, lps in zip(batch, out.prompt_logprobs or []) if lps is not None}
            version = core.version
            self.batches += 1
        for r, resp, lps, reason in zip(batch, out.response_ids, out.logprobs, out.finish_reasons):
            finish = {"type": "stop", "matched": r.eos_id} if reason == "stop" else {"type": "length", "length": len(resp)}
            r.future.set_result(self._response(r, resp, lps, finish, version, inputs.get(id(r))))

    def _response(self, r: TextRequest, resp: list[int], lps: list[float], finish: dict[str, Any], version: str,
                  inputs: list[float] | None = None) -> dict[str, Any]:
        """SGLang's /generate answer for one prompt (keys of its tokenizer manager's out_dict)."""
        tokenizer = self.core.policy.tokenizer if self.core.policy is not None else None
        body = resp[:-1] if finish.get("type") == "stop" else resp
        meta: dict[str, Any] = {}
        if inputs is not None:  # SGLang's form: (log-prob, token id, text), None for the first token
            meta["input_token_logprobs"] = [[lp, tok, None] for lp, tok in zip([None, *inputs], r.input_ids)]
        return {
            "text": tokenizer.decode(body, skip_special_tokens=True) if tokenizer is not None else "",
            "output_ids": list(resp),
            "meta_info": {
                "id": r.rid, "finish_reason": finish, "prompt_tokens": len(r.input_ids), "completion_tokens": len(resp),
                "weight_version": version, "output_token_logprobs": [[lp, tok, None] for lp, tok in zip(lps, resp)],
                **meta,
            },
        }
