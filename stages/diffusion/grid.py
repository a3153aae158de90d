"""Image grids of an iteration's rollouts for people: each image enlarged (nearest neighbour, so
pixels stay pixels), with its prompt and reward written under it. The flow logs one per
`tracking.preview_every` iterations to MLflow; the PNG bytes stay in the rollout shards."""
from __future__ import annotations

import io
import textwrap
from typing import Any

from stages.sample import read_rollouts, read_shard
from stages.storage import RunStorage


def image_grid(pngs: list[bytes], captions: list[str], *, columns: int = 4, cell: int = 128) -> Any:
    """PIL RGB image: `pngs` in rows of `columns`, each scaled to `cell` px and captioned."""
    from PIL import Image, ImageDraw, ImageFont

    if not pngs:
        raise ValueError("image_grid needs at least one image")
    font = ImageFont.load_default()
    wrap = max(8, cell // 6)
    lines = [textwrap.wrap(c, wrap)[:4] for c in captions]
    text_h = 12 * max(len(x) for x in lines) + 4
    rows = (len(pngs) + columns - 1) // columns
    grid = Image.new("RGB", (columns * (cell + 4), rows * (cell + text_h + 4)), (255, 255, 255))
    draw = ImageDraw.Draw(grid)
    for k, (png, caption) in enumerate(zip(pngs, lines)):
        x, y = (k % columns) * (cell + 4), (k // columns) * (cell + text_h + 4)
        image = Image.open(io.BytesIO(png)).convert("RGB").resize((cell, cell), Image.NEAREST)
        grid.paste(image, (x + 2, y + 2))
        for n, line in enumerate(caption):
            draw.text((x + 2, y + cell + 4 + 12 * n), line, fill=(0, 0, 0), font=font)
    return grid


def log_iteration_grid(tracker: Any, storage: RunStorage, iteration: int) -> str | None:
    """Log iteration `iteration`'s grid to MLflow; returns the artifact path."""
    gen = storage.stage_manifest(iteration, "generate")
    scored = storage.stage_manifest(iteration, "score")
    if gen is None:
        return None
    grid = rollout_grid(storage, gen["files"], scored["files"][0] if scored else None)
    return tracker.log_image(iteration, grid, "rollouts")


def rollout_grid(storage: RunStorage, rollouts: list[str], rewards: str | None = None, *, max_images: int = 16,
                 columns: int = 4) -> Any:
    """The grid of the first `max_images` rollouts (one per group first, so prompts vary), with
    their rewards when `rewards` (rewards.arrow) is given."""
    table = read_rollouts(storage, rollouts)
    ids = table.column("sample_id").to_pylist()
    groups = table.column("group_id").to_pylist()
    reward = {}
    if rewards is not None:
        r = read_shard(storage, rewards, "rewards")
        reward = dict(zip(r.column("sample_id").to_pylist(), r.column("reward").to_pylist()))
    first_of_group, rest, seen = [], [], set()
    for i, g in enumerate(groups):
        (rest if g in seen else first_of_group).append(i)
        seen.add(g)
    pick = (first_of_group + rest)[:max_images]
    pngs = table.column("media_png").to_pylist()
    prompts = table.column("prompt").to_pylist()
    captions = [prompts[i] + (f"  r={reward[ids[i]]:.2f}" if ids[i] in reward else "") for i in pick]
    return image_grid([pngs[i] for i in pick], captions, columns=columns)
