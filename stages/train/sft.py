"""Supervised records for the warm start: synthetic ones from the recipe's data source ((prompt,
response) with its answers, and the prompt's images for vision-language models; (prompt,
media_png) scenes for toy GenEval) or a JSONL / Arrow file."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc

from unirl.stages.recipe import Recipe
from unirl.stages.runtime.images import with_image_grids
from unirl.stages.runtime.registry import sources
from unirl.stages.runtime.sample import table_from_rows, write_shard
from unirl.stages.runtime.storage import RunStorage

SFT_DATA = "sft/data.arrow"


def file_records(path: str) -> list[dict[str, Any]]:
    """Records of a JSONL (one object per line) or Arrow IPC file with `prompt` and `response`."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"sft.path {p}: no such file")
    if p.suffix in (".arrow", ".ipc", ".feather"):
        table = ipc.open_file(pa.memory_map(str(p))).read_all()
        rows = table.to_pylist()
    else:
        rows = []
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{p}:{n}: not a JSON object ({exc.msg})") from None
    if not rows:
        raise ValueError(f"sft.path {p}: no records")
    out = []
    for n, row in enumerate(rows, 1):
        turns = row.get("turns")
        if turns is not None:  # an agent's transcript: its assistant and tool turns after the prompt
            row = {**row, "turns": json.dumps(check_turns(turns, f"{p}: record {n}"))}
            row.setdefault("response", json.loads(row["turns"])[-1]["text"])
        for column in ("prompt", "response"):
            if not isinstance(row.get(column), str) or not row[column]:
                raise ValueError(f"{p}: record {n} has no {column!r} text (columns: {sorted(row)})")
        out.append({"prompt": row["prompt"], "response": row["response"], **({"turns": row["turns"]} if turns is not None else {})})
    return out


def check_turns(turns: Any, where: str) -> list[dict[str, str]]:
    """A transcript's turns: a list of {"role": "assistant" | "tool", "text": str}, ending in an assistant turn."""
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"{where}: turns must be a non-empty list of {{role, text}} objects")
    for i, t in enumerate(turns):
        if not isinstance(t, dict) or t.get("role") not in ("assistant", "tool") or not isinstance(t.get("text"), str):
            raise ValueError(f"{where}: turns.{i} must be {{\"role\": \"assistant\" | \"tool\", \"text\": ...}}")
    if turns[-1]["role"] != "assistant":
        raise ValueError(f"{where}: the last turn must be the assistant's (its answer)")
    return [{"role": t["role"], "text": t["text"]} for t in turns]


def sft_records(recipe: Recipe) -> list[dict[str, Any]]:
    """A recipe's warm-start records: its `sft.path` file's (`source: file`), or its data source's."""
    sft = recipe.sft
    if sft is None:
        raise ValueError("the recipe has no `sft` section; add one (see recipes/ar/quickstart.yaml)")
    if sft.source == "file":
        if not sft.path:
            raise ValueError("sft.path: `source: file` needs the path of a JSONL or Arrow file of prompt/response records")
        return file_records(sft.path)
    return sources.get(recipe.data.name).sft_records(recipe)


def write_sft_data(storage: RunStorage, recipe: Recipe) -> dict[str, Any]:
    records = sft_records(recipe)
    images = [tuple(r.pop("images", ())) for r in records]
    records = with_image_grids(recipe, records, images, [f"SFT record {i + 1}" for i in range(len(records))])
    write_shard(storage, SFT_DATA, table_from_rows(records, "sft"))
    return {"files": [SFT_DATA], "rows": len(records)}
