"""Sample shards: the Arrow IPC file format every stage reads and writes (docs/architecture.md, "Storage").

One row per generated sample. Columns every rollout shard has: `sample_id` ("{group_id}/{j}"),
`group_id`, `iteration`, `policy_version`, `parts` (the ordered segment kinds of the row, e.g.
["text"] or ["text", "latent"]) and `metadata` (JSON of the prompt source's fields). Each segment
kind adds its own columns (its policy's, `segment_columns`). Rewards and advantages are separate files keyed by
`sample_id`. A shard that does not match its schema fails naming the file and the column.

Prompts conditioned on images (vision-language models) add `IMAGE_COLUMNS` (stages/runtime/images.py:
PNG bytes and patch grids) to requests, rollouts and SFT records.
"""
from __future__ import annotations

import io
import json
from collections.abc import Iterable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from unirl.stages.runtime.images import IMAGE_COLUMNS
from unirl.stages.runtime.registry import policies
from unirl.stages.runtime.storage import RunStorage

SCHEMA_VERSION = 2  # 2: composed shards namespace each part by its name (`unirl.parts`)

_LIST_I32 = pa.list_(pa.int32())
_LIST_F32 = pa.list_(pa.float32())

BASE_COLUMNS: dict[str, pa.DataType] = {
    "sample_id": pa.string(),
    "group_id": pa.string(),
    "iteration": pa.int32(),
    "policy_version": pa.int32(),
    "parts": pa.list_(pa.string()),
    "metadata": pa.string(),
    "prompt": pa.string(),
}

def segment_columns() -> dict[str, dict[str, pa.DataType]]:
    """Segment kind -> its columns, as each registered policy declares them (`Policy.columns`)."""
    return {cls.segment: cls.columns for _, cls in policies.items()}


REQUEST_COLUMNS: dict[str, pa.DataType] = {
    "group_id": pa.string(),
    "prompt": pa.string(),
    "metadata": pa.string(),
    "group_size": pa.int32(),
    "iteration": pa.int32(),
}

# Optional token columns: a request's `prompt_ids` (a prompt given as token ids, sampled as they are:
# an agent's next turn, stages/agent/), and a rollout's `response_mask` (1 where a response token is
# the policy's own, 0 where it is a tool's or the template's: only the policy's tokens are trained).
TOKEN_COLUMNS: dict[str, pa.DataType] = {"prompt_ids": pa.list_(pa.int32()), "response_mask": pa.list_(pa.int8()),
                                         # partial rollouts (stages/engines/partial.py): the policy version of each response token
                                         "token_versions": pa.list_(pa.int32()),
                                         # an agent's trajectory (stages/tools/agent.py): turns, tool calls, errors, why it stopped
                                         "agent_turns": pa.int32(), "agent_tool_calls": pa.int32(),
                                         "agent_tool_errors": pa.int32(), "agent_stop": pa.string(),
                                         "agent_transcript": pa.string()}  # JSON: what scorers of "transcript" read

REWARD_COLUMNS: dict[str, pa.DataType] = {"sample_id": pa.string(), "group_id": pa.string(), "reward": pa.float64()}
ADVANTAGE_COLUMNS: dict[str, pa.DataType] = {"sample_id": pa.string(), "group_id": pa.string(), "advantage": pa.float32()}

# Supervised records: `response` (text) for language models, `media_png` for image models,
# `media_frames` (one PNG per frame) for video models.
SFT_COLUMNS: dict[str, pa.DataType] = {"prompt": pa.string()}

# An agent's transcripts (stages/tools/agent.py `turn_rows`): one row per turn of every trajectory.
TURN_COLUMNS: dict[str, pa.DataType] = {
    "sample_id": pa.string(), "turn": pa.int32(), "role": pa.string(), "token_ids": pa.list_(pa.int32()),
    "mask": pa.list_(pa.int8()), "text": pa.string(), "tool": pa.string(), "arguments": pa.string(), "result": pa.string(),
    "latency_s": pa.float64(), "error": pa.string(), "stop_reason": pa.string(),
}

# A teacher's log-probs of the student's response tokens (stages/run/distillation.py), one row per sample.
TEACHER_COLUMNS: dict[str, pa.DataType] = {"sample_id": pa.string(), "teacher": pa.string(), "teacher_logprobs": _LIST_F32}

KINDS: dict[str, dict[str, pa.DataType]] = {
    "teacher": TEACHER_COLUMNS,
    "sft": SFT_COLUMNS,
    "requests": REQUEST_COLUMNS,
    "rewards": REWARD_COLUMNS,
    "advantages": ADVANTAGE_COLUMNS,
    "turns": TURN_COLUMNS,
}


class ShardSchemaError(ValueError):
    """A shard that is not what its stage expects; the message names the file and the column."""


