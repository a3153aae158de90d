"""What the dedicated engines (`engine_server`, `sglang`, `vllm`) share: their recipe fields, and the
client side of an engine that holds its own copy of the weights.

* generate: the requests of an iteration sampled through the engine's HTTP API (text: /generate,
  flow models: /rollout/generate, stages/engines/text_wire.py / flow_wire.py), one committed
  shard whose rows record the version the engine reports and its behaviour log-probs. A row of
  another version than the one asked for is a loud error.
* sync: full weights or LoRA adapters only (hot-loaded under the name vN, the previous one
  unloaded), every `sync.every` updates, over one of three transports. shm (the default where the
  engine runs on this host): the trainer's rank 0 writes the tensors into a folder in shared memory
  (stages/train/staging.py) and the engine loads it, while the trainer computes the canary; no
  disk, no hashing. disk: the trainer publishes weights/vN (adapters/vN) with its sha256 manifest
  and the checksum of its tensors; the engine loads the folder and reports its version and, the
  engine server, the checksum of what it holds. distributed: a broadcast over an update group.
* layout colocated: the engine releases its memory while the trainer trains, and takes it back
  after the sync.
* every load is verified: the version the engine reports, the checksum of its tensors where it
  reports one, and the canary (stages/runtime/canary.py) against the trainer's log-probs.
"""
from __future__ import annotations

import math
import shutil
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

from pydantic import Field

from unirl.stages.engines import RolloutEngine
from unirl.stages.engines.client import EngineClient, EngineError
from unirl.stages.models.family import get_family
from unirl.stages.runtime.accumulation import final_version
from unirl.stages.runtime.canary import CanaryError, verify
from unirl.stages.runtime.config_base import Section
from unirl.stages.runtime.processes import free_port
from unirl.stages.runtime.registry import algorithms, load_object
from unirl.stages.runtime.sample import read_shard, table_from_rows, write_shard
from unirl.stages.runtime.scratch import scratch_dir, shared_memory_dir
from unirl.stages.runtime.storage import join
from unirl.stages.train.manifests import MANIFEST


class EngineVersionError(EngineError):
    """The engine serves another policy version (or other weights) than the one unirl loaded."""


class WeightSync(Section):
    """How a dedicated engine's weights follow the trainer's."""

    every: int = Field(1, ge=1, description="Publish and load the weights every N policy updates (between them the "
                       "engine samples with older weights: needs rollout.correction).")
    weights: Literal["full", "lora"] = Field(
        "full", description="full: the whole model (weights/vN); lora: the LoRA adapters only (adapters/vN, needs "
        "model.lora), hot-loaded under the name vN.")
    transport: Literal["auto", "shm", "disk", "distributed"] = Field(
        "auto", description="shm: the trainer's rank 0 writes the tensors into shared memory on its host and the engine "
        "loads them from there, verified by the canary (the engine on the trainer's host, rollout.mode sync, layout "
        "separate, a text model); disk: the engine loads the published folder (weights/vN, sha256 manifest); "
        "distributed: the trainer's rank 0 broadcasts the full tensors to the engine over a weight-update process group "
        "(nccl on GPUs, gloo on CPU; text models, full weights, rollout.mode sync); auto: shm where it can be, else disk.")
    bucket_mb: int = Field(512, ge=1, le=65536, description="transport shm: the size of one safetensors file of the "
                           "staged weights, in MB.")
    engine_ranks: int = Field(1, ge=1, description="transport distributed: the engine's ranks in the update group "
                              "(SGLang: tp_size x dp_size).")
    canary_tolerance: float | None = Field(
        None, ge=0, description="Largest |engine - trainer| log-prob of the canary after a load (stages/runtime/canary.py; "
        "empty: the engine's default at the model's dtype; .inf: no check).")


class DedicatedConfig(Section):
    """Fields every dedicated engine has."""

    token_env: str = Field("UNIRL_ENGINE_TOKEN", description="Variable holding the engine's bearer token (SGLang: its "
                           "--api-key); never written into the recipe.")
    layout: Literal["separate", "colocated"] = Field(
        "separate", description="separate: the engine on its own devices/cores; colocated: it shares the trainer's and "
        "releases its memory while the trainer trains (not with rollout.mode async).")
    sync: WeightSync = Field(default_factory=WeightSync, description="Weight sync.")
    request_timeout_s: float = Field(600.0, gt=0, description="Longest wait for one engine request.")


