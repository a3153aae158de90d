"""Text generation of the engine server: requests (prompt token ids, sampling params, an optional
LoRA adapter) from every concurrent /generate call queue up, and a batcher thread samples
compatible ones together with the text policy's own sampler (stages/policies/text_sampling.py),
so the behaviour log-probs are the quantity the trainer replays: log softmax(logits / T) at the
sampled token, fp32. Each request draws from its own generator (`sampling_seed`), so a response
does not depend on the batch it was sampled in.
"""
from __future__ import annotations

import queue
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from unirl.stages.engine_server.core import EngineCore, EngineRequestError


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
    future: Future = field(default_factory=Future)

    @property
    def key(self) -> tuple[Any, ...]:
        """Requests with the same key are sampled in one batch."""
        return (self.temperature, self.top_p, self.max_new_tokens, self.eos_id, self.lora)


def parse_requests(body: dict[str, Any], eos_id: int) -> list[TextRequest]:
    """GenerateReqInput (the subset served: `input_ids`, one or a list; `sampling_params`, one
    dict or one per prompt; `lora_path`; `rid`) -> one TextRequest per prompt."""
    ids = body.get("input_ids")
    if body.get("text") is not None or ids is None:
        raise EngineRequestError("the engine server takes token ids: send `input_ids` (the client tokenizes)")
    if ids and isinstance(ids[0], int):
        ids = [ids]
    params = body.get("sampling_params") or {}
    params = params if isinstance(params, list) else [params] * len(ids)
    loras = body.get("lora_path")
    loras = loras if isinstance(loras, list) else [loras] * len(ids)
    rids = body.get("rid")
    rids = rids if isinstance(rids, list) else [f"{rids or uuid.uuid4().hex}-{i}" for i in range(len(ids))]
    if not len(ids) == len(params) == len(loras) == len(rids):
        raise EngineRequestError(f"{len(ids)} prompts, {len(params)} sampling_params, {len(loras)} lora_path, {len(rids)} rid")
    out = []
    for prompt, p, lora, rid in zip(ids, params, loras, rids):
        unknown = sorted(set(p) - {"temperature", "top_p", "max_new_tokens", "stop_token_ids", "sampling_seed"})
        if unknown:
            raise EngineRequestError(f"sampling_params {unknown} are not served by the engine server "
                                     "(served: temperature, top_p, max_new_tokens, stop_token_ids, sampling_seed)")
        stops = list(p.get("stop_token_ids") or [eos_id])
        if len(stops) != 1:
            raise EngineRequestError(f"stop_token_ids {stops}: the engine server stops on one token")
        if not prompt:
            raise EngineRequestError(f"request {rid}: empty input_ids")
        seed = p.get("sampling_seed")
        out.append(TextRequest(list(prompt), float(p.get("temperature", 1.0)), float(p.get("top_p", 1.0)),
                               int(p.get("max_new_tokens", 128)), int(stops[0]),
                               int(seed) if seed is not None else uuid.uuid4().int % (2**63), lora, rid))
    return out


class TextBackend:
    """The queue and the batcher thread. `max_batch`: requests sampled together at most;
    `wait_s`: how long the first request of a batch waits for others to join."""

    route = "/generate"

    @classmethod
    def serve(cls, core: EngineCore, *, max_batch: int, wait_s: float) -> TextBackend:
        return cls(core, max_batch=max_batch, wait_s=wait_s)

    def __init__(self, core: EngineCore, *, max_batch: int, wait_s: float):
        self.core, self.max_batch, self.wait_s = core, max_batch, wait_s
        self.queue: queue.Queue[TextRequest] = queue.Queue()
        self.batches = 0
        threading.Thread(target=self._loop, name="engine-batcher", daemon=True).start()

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
        from unirl.stages.policies.text_sampling import sample
        from unirl.stages.runtime.faults import fault_point

        fault_point("engine-generate", owner=False)  # the engine killed mid-generate (benchmarks/faults.py)
        core = self.core
        with core.lock:
            first = batch[0]
            policy = core.policy
            greedy = first.temperature == 0.0
            with core.adapter_scope(first.lora):
                out = sample(core.module, [r.input_ids for r in batch], [r.seed for r in batch],
                             max_new_tokens=first.max_new_tokens, temperature=1.0 if greedy else first.temperature,
                             top_p=first.top_p, eos_id=first.eos_id, pad_id=policy.tokenizer.pad_token_id,
                             device=core.device, greedy=greedy)
            version = core.version
            self.batches += 1
        for r, resp, lps, reason in zip(batch, out.response_ids, out.logprobs, out.finish_reasons):
            finish = {"type": "stop", "matched": r.eos_id} if reason == "stop" else {"type": "length", "length": len(resp)}
            r.future.set_result(self._response(r, resp, lps, finish, version))

    def _response(self, r: TextRequest, resp: list[int], lps: list[float], finish: dict[str, Any], version: str) -> dict[str, Any]:
        """SGLang's /generate answer for one prompt (keys of its tokenizer manager's out_dict)."""
        tokenizer = self.core.policy.tokenizer if self.core.policy is not None else None
        body = resp[:-1] if finish.get("type") == "stop" else resp
        return {
            "text": tokenizer.decode(body, skip_special_tokens=True) if tokenizer is not None else "",
            "output_ids": list(resp),
            "meta_info": {
                "id": r.rid, "finish_reason": finish, "prompt_tokens": len(r.input_ids), "completion_tokens": len(resp),
                "weight_version": version, "output_token_logprobs": [[lp, tok, None] for lp, tok in zip(lps, resp)],
            },
        }