def rollout_schema(segments: Iterable[str]) -> pa.Schema:
    fields = [pa.field(n, t) for n, t in BASE_COLUMNS.items()]
    columns = segment_columns()
    for seg in segments:
        fields += [pa.field(n, t) for n, t in columns[seg].items()]
    return pa.schema(fields, metadata={"unirl.schema_version": str(SCHEMA_VERSION), "unirl.kind": "rollouts"})


def table_from_rows(rows: list[dict[str, Any]], kind: str, segments: Iterable[str] = (), extra: Iterable[str] = ()) -> pa.Table:
    """Build a shard table from plain rows (dicts). `metadata` values may be dicts (stored as JSON).
    `extra`: optional columns the table has even when no row does (one rank's empty shard must
    have the schema of the others)."""
    if kind == "rollouts":
        schema = rollout_schema(segments)
    else:
        schema = pa.schema(
            [pa.field(n, t) for n, t in KINDS[kind].items()],
            metadata={"unirl.schema_version": str(SCHEMA_VERSION), "unirl.kind": kind},
        )
    extra = sorted(({k for r in rows for k in r} | set(extra)) - set(schema.names))
    known = {"response": pa.string(), "media_png": pa.binary(), "metadata": pa.string(), "turns": pa.string(),
             "media_frames": pa.list_(pa.binary()), **IMAGE_COLUMNS, **TOKEN_COLUMNS,
             # a mixture's domain and a row's teacher; on-policy distillation's per-token advantages
             "domain": pa.string(), "teacher": pa.string(), "token_advantages": _LIST_F32}
    for name in extra:  # e.g. reward/<component>; SFT's response / media_png; a prompt's images
        dtype = known.get(name, pa.float64())
        schema = schema.append(pa.field(name, dtype))
    return rows_to_table(rows, schema)


def rows_to_table(rows: list[dict[str, Any]], schema: pa.Schema) -> pa.Table:
    """The table of `schema` from plain rows (a missing key is null; dict `metadata` is stored as JSON)."""
    columns = {}
    for field in schema:
        values = [r.get(field.name) for r in rows]
        if field.name == "metadata":
            values = [v if isinstance(v, str) else json.dumps(v or {}, sort_keys=True) for v in values]
        columns[field.name] = pa.array(values, type=field.type)
    return pa.Table.from_pydict(columns, schema=schema)


def to_ipc_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    with ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


def write_shard(storage: RunStorage, rel: str, table: pa.Table) -> dict[str, Any]:
    """Write one shard whole; returns its small manifest entry (path, rows)."""
    storage.write_bytes(rel, to_ipc_bytes(table))
    return {"path": rel, "rows": table.num_rows}


def read_shard(storage: RunStorage, rel: str, kind: str) -> pa.Table:
    """Open a shard (memory-mapped on local disk, so list columns read zero-copy) and check it."""
    where = storage.url(rel)
    try:
        if storage.local:
            source = pa.memory_map(storage.path(rel), "r")
        else:
            source = pa.py_buffer(storage.read_bytes(rel))
        table = ipc.open_file(source).read_all()
    except FileNotFoundError:
        raise ShardSchemaError(f"{where}: shard is missing; rerun the stage that writes it") from None
    except (pa.ArrowInvalid, OSError) as exc:
        raise ShardSchemaError(f"{where}: not an Arrow IPC file ({exc}); delete it and rerun the stage") from None
    validate(table, kind, where)
    return table


def validate(table: pa.Table, kind: str, where: str) -> None:
    """Check columns and types; name the file and the first bad column."""
    if kind == "rollouts":
        expected = dict(BASE_COLUMNS)
        for seg, columns in segment_columns().items():
            if seg in table.schema.names or any(n in table.schema.names for n in columns):
                expected.update(columns)
    else:
        expected = KINDS[kind]
    for name, dtype in expected.items():
        if name not in table.schema.names:
            raise ShardSchemaError(f"{where}: column {name!r} is missing (a {kind} shard needs {sorted(expected)})")
        actual = table.schema.field(name).type
        if actual != dtype:
            raise ShardSchemaError(f"{where}: column {name!r} has type {actual}, expected {dtype}")
    if kind == "rollouts" and "prompt_ids" in expected:
        ids = table.column("sample_id").to_pylist()
        for sid, resp, lps in zip(ids, table.column("response_ids").to_pylist(), table.column("response_logprobs").to_pylist()):
            if len(resp) != len(lps):
                raise ShardSchemaError(
                    f"{where}: sample {sid!r}: column 'response_logprobs' has {len(lps)} values for {len(resp)} response tokens"
                )
    if any(n in table.schema.names for n in IMAGE_COLUMNS):
        validate_images(table, where)
    if kind == "rollouts":
        validate_namespaced(table, where)
    version = (table.schema.metadata or {}).get(b"unirl.schema_version")
    if version is not None and int(version) > SCHEMA_VERSION:
        raise ShardSchemaError(f"{where}: schema version {int(version)} is newer than this unirl ({SCHEMA_VERSION}); upgrade")


