"""The latent segment of a rollout row (stages/runtime/sample.py `segment_columns()["latent"]`, the flow policy's `columns`) to and
from tensors.

Per sample: `sigmas` (T+1), `sde_indices` (K), `latents` = x at the stored steps flattened, with
`latent_shape` = [N, C, h, w] (images) or [N, C, F, h, w] (video), `sde_logprobs` (K), `noise_seed` (the seed of the initial noise)
and `media_png` (the decoded image). Which steps are stored follows from the rest
(`unirl.stages.diffusion.sampling.stored_steps`): N == 1 keeps only the final x_T (likelihood-free
losses such as NFT); otherwise x_i and x_{i+1} of every SDE step i, and x_T.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch import Tensor

from unirl.stages.diffusion.kernels import ODE
from unirl.stages.diffusion.sampling import Plan, stored_steps
from unirl.stages.runtime.sample import ShardSchemaError, list_column


def latent_rows(traj_latents: Tensor, logprobs: Tensor, plan: Plan) -> list[dict[str, Any]]:
    """The latent-segment columns of each sample of a trajectory (without media_png / noise_seed)."""
    sigmas = plan.sigmas.tolist()
    indices = [int(i) for i in plan.sde_indices] if logprobs.shape[1] else []
    rows = []
    for b in range(traj_latents.shape[0]):
        lat = traj_latents[b].detach().float().cpu().contiguous()
        rows.append({
            "sigmas": sigmas, "sde_indices": indices, "latents": lat.reshape(-1).numpy(),
            "latent_shape": list(lat.shape), "sde_logprobs": logprobs[b].detach().float().cpu().numpy(),
        })
    return rows


@dataclass
class LatentBatch:
    """Rows of a rollout table as tensors. latents: (B, N, *latent); logprobs: (B, K); stored:
    the step index of each of the N latents; plan: the sampling plan the rows share."""

    sample_ids: list[str]
    prompts: list[str]
    latents: Tensor
    logprobs: Tensor
    stored: list[int]
    plan: Plan
    advantage: Tensor | None = None  # (B,), attached for training
    domains: list[str | None] | None = None  # each row's domain (a mixture's; routes its distillation teacher)
    versions: Tensor | None = None  # (B,) the policy version that sampled each row (None: not known)

    def fresh(self, version: int) -> Tensor:
        """(B,) bool: the rows sampled by policy `version` (all of them when versions are not known)."""
        if self.versions is None:
            return torch.ones(len(self.sample_ids), dtype=torch.bool, device=self.logprobs.device)
        return self.versions.to(self.logprobs.device) == version

    def at(self, step: int) -> Tensor:
        """x at step `step` (B, *latent); KeyError naming the stored steps when it was not kept."""
        if step not in self.stored:
            raise KeyError(f"step {step} is not stored in these rollouts (stored: {self.stored})")
        return self.latents[:, self.stored.index(step)]

    @property
    def final(self) -> Tensor:
        return self.latents[:, -1]

    @property
    def weight(self) -> float:
        """What the update's metrics are weighted by: samples."""
        return float(len(self.sample_ids))

    def to(self, device: torch.device | str) -> LatentBatch:
        """The same rows with latents and log-probs on `device` (the plan stays on the CPU: its
        sigmas enter the kernels as scalars)."""
        return dataclasses.replace(self, latents=self.latents.to(device), logprobs=self.logprobs.to(device),
                                   advantage=None if self.advantage is None else self.advantage.to(device),
                                   versions=None if self.versions is None else self.versions.to(device))


def read_latents(table: pa.Table, rows: list[int], *, kind: str, eta: float, where: str) -> LatentBatch:
    """The latent segment of `rows` of a rollout table. Every row must share one schedule, one set
    of SDE steps and one latent shape (one iteration's plan); a row that does not is an error naming
    its sample id and the column."""
    ids = table.column("sample_id").to_pylist()
    sig_values, sig_off = list_column(table, "sigmas")
    idx_values, idx_off = list_column(table, "sde_indices")
    lat_values, lat_off = list_column(table, "latents")
    shp_values, shp_off = list_column(table, "latent_shape")
    lp_values, lp_off = list_column(table, "sde_logprobs")
    first = rows[0]
    sigmas = np.asarray(sig_values[sig_off[first]:sig_off[first + 1]])
    indices = np.asarray(idx_values[idx_off[first]:idx_off[first + 1]])
    shape = [int(s) for s in shp_values[shp_off[first]:shp_off[first + 1]]]
    latents, logprobs = [], []
    for r in rows:
        sid = ids[r]
        for name, values, off, ref in (("sigmas", sig_values, sig_off, sigmas), ("sde_indices", idx_values, idx_off, indices)):
            got = values[off[r]:off[r + 1]]
            if got.shape != ref.shape or not np.array_equal(got, ref):
                raise ShardSchemaError(f"{where}: sample {sid!r}: column {name!r} differs from sample {ids[first]!r}'s; "
                                       "one iteration's rows share one sampling plan")
        row_shape = [int(s) for s in shp_values[shp_off[r]:shp_off[r + 1]]]
        if row_shape != shape or len(shape) < 4:
            raise ShardSchemaError(f"{where}: sample {sid!r}: column 'latent_shape' is {row_shape}, expected [N, C, (F,) h, w] = {shape}")
        flat = lat_values[lat_off[r]:lat_off[r + 1]]
        if flat.size != int(np.prod(shape)):
            raise ShardSchemaError(f"{where}: sample {sid!r}: column 'latents' has {flat.size} values for shape {shape}")
        lp = lp_values[lp_off[r]:lp_off[r + 1]]
        if lp.size != indices.size:
            raise ShardSchemaError(f"{where}: sample {sid!r}: column 'sde_logprobs' has {lp.size} values for {indices.size} SDE steps")
        latents.append(torch.from_numpy(np.array(flat, dtype=np.float32).reshape(shape)))
        logprobs.append(torch.from_numpy(np.array(lp, dtype=np.float32)))
    plan = Plan(torch.from_numpy(np.array(sigmas, dtype=np.float32)), torch.from_numpy(indices.astype(np.int64)),
                kind if indices.size else ODE, eta if indices.size else 0.0)
    num_steps = sigmas.size - 1
    stored = stored_steps(plan.sde_indices.tolist(), num_steps, transitions=shape[0] > 1)
    if len(stored) != shape[0]:
        raise ShardSchemaError(f"{where}: {shape[0]} stored latents per sample match neither the SDE steps' "
                               f"transitions ({len(stored)}) nor the final sample alone (1)")
    prompts = table.column("prompt").to_pylist()
    metas = table.column("metadata").to_pylist() if "metadata" in table.schema.names else None
    domains = [json.loads(metas[r] or "{}").get("domain") if metas is not None else None for r in rows]
    versions = None
    if "policy_version" in table.schema.names:
        column = [table.column("policy_version")[r].as_py() for r in rows]
        versions = None if None in column else torch.tensor(column, dtype=torch.int64)
    return LatentBatch([ids[r] for r in rows], [prompts[r] for r in rows], torch.stack(latents),
                       torch.stack(logprobs), stored, plan, domains=domains, versions=versions)
