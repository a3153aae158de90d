"""Previews of a flow model's samples for people: each image (or video frame) enlarged (nearest
neighbour, so pixels stay pixels), with its prompt and reward written under it. Images make one
grid PNG; videos an animated GIF whose frame k is the grid of every clip's frame k. The flow logs
one per `tracking.preview_every` iterations to MLflow, and one of the held-out samples at each
evaluation; the media stay in the shards, where `rollout_grid` draws them again later."""
from __future__ import annotations

import io
import textwrap
from typing import Any

from unirl.stages.runtime.sample import first_of_groups, read_rollouts, read_shard, scoring_view
from unirl.stages.runtime.storage import RunStorage, eval_dir, join


def image_grid(pngs: list[bytes], captions: list[str], *, columns: int = 4, cell: int = 128) -> Any:
    """PIL RGB image: `pngs` in rows of `columns`, each scaled to `cell` px and captioned."""
    from PIL import Image, ImageDraw, ImageFont  # start-up time: PIL loads on first use, not when a recipe is read

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
        image = Image.open(io.BytesIO(png)).convert("RGB").resize((cell, cell), Image.Resampling.NEAREST)
        grid.paste(image, (x + 2, y + 2))
        for n, line in enumerate(caption):
            draw.text((x + 2, y + cell + 4 + 12 * n), line, fill=(0, 0, 0), font=font)
    return grid


def clip_grid(clips: list[list[bytes]], captions: list[str], *, columns: int = 4, cell: int = 96) -> list[Any]:
    """The frames of an animated grid: frame k is `image_grid` of every clip's frame k (a shorter
    clip holds its last frame)."""
    length = max(len(c) for c in clips)
    return [image_grid([c[min(k, len(c) - 1)] for c in clips], captions, columns=columns, cell=cell) for k in range(length)]


GRID_COLUMNS = ["sample_id", "group_id", "prompt", "text", "media_png", "media_frames"]  # what a grid reads of rollouts


def rollout_grid(storage: RunStorage, rollouts: list[str], rewards: str | None = None, *, max_images: int = 16,
                 columns: int = 4, table: Any = None) -> Any:
    """The grid of the first `max_images` rollouts (one per group first), with their rewards when
    `rewards` (rewards.arrow) is given: a PIL image, or for videos the list of its frames. `table`:
    the rollouts' scoring view (at least GRID_COLUMNS) when the caller has read them already."""
    if table is None:
        table = scoring_view(read_rollouts(storage, rollouts, columns=GRID_COLUMNS))
    ids = table.column("sample_id").to_pylist()
    reward = {}
    if rewards is not None:
        r = read_shard(storage, rewards, "rewards")
        reward = dict(zip(r.column("sample_id").to_pylist(), r.column("reward").to_pylist()))
    pick = first_of_groups(table.column("group_id").to_pylist(), max_images)
    prompts = table.column("prompt").to_pylist()
    rewrites = table.column("text").to_pylist() if "text" in table.column_names else None  # a pipeline's rewrite
    captions = [prompts[i] + (f" -> {rewrites[i]}" if rewrites else "") + (f"  r={reward[ids[i]]:.2f}" if ids[i] in reward else "")
                for i in pick]
    clips = table.column("media_frames").to_pylist() if "media_frames" in table.column_names else None
    if clips is not None and all(clips[i] for i in pick):
        return clip_grid([clips[i] for i in pick], captions, columns=columns)
    pngs = table.column("media_png").to_pylist()
    return image_grid([pngs[i] for i in pick], captions, columns=columns)


def log_grid(tracker: Any, step: int, grid: Any, key: str) -> str:
    """Log a grid (a PIL image, or a list of frames: an animated GIF) to MLflow under `key`."""
    if isinstance(grid, list):
        from unirl.stages.runtime.media import to_gif  # start-up time: loaded on first use

        return tracker.log_bytes(step, to_gif(grid), key, "gif")
    return tracker.log_image(step, grid, key)


def log_iteration_grid(tracker: Any, storage: RunStorage, iteration: int, table: Any = None) -> str | None:
    """Log iteration `iteration`'s grid to MLflow (`table`: its rollouts, if read already); returns the artifact path."""
    gen = storage.stage_manifest(iteration, "generate")
    scored = storage.stage_manifest(iteration, "score")
    if gen is None:
        return None
    grid = rollout_grid(storage, gen["files"], scored["files"][0] if scored else None, table=table)
    return log_grid(tracker, iteration, grid, "rollouts")


def log_eval_grid(tracker: Any, storage: RunStorage, version: int) -> str | None:
    """Log the held-out greedy samples of policy `version` (eval/vNNNNNN/greedy) to MLflow."""
    folder = join(eval_dir(version), "greedy")
    names = [f for f in storage.files(folder) if f.endswith(".arrow")]
    if "composed.arrow" in names:  # a two-stage model's: each image with the text that caused it
        names = ["composed.arrow"]
    parts = [join(folder, f) for f in names]
    if not parts:
        return None
    return log_grid(tracker, version, rollout_grid(storage, parts), "heldout")
