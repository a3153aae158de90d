"""The reward service's wire format, shared by `server` and `client`.

Request body: one Arrow IPC *stream* (not the IPC file format), media type
`application/vnd.apache.arrow.stream`, any number of record batches, one row per sample:

    sample_id      string          required, unique, non-null
    prompt         string          required, non-null
    text           string          optional: decoded response
    image          binary          optional: encoded image (PNG; anything Pillow opens is accepted)
    video          list<binary>    optional: encoded frames, in order, at least one per sample
    metadata       string          optional: a JSON object per sample (null means {})
    finish_reason  string          optional

(`large_string` / `large_binary` / `large_list` are accepted too.) An optional column, once
present, must be non-null in every row. Any other column is an error, so a typo is not ignored.

Response body (JSON), all lists aligned with `sample_ids` (the request's order):

    {"sample_ids": [...], "total": [...], "components": {"<scorer>": [...],
     "<scorer>/<component>": [...]}, "aggregation": "weighted_sum"}
"""
from __future__ import annotations

import io
import json
from typing import Any

import numpy as np
import pyarrow as pa

from unirl.stages.rewards.base import ScoreBatch, ScoreResult

CONTENT_TYPE = "application/vnd.apache.arrow.stream"
REQUIRED = ("sample_id", "prompt")
OPTIONAL = ("text", "image", "video", "metadata", "finish_reason")
_FILE_MAGIC = b"ARROW1"


class WireError(ValueError):
    """A request body that is not a valid score request; the message names the problem."""


def _encode_image(image: Any) -> bytes:
    if isinstance(image, (bytes, bytearray)):
        return bytes(image)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def encode_batch(batch: ScoreBatch) -> bytes:
    """ScoreBatch -> Arrow IPC stream bytes. Images/frames may be PIL images or encoded bytes."""
    columns: dict[str, pa.Array] = {
        "sample_id": pa.array(batch.sample_ids, pa.string()),
        "prompt": pa.array(batch.prompts, pa.string()),
    }
    if batch.texts is not None:
        columns["text"] = pa.array(batch.texts, pa.string())
    if batch.images is not None:
        columns["image"] = pa.array([_encode_image(im) for im in batch.images], pa.binary())
    if batch.videos is not None:
        frames = [[_encode_image(f) for f in video] for video in batch.videos]
        columns["video"] = pa.array(frames, pa.list_(pa.binary()))
    if any(batch.metadata):
        columns["metadata"] = pa.array([json.dumps(m) for m in batch.metadata], pa.string())
    if batch.finish_reasons is not None:
        columns["finish_reason"] = pa.array(batch.finish_reasons, pa.string())
    table = pa.table(columns)
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


def _read_table(body: bytes) -> pa.Table:
    if not body:
        raise WireError("empty body: send an Arrow IPC stream with columns sample_id, prompt, ...")
    if body[:6] == _FILE_MAGIC:
        raise WireError("body is in the Arrow IPC file format; send the Arrow IPC stream format")
    try:
        return pa.ipc.open_stream(pa.py_buffer(body)).read_all()
    except (pa.ArrowInvalid, pa.ArrowTypeError, OSError) as exc:
        raise WireError(f"body is not a readable Arrow IPC stream: {exc}") from exc


def _check_type(name: str, typ: pa.DataType) -> None:
    def is_str(t: pa.DataType) -> bool:
        return pa.types.is_string(t) or pa.types.is_large_string(t)

    def is_bin(t: pa.DataType) -> bool:
        return pa.types.is_binary(t) or pa.types.is_large_binary(t)

    if name == "image":
        ok, want = is_bin(typ), "binary"
    elif name == "video":
        is_list = pa.types.is_list(typ) or pa.types.is_large_list(typ)
        ok, want = is_list and is_bin(typ.value_type), "list<binary>"
    else:
        ok, want = is_str(typ), "string"
    if not ok:
        raise WireError(f"column {name!r} has type {typ}, expected {want}")