# A composed row (a pipeline's rewrite, then its image) carries one segment per part, each under
# its part's name: `rewriter/response_ids`, `drawer/sigmas`, ..., with the part's own identity
# (`rewriter/sample_id`, `rewriter/group_id`, `rewriter/policy_version`, `rewriter/prompt`). Its
# base columns describe the row as a whole: `sample_id` and `group_id` are the last part's sample
# and the user's prompt group, `prompt` the user's prompt, `parts` the part names in order. The
# schema's `unirl.parts` metadata gives each part's segment kind.
NS = "/"
PART_COLUMNS: dict[str, pa.DataType] = {"sample_id": pa.string(), "group_id": pa.string(),
                                         "policy_version": pa.int32(), "prompt": pa.string()}
PARTS_KEY = b"unirl.parts"


def namespaced(part: str, column: str) -> str:
    return f"{part}{NS}{column}"


def composed_parts(table: pa.Table) -> list[str]:
    """The part names a composed shard namespaces, in order (empty for a one-part shard)."""
    out: list[str] = []
    for column in table.schema.names:
        if NS in column and (name := column.split(NS, 1)[0]) not in out:
            out.append(name)
    return out


def part_kinds(table: pa.Table, where: str) -> dict[str, str]:
    """Each part's segment kind, from the composed shard's schema."""
    raw = (table.schema.metadata or {}).get(PARTS_KEY)
    if raw is None:
        raise ShardSchemaError(f"{where}: a composed shard without its parts' kinds (schema metadata "
                               f"{PARTS_KEY.decode()}), as an older unirl wrote them; rerun the iteration's compose task")
    return {str(name): str(kind) for name, kind in json.loads(raw)}


def validate_namespaced(table: pa.Table, where: str) -> None:
    """Every namespaced segment of a composed shard complete and of its kind's types, and each
    row's `parts` naming exactly the parts it carries, in order."""
    names = composed_parts(table)
    if not names:
        return
    kinds = part_kinds(table, where)
    if list(kinds) != names:
        raise ShardSchemaError(f"{where}: the schema names the parts {list(kinds)}, but the columns carry {names}")
    for name, kind in kinds.items():
        if kind not in segment_columns():
            raise ShardSchemaError(f"{where}: part {name!r} is of kind {kind!r}, not one of {sorted(segment_columns())}")
        part = {**PART_COLUMNS, **segment_columns()[kind]}
        for column, dtype in part.items():
            col = namespaced(name, column)
            if col not in table.schema.names:
                raise ShardSchemaError(f"{where}: column {col!r} is missing (a composed shard's {kind} part {name!r} needs "
                                       f"{sorted(namespaced(name, n) for n in part)})")
            if table.schema.field(col).type != dtype:
                raise ShardSchemaError(f"{where}: column {col!r} has type {table.schema.field(col).type}, expected {dtype}")
    for sid, parts in zip(table.column("sample_id").to_pylist(), table.column("parts").to_pylist()):
        if list(parts or []) != names:
            raise ShardSchemaError(f"{where}: sample {sid!r}: column 'parts' is {parts}, but the shard carries the parts "
                                   f"{names}")


def composed_table(rows: list[dict[str, Any]], parts: list[tuple[str, str]]) -> pa.Table:
    """A composed rollouts shard from rows holding the base columns and, per part (name, segment
    kind), the part's identity and segment columns under its name."""
    fields = [pa.field(n, t) for n, t in BASE_COLUMNS.items()]
    for name, kind in parts:
        fields += [pa.field(namespaced(name, n), t) for n, t in {**PART_COLUMNS, **segment_columns()[kind]}.items()]
    schema = pa.schema(fields, metadata={"unirl.schema_version": str(SCHEMA_VERSION), "unirl.kind": "rollouts",
                                         PARTS_KEY.decode(): json.dumps([list(p) for p in parts])})
    return rows_to_table(rows, schema)


def part_view(table: pa.Table, name: str) -> pa.Table:
    """Part `name` of a composed shard as a one-part rollouts table (its own sample and group ids,
    segment columns without the namespace), one row per distinct part sample, in first-seen
    order; `metadata` comes along. A one-part shard is returned as it is."""
    names = composed_parts(table)
    if not names:
        return table
    if name not in names:
        raise ShardSchemaError(f"a composed shard of parts {names} has no part {name!r}")
    kind = part_kinds(table, "the composed shard")[name]
    ids = table.column(namespaced(name, "sample_id")).to_pylist()
    first = sorted({sid: i for i, sid in reversed(list(enumerate(ids)))}.values())
    taken = table.take(pa.array(first, type=pa.int64()))
    columns = {n: taken.column(namespaced(name, n)) for n in {**PART_COLUMNS, **segment_columns()[kind]}}
    columns.update(iteration=taken.column("iteration"), metadata=taken.column("metadata"),
                   parts=pa.array([[kind]] * taken.num_rows, type=pa.list_(pa.string())))
    return pa.table(columns)


