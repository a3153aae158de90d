"""Supervised records for the warm start: (prompt, response) for language models, drawn from the
recipe's data source with its answers or read from a JSONL / Arrow file."""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc

from stages.recipe import Recipe
from stages.sample import table_from_rows, write_shard
from stages.storage import RunStorage

SFT_DATA = "sft/data.arrow"


def synthetic_records(recipe: Recipe) -> list[dict[str, Any]]:
    """`sft.examples` (prompt, answer) records from the data source's training stream (never its
    held-out split): the reference answers are the demonstrations."""
    from stages.data import build_prompt_source

    source = build_prompt_source(recipe.data)
    prompts = source.batch(0, recipe.sft.examples)
    missing = [p.prompt_id for p in prompts if "answer" not in p.metadata]
    if missing:
        raise ValueError(f"sft.source: synthetic records need an answer per prompt; {missing[0]!r} has none")
    rng = random.Random(f"sft-noise-{recipe.sft.seed}")
    return [
        {"prompt": p.text, "response": str(p.metadata["answer"]) + ("=" if rng.random() < recipe.sft.noise else "")}
        for p in prompts
    ]


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
    for n, row in enumerate(rows, 1):
        for column in ("prompt", "response"):
            if not isinstance(row.get(column), str) or not row[column]:
                raise ValueError(f"{p}: record {n} has no {column!r} text (columns: {sorted(row)})")
    return [{"prompt": r["prompt"], "response": r["response"]} for r in rows]


def write_sft_data(storage: RunStorage, recipe: Recipe) -> dict[str, Any]:
    sft = recipe.sft
    if sft.source == "synthetic" and recipe.data.name == "geneval":  # image records: prompt + media_png
        from stages.diffusion.sft import synthetic_records as image_records

        records = image_records(recipe)
    else:
        records = file_records(sft.path) if sft.source == "file" else synthetic_records(recipe)
    write_shard(storage, SFT_DATA, table_from_rows(records, "sft"))
    return {"files": [SFT_DATA], "rows": len(records)}