def _decode_image(data: bytes, where: str) -> Any:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            return im.convert("RGB")
    except Exception as exc:  # noqa: BLE001 - Pillow raises many types for bad data
        raise WireError(f"{where} is not a decodable image: {type(exc).__name__}: {exc}") from exc


def decode_batch(body: bytes) -> ScoreBatch:
    """Arrow IPC stream bytes -> ScoreBatch (images decoded to RGB PIL). Raises WireError."""
    table = _read_table(body)
    names = table.column_names
    unknown = sorted(set(names) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise WireError(
            f"unknown column(s) {unknown}; allowed: {', '.join(REQUIRED + OPTIONAL)}"
        )
    for name in REQUIRED:
        if name not in names:
            raise WireError(f"missing required column {name!r} (columns present: {names})")
    if table.num_rows == 0:
        raise WireError("the request has no rows")
    for name in names:
        _check_type(name, table.schema.field(name).type)
        column = table.column(name)
        if column.null_count:
            row = next(i for i, v in enumerate(column.is_null().to_pylist()) if v)
            raise WireError(f"column {name!r} is null in row {row}")
    cols = {name: table.column(name).to_pylist() for name in names}
    ids: list[str] = cols["sample_id"]
    if len(set(ids)) != len(ids):
        dup = next(s for s in ids if ids.count(s) > 1)
        raise WireError(f"sample_id {dup!r} appears more than once")

    metadata: list[dict[str, Any]] = []
    for sid, raw in zip(ids, cols.get("metadata", [None] * len(ids))):
        try:
            meta = json.loads(raw) if raw is not None else {}
        except json.JSONDecodeError as exc:
            raise WireError(f"metadata of sample {sid!r} is not JSON: {exc}") from exc
        if not isinstance(meta, dict):
            raise WireError(f"metadata of sample {sid!r} is a {type(meta).__name__}, not an object")
        metadata.append(meta)
    images = videos = None
    if "image" in cols:
        images = [_decode_image(d, f"image of sample {s!r}") for s, d in zip(ids, cols["image"])]
    if "video" in cols:
        videos = []
        for sid, frames in zip(ids, cols["video"]):
            if not frames:
                raise WireError(f"video of sample {sid!r} has no frames")
            videos.append([_decode_image(f, f"video frame {k} of sample {sid!r}") for k, f in enumerate(frames)])
    return ScoreBatch(
        sample_ids=ids,
        prompts=cols["prompt"],
        texts=cols.get("text"),
        images=images,
        videos=videos,
        metadata=metadata,
        finish_reasons=cols.get("finish_reason"),
    )


def result_to_json(sample_ids: list[str], result: ScoreResult, aggregation: str) -> dict[str, Any]:
    """The response body. Floats are written with repr precision, so they round-trip exactly."""
    return {
        "sample_ids": sample_ids,
        "total": [float(x) for x in result.scores],
        "components": {k: [float(x) for x in v] for k, v in result.components.items()},
        "aggregation": aggregation,
    }


def result_from_json(payload: dict[str, Any], sample_ids: list[str]) -> ScoreResult:
    """Parse a response body and check it answers exactly `sample_ids`, in order."""
    got = payload.get("sample_ids")
    if got != sample_ids:
        raise WireError(f"response answers sample_ids {got!r:.200}, expected {sample_ids!r:.200}")
    n = len(sample_ids)
    arrays = {"total": payload.get("total")}
    arrays.update({f"component {k!r}": v for k, v in payload.get("components", {}).items()})
    for label, values in arrays.items():
        if not isinstance(values, list) or len(values) != n:
            raise WireError(f"response {label} is not a list of {n} numbers")
    components = {k: np.asarray(v, dtype=np.float64) for k, v in payload.get("components", {}).items()}
    return ScoreResult(np.asarray(payload["total"], dtype=np.float64), components)