def scoring_view(table: pa.Table) -> pa.Table:
    """What scorers and evaluation read of a composed shard: the row as a whole (its sample id,
    the user's prompt and metadata) with the un-namespaced segment columns of every part, later
    parts winning (the image of the last part is what is scored; the rewrite is `text`). A
    one-part shard is returned as it is."""
    names = composed_parts(table)
    if not names:
        return table
    columns = {n: table.column(n) for n in BASE_COLUMNS if n in table.schema.names}
    for name in names:
        for column in table.schema.names:
            base = column.split(NS, 1)[1] if column.startswith(name + NS) else None
            if base is not None and base not in PART_COLUMNS:
                columns[base] = table.column(column)
    return pa.table(columns)


def validate_images(table: pa.Table, where: str) -> None:
    """Both image columns, of their types, one (t, h, w) grid per image of every row."""
    for name, dtype in IMAGE_COLUMNS.items():
        if name not in table.schema.names:
            raise ShardSchemaError(f"{where}: column {name!r} is missing (a shard with prompt images needs "
                                   f"{sorted(IMAGE_COLUMNS)})")
        if table.schema.field(name).type != dtype:
            raise ShardSchemaError(f"{where}: column {name!r} has type {table.schema.field(name).type}, expected {dtype}")
    key = "sample_id" if "sample_id" in table.schema.names else "group_id" if "group_id" in table.schema.names else None
    ids = table.column(key).to_pylist() if key else [f"record {i + 1}" for i in range(table.num_rows)]
    for sid, images, grids in zip(ids, table.column("images").to_pylist(), table.column("image_grids").to_pylist()):
        if not images or grids is None or len(grids) != len(images) or any(g is None or len(g) != 3 for g in grids):
            raise ShardSchemaError(f"{where}: sample {sid!r}: column 'image_grids' must hold one (t, h, w) grid for "
                                   f"each of its {len(images or [])} images, got {grids}")


def list_column(table: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(values, offsets) of a list column as numpy views without copying (single-chunk tables):
    row i is values[offsets[i]:offsets[i+1]]."""
    col = table.column(name).combine_chunks()
    if col.null_count:
        raise ShardSchemaError(f"column {name!r} has null rows")
    offsets = col.offsets.to_numpy(zero_copy_only=False)
    values = col.values.to_numpy(zero_copy_only=True)
    return values[offsets[0]:offsets[-1]], offsets - offsets[0]


def metadata(table: pa.Table) -> list[dict[str, Any]]:
    return [json.loads(s) for s in table.column("metadata").to_pylist()]


def read_rollouts(storage: RunStorage, paths: list[str], columns: list[str] | None = None) -> pa.Table:
    """All rollout shards of an iteration as one table, sorted by sample_id; `columns`: only those
    of them the shards have (readers that do not need the latents skip copying them)."""
    tables = [read_shard(storage, p, "rollouts") for p in paths]
    if not tables:
        raise ShardSchemaError(f"{storage.url()}: no rollout shards given")
    table = pa.concat_tables(tables, promote_options="none")
    if columns is not None:  # a composed shard's namespaced columns go along with the ones asked for
        table = table.select([c for c in table.schema.names
                              if c in columns or c == "sample_id" or (NS in c and c.split(NS)[-1] in columns)])
    return table.sort_by("sample_id")


def join_on_sample_id(left: pa.Table, right: pa.Table, columns: list[str], where: str) -> pa.Table:
    """Add `columns` of `right` to `left`, matched by sample_id; every left row must match."""
    index = {sid: i for i, sid in enumerate(right.column("sample_id").to_pylist())}
    rows = []
    for sid in left.column("sample_id").to_pylist():
        if sid not in index:
            raise ShardSchemaError(f"{where}: no row for sample {sid!r}")
        rows.append(index[sid])
    taken = right.take(pa.array(rows, type=pa.int64()))
    for name in columns:
        left = left.append_column(name, taken.column(name))
    return left


def first_of_groups(groups: list[Any], n: int) -> list[int]:
    """The indices of the first `n` rows, the first row of every group before any second, so prompts vary."""
    first: list[int] = []
    rest: list[int] = []
    seen: set[Any] = set()
    for i, g in enumerate(groups):
        (rest if g in seen else first).append(i)
        seen.add(g)
    return (first + rest)[:n]