class DedicatedEngine(RolloutEngine):
    """Client side of an engine with its own weights, over stages/engines/client.py."""

    own_weights = True
    # Whether the engine batches a trainer micro-batch together (flow rows replay bit for bit) and
    # reports the checksum of the tensors it loaded.
    exact_replay = False
    reports_checksum = False
    # The canary check's default tolerance by model dtype (same kernels as the trainer: tight).
    canary_tolerances: dict[str, float] = {"float32": 1e-4, "bfloat16": 2e-2}
    # Whether the engine's wire sends a prompt's images (families that `takes_images`).
    carries_images = False

    @classmethod
    def check(cls, recipe: Any) -> None:
        e, r = recipe.rollout.engine, recipe.rollout
        if get_family(recipe.model.kind).takes_images and not cls.carries_images:
            raise ValueError(f"rollout.engine.name: {e.name} takes prompts without images (its wire carries none), but "
                             f"model.kind {recipe.model.kind!r} shows its prompts' images; sample it trainside")
        stale = r.mode == "async" or e.sync.every > 1
        why = (f"rollout.mode async (max_staleness {r.max_staleness})" if r.mode == "async"
               else f"rollout.engine.sync.every {e.sync.every}")
        algo = algorithms.get(recipe.algorithm.name)
        if stale and not algo.correction_levels:
            raise ValueError(f"rollout.mode: with {why} rows are sampled by older policy versions, but algorithm "
                             f"{algo.name!r} trains only on rows its weights sampled; use rollout.mode sync with "
                             "rollout.engine.sync.every 1")
        if stale and r.correction is None:
            raise ValueError(f"rollout.correction: with {why} rows are sampled by older policy versions, whose behaviour "
                             "log-probs differ from the trainer's; set rollout.correction (e.g. `correction: {}` for "
                             "token-level truncated IS, docs/engines.md)")
        if r.mode == "async" and e.layout == "colocated":
            raise ValueError("rollout.engine.layout: colocated releases the engine while the trainer trains, which async "
                             "overlaps; use layout: separate")
        if r.mode == "async" and e.sync.every > max(1, r.max_staleness):
            raise ValueError(f"rollout.engine.sync.every: {e.sync.every} publishes too rarely for max_staleness "
                             f"{r.max_staleness} (iteration k samples with version k - {r.max_staleness}); set sync.every <= "
                             f"{max(1, r.max_staleness)}")
        if e.sync.transport == "distributed" and (e.sync.weights == "lora" or r.mode == "async" or recipe.model.lora is not None):
            raise ValueError("rollout.engine.sync.transport: distributed broadcasts the full, unmerged weights from the "
                             "trainer into an engine it talks to (no LoRA, rollout.mode sync); use transport: disk")
        if r.mode == "async" and r.dynamic_sampling is not None:
            raise ValueError("rollout.dynamic_sampling: refill rounds would sample on the producer's engine out of its "
                             "schedule; remove dynamic_sampling or use rollout.mode sync")
        if e.sync.transport == "shm" and (refused := cls.staging_refused(recipe)):
            raise ValueError(f"rollout.engine.sync.transport: shm {refused}; use transport: disk (or auto)")
        if e.sync.weights == "lora" and recipe.model.lora is None:
            raise ValueError("rollout.engine.sync.weights: lora sends the LoRA adapters, but model.lora is empty; set "
                             "model.lora or sync.weights: full")

    # Whether the engine loads a staged folder (transport shm: weights files without a manifest).
    loads_staged = False

    @classmethod
    def staging_refused(cls, recipe: Any) -> str | None:
        """Why the recipe's weights cannot reach this engine through shared memory (None: they can)."""
        e, family = recipe.rollout.engine, get_family(recipe.model.kind)
        if not cls.loads_staged:
            return f"is not a transport of {e.name} (its server loads folders it is given: transport disk)"
        if recipe.rollout.mode == "async":
            return "stages weights from the trainer into the engine in the sync task; rollout.mode async loads published ones"
        if e.layout == "colocated":
            return "keeps the staged weights in memory, which layout colocated releases"
        if family.policy != "text" or not (family.serves_tensors or e.sync.weights == "lora"):
            return f"stages the weights of text models whose family serves them as tensors, not model.kind {recipe.model.kind!r}"
        if recipe.train.nnodes > 1:
            return f"needs the trainer's rank 0 on the engine's host; train.nnodes is {recipe.train.nnodes}"
        url = getattr(e, "url", None)
        if url and (urlparse(url).hostname or "") not in ("127.0.0.1", "localhost", "::1"):
            return f"needs the engine on this host; rollout.engine.url {url} is not on loopback"
        return None

    @property
    def transport(self) -> str:
        """The sync's transport: the recipe's, with auto resolved (shm where it can be, else disk)."""
        set_ = self.cfg.sync.transport
        if set_ != "auto":
            return set_
        return "disk" if self._no_room or self.staging_refused(self.recipe) else "shm"

    def __init__(self, recipe: Any, storage: Any, group: Any):
        from unirl.stages.policies import policy_for  # at call time: policies imports this module while it loads

        self.recipe, self.storage, self.group = recipe, storage, group
        self.cfg = recipe.rollout.engine
        self.segment = policy_for(recipe).segment
        self._client: EngineClient | None = None
        self._version: int | None = None
        self.lora_name: str | None = None
        self.scratch = scratch_dir(f"unirl-engine-{storage.run}-")
        self._staging: Path | None = None
        self._canary_tokens: list[int] | None = None  # the run's canary tokens, once a staged sync has seen them
        self._no_room = False  # transport auto found shared memory too small: disk from then on
        self._wire: Any = None

    @property
    def wire(self) -> Any:
        """The policy's requests and rows (text: the tokenizer of the run's initial weights, which
        exist only once the run has set up, so built on first use)."""
        from unirl.stages.policies import policy_for  # at call time: policies imports this module while it loads

        if self._wire is None:
            self._wire = load_object(policy_for(self.recipe).wire).for_engine(self)
        return self._wire

    # -- where the engine is ------------------------------------------------------------------------
    def client(self, version: int) -> EngineClient:
        """The client of a reachable engine (an engine that is ours and not running is started with
        the weights of `version`)."""
        raise NotImplementedError

    def local(self, rel: str) -> Path:
        """A run folder as a path on this host (an object store's copy in the scratch folder)."""
        if self.storage.local:
            return self.storage.local_path(rel)
        target = self.scratch / rel
        if not (target / "manifest.json").exists():
            self.storage.get_dir(rel, target)
        return target

    @property
    def version(self) -> int | None:
        return self._version

    # -- sampling -----------------------------------------------------------------------------------
    def generate(self, requests: str, out_dir: str, iteration: int, policy_version: int, *,
                 greedy: bool = False, seed_tag: str = "", carried: str | None = None) -> dict[str, Any]:
        """Sample the requests' groups; with `carried` (the async producer of a run with
        rollout.partial: the previous batch's carry file, "" for none) as partial rollouts
        (stages/engines/partial.py)."""
        from unirl.stages.policies.text import token_prompts  # at call time: policies.text imports this module while it loads

        start = time.perf_counter()
        client = self.ensure(policy_version)
        req = read_shard(self.storage, requests, "requests")
        samples = []
        for gid, prompt, meta, gsize in zip(req.column("group_id").to_pylist(), req.column("prompt").to_pylist(),
                                            req.column("metadata").to_pylist(), req.column("group_size").to_pylist()):
            samples += [(f"{gid}/{j}", gid, prompt, meta) for j in range(gsize)]
        samples.sort(key=lambda s: s[0])
        extra = {"token_prompts": token_prompts(req)} if self.segment == "text" else {}
        if carried is not None:
            return self._partial(client, samples, extra.get("token_prompts") or {}, carried, out_dir, iteration,
                                 policy_version, start)
        rows = self._sample(client, samples, iteration=iteration, policy_version=policy_version, seed_tag=seed_tag,
                            greedy=greedy, **extra)
        rel = join(out_dir, "part-000.arrow")
        write_shard(self.storage, rel, table_from_rows(rows, "rollouts", [self.segment]))
        return {"files": [rel], "rows": len(rows), **self.wire.counters(rows), "policy_version": policy_version,
                "engine": self.cfg.name, "seconds": time.perf_counter() - start}

    def _sample(self, client: EngineClient, samples: list[tuple[str, str, str, Any]], *, iteration: int,
                policy_version: int, seed_tag: str, greedy: bool, **extra: Any) -> list[dict[str, Any]]:
        """The wire's rows of `samples`, each checked to be of `policy_version`."""
        transitions = algorithms.get(self.recipe.algorithm.name).replays_transitions
        rows = self.wire.rollout(client, samples, iteration=iteration, seed_tag=seed_tag, greedy=greedy,
                                 lora=self.lora_name, transitions=transitions, **extra)
        for row in rows:
            if "policy_version" not in row:  # flow: SGLang diffusion reports no version; the loaded one, checked at load
                row["policy_version"] = self._version
            if row["policy_version"] != policy_version:
                raise EngineVersionError(
                    f"rollout engine at {client.url} sampled {row['sample_id']!r} with weight version "
                    f"{row['policy_version']}, not {policy_version} as loaded: its weights changed under the run "
                    "(another client, or a restart); rerun to resume")
            row.update(iteration=iteration, parts=[self.segment])
        return rows

    def _partial(self, client: EngineClient, samples: list[tuple[str, str, str, Any]], token_prompts: dict[str, list[int]],
                 carried: str, out_dir: str, iteration: int, policy_version: int, start: float) -> dict[str, Any]:
        """Batch `iteration` of a run with partial rollouts (stages/engines/partial.py): the carried
        samples continue and the new ones start, cut at segment_tokens where the schedule allows,
        in rounds until a group has finished; the finished groups are the batch, the rest its carry."""
        from unirl.stages.engines.partial import CARRY, Partial, finished_groups, may_cut  # at call time: used by partial rollouts alone

        c = self.recipe.rollout
        seg, cap = c.partial.segment_tokens, c.max_new_tokens
        pool = [Partial.of_row(r) for r in (read_shard(self.storage, carried, "rollouts").to_pylist() if carried else [])]
        prompt_ids = self.wire.prompt_ids(samples, token_prompts)
        pool += [Partial(sid, gid, prompt, meta, list(ids)) for (sid, gid, prompt, meta), ids in zip(samples, prompt_ids)]
        where, rounds = f"rollout engine at {client.url}, batch {iteration}", 0
        while True:
            open_ = [p for p in pool if not p.done()]
            budgets = {p.sample_id: p.budget(cap, seg, may_cut(self.recipe, iteration, min(p.token_versions, default=policy_version)))
                       for p in open_}
            rows = self._sample(client, [(p.sample_id, p.group_id, p.prompt, p.metadata) for p in open_],
                                iteration=iteration, policy_version=policy_version, seed_tag=f"partial{rounds}", greedy=False,
                                continuations={p.sample_id: (p.prompt_ids + p.response_ids, budgets[p.sample_id]) for p in open_})
            for p, row in zip(open_, rows):
                p.extend(row, cap, where)
            rounds += 1
            done, rest = finished_groups(pool)
            if done:
                break
        cut_tokens = sum(len(p.response_ids) for p in rest)
        decode, eos = (lambda ids: self.wire.tokenizer.decode(ids, skip_special_tokens=True)), self.wire.tokenizer.eos_token_id
        rows = [{**p.row(decode, eos), "iteration": iteration, "parts": [self.segment]} for p in done]
        rel, carry = join(out_dir, "part-000.arrow"), join(out_dir, CARRY)
        write_shard(self.storage, rel, table_from_rows(rows, "rollouts", [self.segment]))
        write_shard(self.storage, carry, table_from_rows(
            [{**p.row(decode, eos), "iteration": iteration, "parts": [self.segment]} for p in rest], "rollouts", [self.segment]))
        spans = [len(set(r["token_versions"])) for r in rows]
        return {"files": [rel], "carry": carry, "rows": len(rows), **self.wire.counters(rows), "policy_version": policy_version,
                "engine": self.cfg.name, "seconds": time.perf_counter() - start,
                "metrics": {"rollout/partial_rounds": float(rounds), "rollout/partial_carried_samples": float(len(rest)),
                            "rollout/partial_carried_tokens": float(cut_tokens),
                            "rollout/partial_continued_frac": sum(s > 1 for s in spans) / max(len(spans), 1)}}

    # -- weights ------------------------------------------------------------------------------------
    def ensure(self, version: int) -> EngineClient:
        """The engine's client once it serves policy `version` (published weights loaded if not)."""
        client = self.client(version)
        if self._version != version:
            served = client.weight_version() if self.wire.reports_version else None
            stale = served != str(version) or (self.cfg.sync.weights == "lora" and self.lora_name != adapter_name(version))
            if not stale and self._version is None and not self.launched_here and not (self.cfg.sync.weights == "lora" and version > 0):
                stale = not self._serves(client, version)
            if stale:
                self._load(client, version)
            self._version = version
        return client

    @property
    def launched_here(self) -> bool:
        """Whether this object started the engine's server itself (with this run's weights)."""
        return False

    def _serves(self, client: EngineClient, version: int) -> bool:
        """At first contact with a server this object did not start, whether it serves this run's
        version of that number: a server another run (or a test) loaded reports its own version 0
        too. The published version's canary says; a version without one (the initial weights) is
        loaded."""
        rel = f"{self.storage.weights_rel(version)}/{MANIFEST}"
        canary = self.storage.read_json(rel).get("canary") if self.storage.exists(rel) else None
        if not canary:
            return False
        try:
            verify(client, canary, self.canary_tolerance, version=version, what="connecting")
        except CanaryError:
            return False
        return True

    def _load(self, client: EngineClient, version: int) -> dict[str, Any]:
        if self.transport == "shm" and self.group is not None:
            return self.stage(self.group, client, version)
        if self.cfg.sync.weights == "lora" and version > 0:
            return self.load_adapter(self.storage.adapters_rel(version), version)
        return self.load_weights(self.storage.weights_rel(version), version)

    def load_weights(self, weights_rel: str, version: int) -> dict[str, Any]:
        """Load published full weights and check what the engine reports back."""
        client = self.client(version)
        start = time.perf_counter()
        manifest = self.storage.read_json(f"{weights_rel}/{MANIFEST}")
        reports = self.wire.reports_version
        client.update_weights_from_disk(str(self.local(weights_rel)), str(version) if reports else None)
        diff = self._check_loaded(client, version, f"loading {weights_rel} as version {version}",
                                  manifest.get("weights_sha256"), reports_version=reports, manifest=manifest)
        return {"weights": weights_rel, "load_s": time.perf_counter() - start, **canary_out(diff)}

    @property
    def canary_tolerance(self) -> float:
        """This run's canary tolerance: the recipe's, else the engine's default at the model's dtype."""
        set_ = self.cfg.sync.canary_tolerance
        return set_ if set_ is not None else self.canary_tolerances.get(self.recipe.model.dtype, 2e-2)

    def _check_loaded(self, client: Any, version: int, what: str, sha256: str | None, *, reports_version: bool = True,
                      manifest: dict[str, Any] | None = None, lora: str | None = None,
                      asked: tuple[list[int], list[float]] | None = None) -> float | None:
        """After `what` (a load, a broadcast): the engine serves `version` (where its wire reports
        versions), where it reports checksums tensors whose checksum is `sha256`, and its canary
        log-probs are the trainer's (the `manifest`'s) within tolerance; else EngineVersionError or
        CanaryError naming the engine and the version. Then `version` is the engine's; the
        canary's largest difference is returned (None: not checked)."""
        served = client.weight_version() if reports_version else str(version)
        if served != str(version):
            raise EngineVersionError(f"rollout engine at {client.url} reports weight version {served!r} after {what}")
        if self.reports_checksum and sha256:
            got = client.get_weights_checksum(["model"]).get("model")
            if got != sha256:
                raise EngineVersionError(f"rollout engine at {client.url} holds weights with checksum {got} after {what}, "
                                         f"whose tensors' checksum is {sha256}")
        diff = None if manifest is None else verify(client, manifest.get("canary"), self.canary_tolerance, version=version,
                                                    what=what, lora=lora, asked=asked)
        self._version = version
        return diff

    def load_adapter(self, adapter_rel: str, version: int) -> dict[str, Any]:
        """Hot-load published LoRA adapters under the name vNNNNNN and unload the previous ones."""
        client = self.client(version)
        start = time.perf_counter()
        manifest = self.storage.read_json(f"{adapter_rel}/{MANIFEST}")
        self._swap_adapter(client, version, str(self.local(adapter_rel)), manifest.get("weights_sha256"), adapter_rel)
        diff = self._check_loaded(client, version, f"loading adapter {adapter_rel} as {adapter_name(version)}", None,
                                  reports_version=self.wire.reports_version, manifest=manifest, lora=adapter_name(version))
        return {"adapter": adapter_rel, "load_s": time.perf_counter() - start, **canary_out(diff)}

    def _swap_adapter(self, client: EngineClient, version: int, folder: str, sha256: str | None, what: str) -> None:
        """The previous adapter unloaded, the one in `folder` loaded under the name vNNNNNN (its
        checksum checked where the engine reports one and `sha256` is given), the version set. Nothing
        samples during a sync (rollout.mode sync; in async the producer syncs between its batches)."""
        name = adapter_name(version)
        if self.lora_name != name:
            if self.lora_name is not None:  # first: an engine may load the new one into the old one's layers
                client.unload_lora_adapter(self.lora_name)
                self.lora_name = None
            client.load_lora_adapter(name, folder)
            self.lora_name = name
            if self.reports_checksum and sha256:
                got = client.get_weights_checksum([name]).get(name)
                if got != sha256:
                    raise EngineVersionError(f"rollout engine at {client.url}: adapter {name} has checksum {got}, the "
                                             f"published {what} {sha256}")
        if self.wire.reports_version:
            client.update_weight_version(str(version))

    @property
    def staging(self) -> Path:
        """This engine's folder in shared memory (transport shm), made on first use, removed at close
        (or, after a crash, by the next unirl process's sweep)."""
        if self._staging is None:
            self._staging = scratch_dir(f"unirl-weights-{self.storage.run}-", shared_memory_dir())
        return self._staging

    def stage(self, trainer: Any, client: EngineClient, version: int) -> dict[str, Any]:
        """transport shm: the trainer writes `version`'s weights (or adapters) into shared memory
        and the engine loads them while the trainer computes the canary; then the version and the
        canary are checked as after a load from disk. Nothing is published or hashed."""
        start = time.perf_counter()
        lora = self.cfg.sync.weights == "lora" and version > 0
        folder = self.staging / ("adapter" if lora else "model")
        trainer.ensure(version)
        staged = trainer.call("stage_weights", folder=str(folder), lora=lora, bucket_mb=self.cfg.sync.bucket_mb)
        if staged.get("refused"):
            if self.cfg.sync.transport == "shm":
                raise EngineError(f"rollout.engine.sync.transport shm: {staged['refused']}; make room, or set transport: "
                                  "disk")
            print(f"[unirl] weight sync: {staged['refused']}; this run syncs through published folders from now on "
                  "(rollout.engine.sync.transport: disk)", file=sys.stderr, flush=True)
            self._no_room = True  # self.transport is disk from now on
            if self._staging is not None:
                shutil.rmtree(self._staging, ignore_errors=True)
                self._staging = None
            return {"published": self.publish_for(trainer, version), **self._load(client, version)}
        if staged.get("host") != socket.gethostname():
            raise EngineError(f"rollout.engine.sync.transport shm: the trainer's rank 0 runs on {staged.get('host')!r}, "
                              f"not on this host ({socket.gethostname()!r}), so the engine cannot read what it staged in "
                              f"{folder}; set transport: disk")
        staged_s = time.perf_counter() - start
        what = f"loading version {version} from shared memory ({folder})"
        name = adapter_name(version) if lora else None
        tokens = self._canary_tokens  # the same every version: known after the first
        with ThreadPoolExecutor(1) as pool:
            expected = pool.submit(trainer.call, "canary")  # the trainer's forward overlaps the engine's load and its own
            if lora:
                self._swap_adapter(client, version, str(folder), None, str(folder))
            else:
                client.update_weights_from_disk(str(folder), str(version) if self.wire.reports_version else None)
            asked = None if tokens is None or math.isinf(self.canary_tolerance) else (tokens, client.prompt_logprobs(tokens, name))
            manifest = expected.result()
        self._canary_tokens = list(manifest["canary"]["tokens"]) if manifest.get("canary") else None
        diff = self._check_loaded(client, version, what, None, reports_version=self.wire.reports_version,
                                  manifest=manifest, lora=name, asked=asked)
        return {"staged": str(folder), "staged_bytes": staged.get("bytes", 0), "stage_s": staged_s,
                "load_s": time.perf_counter() - start - staged_s, **canary_out(diff)}

    def publish_for(self, trainer: Any, version: int) -> str:
        """What the engine loads for `version` (weights/vN, or adapters/vN with LoRA sync),
        published through the trainer unless it is already: every rank gathers, rank 0 writes."""
        lora = self.cfg.sync.weights == "lora" and version > 0
        rel = self.storage.adapters_rel(version) if lora else self.storage.weights_rel(version)
        if not self.storage.exists(join(rel, MANIFEST)):
            trainer.ensure(version)
            trainer.call("publish_adapter" if lora else "publish")
        return rel

    def sync(self, trainer: Any, version: int) -> dict[str, Any]:
        """At a sync version (every `sync.every` updates, and the last): publish it and load it
        into the engine. In async RL only publish: that is the barrier the producer waits at."""
        if version % self.cfg.sync.every and version != final_version(self.recipe):
            return {}
        start = time.perf_counter()
        out: dict[str, Any] = {}
        if self.transport != "shm":
            out["published"] = self.publish_for(trainer, version)
            out["publish_s"] = time.perf_counter() - start
        if self.recipe.rollout.mode == "async":
            return out
        client = self.client(version)
        if self.cfg.layout == "colocated":  # SGLang's order: weights back, new weights in, then the cache
            client.resume_memory_occupation(["weights"])
        if self.transport == "distributed":
            out.update(self.push(trainer, client, version))
        elif self.transport == "shm":
            out.update(self.stage(trainer, client, version))
        else:
            out.update(self._load(client, version))
        if self.cfg.layout == "colocated":
            client.resume_memory_occupation(["kv_cache"])
        out["sync_s"] = time.perf_counter() - start
        return out

    def connect(self) -> None:
        if getattr(self.cfg, "url", None):
            self.client(self._version or 0)

    def push(self, trainer: Any, client: EngineClient, version: int) -> dict[str, Any]:
        """Broadcast the trainer's full weights into the engine over the update group (joined once
        per engine): every rank gathers, rank 0 sends while the engine, told the names, dtypes and
        shapes over HTTP, receives; then the version and checksum are checked as after a load."""

        start = time.perf_counter()
        name = f"unirl-{self.storage.run}"
        with ThreadPoolExecutor(1) as pool:
            if getattr(self, "_group_client", None) is not client:
                self._specs = trainer.call("weight_specs")
                host = urlparse(client.url).hostname or "127.0.0.1"
                # the engine reaches the trainer's rank 0 where the trainer reaches the engine
                address = "127.0.0.1" if host in ("127.0.0.1", "localhost", "::1") else socket.gethostbyname(socket.gethostname())
                port, world = free_port(), 1 + self.cfg.sync.engine_ranks
                joined = pool.submit(client.init_weights_update_group, address, port, 1, world, name, self._specs["backend"])
                trainer.call("join_update_group", master_address=address, master_port=port, world_size=world,
                             group_name=name, backend=self._specs["backend"])
                joined.result()
                self._group_client = client
            s = self._specs
            received = pool.submit(client.update_weights_from_distributed, s["names"], s["dtypes"], s["shapes"],
                                   group_name=name, weight_version=str(version))
            sent = trainer.call("broadcast_weights", group_name=name)
            received.result()

        manifest = self.storage.read_json(f"{self.storage.weights_rel(version)}/{MANIFEST}")
        diff = self._check_loaded(client, version, f"the broadcast of version {version}", sent.get("weights_sha256"),
                                  manifest=manifest)
        return {"pushed": len(s["names"]), "push_s": time.perf_counter() - start, **canary_out(diff)}

    def release(self) -> None:
        if self.cfg.layout == "colocated" and self._client is not None:
            self._client.release_memory_occupation()

    def resume(self) -> None:
        """After a sync, or an update without one: the engine takes its memory back."""
        if self.cfg.layout == "colocated" and self._client is not None:
            self._client.resume_memory_occupation(None)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None


def canary_out(diff: float | None) -> dict[str, float]:
    """The canary's largest difference for a sync's output (nothing when it was not checked)."""
    return {} if diff is None else {"canary_max_abs_diff": diff}


def adapter_name(version: int) -> str:
    return f"v{version:06d}"
