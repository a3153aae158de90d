"""The reward service's wire format, shared by `server` and `client`.

Request body: one Arrow IPC *stream* (not the IPC file format), media type
`application/vnd.apache.arrow.stream`, any number of record batches, one row per sample:

    sample_id      string          required, unique, non-null
    prompt         string          required, non-null
    text           string          optional: decoded response
    image          binary          optional: encoded image (PNG; anything Pillow opens is accepted)
    video          list<binary>    optional: encoded frames, in order, at least one per sample
    metadata       string          optional: a JSON object per sample (null means {})
    transcript     string          optional: an agent's trajectory per sample, a JSON list of turns
                                   ({"role", "text", "tool", "arguments", "result", "error"})
    finish_reason  string          optional

(`large_string` / `large_binary` / `large_list` are accepted too.) An optional column, once
present, must be non-null in every row. Any other column is an error, so a typo is not ignored.

What a request may expand to is bounded by `Limits` (the reward server's config fields of the same
names), each checked before the memory it guards is taken: rows and decompressed Arrow bytes from
each record batch's header, images and pixels from each image's header, metadata by its bytes and
nesting. Over a size limit is `TooLarge` (HTTP 413), any other problem `WireError` (HTTP 400).

Response body (JSON), all lists aligned with `sample_ids` (the request's order):

    {"sample_ids": [...], "total": [...], "components": {"<scorer>": [...],
     "<scorer>/<component>": [...]}, "aggregation": "weighted_sum"}
"""
from __future__ import annotations

import io
import json
import struct
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from unirl.stages.rewards.base import ScoreBatch, ScoreResult

CONTENT_TYPE = "application/vnd.apache.arrow.stream"
REQUIRED = ("sample_id", "prompt")
OPTIONAL = ("text", "image", "video", "metadata", "transcript", "finish_reason")
_FILE_MAGIC = b"ARROW1"


class WireError(ValueError):
    """A request body that is not a valid score request; the message names the problem."""


class TooLarge(WireError):
    """A request over one of the server's limits; the message names the limit's config field."""

    def __init__(self, what: str, field: str, limit: int) -> None:
        super().__init__(f"{what}: over the limit `{field}: {limit}` of the reward server config")
        self.field = field


@dataclass(frozen=True)
class Limits:
    """What one request may expand to once decoded (defaults of the reward server's config fields)."""

    max_rows: int = 4096                    # samples
    max_decoded_bytes: int = 256 * 2**20    # Arrow buffers after decompression
    max_images: int = 65536                 # images plus video frames
    max_pixels: int = 2**27                 # width * height summed over images and video frames
    max_metadata_bytes: int = 16 * 2**20    # metadata JSON, all samples together (and transcripts JSON, so)
    max_metadata_depth: int = 32            # nesting of one sample's metadata (and transcript)


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
    if batch.transcripts is not None:
        columns["transcript"] = pa.array([json.dumps(t) for t in batch.transcripts], pa.string())
    if batch.finish_reasons is not None:
        columns["finish_reason"] = pa.array(batch.finish_reasons, pa.string())
    table = pa.table(columns)
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


# Reading the record batch header fields the limits need (Arrow's format/Message.fbs; Arrow has
# verified the flatbuffer by then). A flatbuffer table starts with the signed offset back to its
# vtable, whose uint16 entries (after its own size and the table's) are the fields' offsets inside
# the table, 0 for an absent field; a table or vector field holds the uint32 offset to it.
_U16, _U32, _I32, _I64 = (struct.Struct(f) for f in ("<H", "<I", "<i", "<q"))
_FB_MESSAGE_HEADER, _FB_BATCH_LENGTH, _FB_BATCH_BUFFERS, _FB_BATCH_COMPRESSION = 2, 0, 2, 3


def _fb_field(fb: bytes, table: int, index: int) -> int | None:
    vtable = table - _I32.unpack_from(fb, table)[0]
    entry = 4 + 2 * index
    if entry >= _U16.unpack_from(fb, vtable)[0]:
        return None
    offset = _U16.unpack_from(fb, vtable + entry)[0]
    return table + offset if offset else None


def _fb_deref(fb: bytes, at: int) -> int:
    return at + _U32.unpack_from(fb, at)[0]


def _record_batch_size(message: pa.ipc.Message) -> tuple[int, int]:
    """(rows, bytes) a record batch message decodes to, read from its header before Arrow allocates
    anything: the rows are the header's `length`; the bytes sum its buffers, each either stored
    as is or compressed (LZ4 / ZSTD) behind the int64 length it decompresses to (-1: not compressed)."""
    fb, body = message.metadata.to_pybytes(), memoryview(message.body)
    header = _fb_field(fb, _U32.unpack_from(fb, 0)[0], _FB_MESSAGE_HEADER)
    if header is None:
        raise WireError("a record batch message has no header")
    batch = _fb_deref(fb, header)
    rows_at = _fb_field(fb, batch, _FB_BATCH_LENGTH)
    rows = 0 if rows_at is None else _I64.unpack_from(fb, rows_at)[0]
    if rows < 0:
        raise WireError(f"a record batch declares {rows} rows")
    compressed = _fb_field(fb, batch, _FB_BATCH_COMPRESSION) is not None
    buffers = _fb_field(fb, batch, _FB_BATCH_BUFFERS)
    if buffers is None:
        return rows, 0
    vector = _fb_deref(fb, buffers)
    size = 0
    for k in range(_U32.unpack_from(fb, vector)[0]):
        offset, stored = struct.unpack_from("<qq", fb, vector + 4 + 16 * k)
        if offset < 0 or stored < 0 or offset + stored > len(body):
            raise WireError(f"record batch buffer {k} lies outside the message body")
        if not compressed or stored == 0:
            size += stored
            continue
        if stored < 8:
            raise WireError(f"compressed record batch buffer {k} has no length prefix")
        declared = _I64.unpack_from(body, offset)[0]
        if declared < -1:
            raise WireError(f"compressed record batch buffer {k} declares {declared} bytes")
        size += stored - 8 if declared == -1 else declared
    return rows, size


def _read_table(body: bytes, limits: Limits) -> pa.Table:
    """The body's columns, read one record batch at a time: the schema is checked before any
    batch, and each batch's rows and decompressed bytes count against the limits before it is read."""
    if not body:
        raise WireError("empty body: send an Arrow IPC stream with columns sample_id, prompt, ...")
    if body[:6] == _FILE_MAGIC:
        raise WireError("body is in the Arrow IPC file format; send the Arrow IPC stream format")
    try:
        reader = pa.ipc.MessageReader.open_stream(pa.py_buffer(body))
        first = next(iter(reader), None)
        if first is None or first.type != "schema":
            raise WireError("body does not start with an Arrow schema message")
        schema = pa.ipc.read_schema(first)
        _check_schema(schema)
        batches, rows, size = [], 0, 0
        for message in reader:
            if message.type != "record batch":
                raise WireError(f"unexpected Arrow IPC message {message.type!r}: send record batches only")
            batch_rows, batch_size = _record_batch_size(message)
            rows, size = rows + batch_rows, size + batch_size
            if rows > limits.max_rows:
                raise TooLarge(f"at least {rows} rows", "max_rows", limits.max_rows)
            if size > limits.max_decoded_bytes:
                raise TooLarge(f"at least {size} bytes of Arrow data once decompressed", "max_decoded_bytes",
                               limits.max_decoded_bytes)
            batch = pa.ipc.read_record_batch(message, schema)
            batch.validate(full=True)  # offsets inside their buffers, valid UTF-8
            batches.append(batch)
    except (pa.ArrowException, OSError, struct.error) as exc:
        raise WireError(f"body is not a readable Arrow IPC stream: {exc}") from exc
    return pa.Table.from_batches(batches, schema)


def _check_schema(schema: pa.Schema) -> None:
    names = schema.names
    unknown = sorted(set(names) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise WireError(
            f"unknown column(s) {unknown}; allowed: {', '.join(REQUIRED + OPTIONAL)}"
        )
    for name in REQUIRED:
        if name not in names:
            raise WireError(f"missing required column {name!r} (columns present: {names})")
    if len(set(names)) != len(names):
        raise WireError(f"a column appears twice (columns present: {names})")
    for field in schema:
        _check_type(field.name, field.type)


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


def _image_size(data: bytes, where: str, max_pixels: int) -> tuple[int, int]:
    """(width, height) from the image's header: Image.open reads no further."""
    from PIL import Image  # start-up time: PIL loads on first use, not when a recipe is read

    try:
        with Image.open(io.BytesIO(data)) as im:
            return im.size
    except Image.DecompressionBombError as exc:  # Pillow's own guard, past twice its MAX_IMAGE_PIXELS
        raise TooLarge(f"{where}: {exc}", "max_pixels", max_pixels) from exc
    except Exception as exc:  # noqa: BLE001 - Pillow raises many types for bad data
        raise WireError(f"{where} is not a decodable image: {type(exc).__name__}: {exc}") from exc


def _decode_image(data: bytes, where: str) -> Any:
    from PIL import Image  # start-up time: PIL loads on first use, not when a recipe is read

    try:
        with Image.open(io.BytesIO(data)) as im:
            return im.convert("RGB")
    except Exception as exc:  # noqa: BLE001 - Pillow raises many types for bad data
        raise WireError(f"{where} is not a decodable image: {type(exc).__name__}: {exc}") from exc


def _json_depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0, {} and [] are 1), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth + 1)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _json_column(ids: list[str], column: pa.ChunkedArray, limits: Limits, what: str, kind: type) -> list[Any]:
    """Each sample's JSON value of `column` (a `kind`: dict or list), bounded by the metadata limits."""
    size = pc.sum(pc.binary_length(column)).as_py() or 0
    if size > limits.max_metadata_bytes:
        raise TooLarge(f"{what} of {size} bytes", "max_metadata_bytes", limits.max_metadata_bytes)
    values: list[Any] = []
    for sid, raw in zip(ids, column.to_pylist()):
        try:
            value = json.loads(raw)
            deep = _json_depth(value) > limits.max_metadata_depth
        except json.JSONDecodeError as exc:
            raise WireError(f"{what} of sample {sid!r} is not JSON: {exc}") from exc
        except RecursionError:  # deeper than the interpreter's recursion limit
            deep = True
        if deep:
            raise WireError(f"{what} of sample {sid!r} is nested more than {limits.max_metadata_depth} levels deep: "
                            f"over the limit `max_metadata_depth: {limits.max_metadata_depth}` of the reward server config")
        if not isinstance(value, kind):
            raise WireError(f"{what} of sample {sid!r} is a {type(value).__name__}, not {'an object' if kind is dict else 'a list'}")
        values.append(value)
    return values


def _metadata(ids: list[str], column: pa.ChunkedArray | None, limits: Limits) -> list[dict[str, Any]]:
    return [{} for _ in ids] if column is None else _json_column(ids, column, limits, "metadata", dict)


def _transcripts(ids: list[str], column: pa.ChunkedArray, limits: Limits) -> list[list[dict[str, Any]]]:
    transcripts = _json_column(ids, column, limits, "transcript", list)
    for sid, turns in zip(ids, transcripts):
        bad = next((k for k, t in enumerate(turns) if not isinstance(t, dict) or not isinstance(t.get("role"), str)), None)
        if bad is not None:
            raise WireError(f"transcript of sample {sid!r}: turn {bad} is not an object with a `role`")
    return transcripts


def decode_batch(body: bytes, limits: Limits = Limits(), reads: Collection[str] | None = None) -> ScoreBatch:
    """Arrow IPC stream bytes -> ScoreBatch (images decoded to RGB PIL). Raises WireError, TooLarge
    past a limit. `reads`: the media the scorers read (base.scorer_reads); an image or video column
    outside it is checked but not decoded, and left None. None: decode every column."""
    table = _read_table(body, limits)
    names = table.column_names
    if table.num_rows == 0:
        raise WireError("the request has no rows")
    for name in names:
        column = table.column(name)
        if column.null_count:
            row = next(i for i, v in enumerate(column.is_null().to_pylist()) if v)
            raise WireError(f"column {name!r} is null in row {row}")
    ids: list[str] = table.column("sample_id").to_pylist()
    seen: set[str] = set()
    for sid in ids:
        if sid in seen:
            raise WireError(f"sample_id {sid!r} appears more than once")
        seen.add(sid)

    def strings(name: str) -> list[str] | None:
        return table.column(name).to_pylist() if name in names else None

    def wanted(name: str) -> bool:
        return name in names and (reads is None or name in reads)

    metadata = _metadata(ids, table.column("metadata") if "metadata" in names else None, limits)
    # Images and frames are counted, then their headers' pixels summed, before any is decoded.
    frames = 0
    if wanted("video"):
        frames = pc.sum(pc.list_value_length(table.column("video"))).as_py() or 0
    count = (len(ids) if wanted("image") else 0) + frames
    if count > limits.max_images:
        raise TooLarge(f"{count} images and video frames", "max_images", limits.max_images)
    image_data = table.column("image").to_pylist() if wanted("image") else []
    video_data = table.column("video").to_pylist() if wanted("video") else []
    media = [(data, f"image of sample {sid!r}") for sid, data in zip(ids, image_data)]
    for sid, video in zip(ids, video_data):
        if not video:
            raise WireError(f"video of sample {sid!r} has no frames")
        media += [(data, f"video frame {k} of sample {sid!r}") for k, data in enumerate(video)]
    pixels = 0
    for data, where in media:
        width, height = _image_size(data, where, limits.max_pixels)
        pixels += width * height
        if pixels > limits.max_pixels:
            raise TooLarge(f"{where} ({width}x{height}) brings the request to {pixels} pixels", "max_pixels", limits.max_pixels)
    decoded = iter([_decode_image(data, where) for data, where in media])
    images = [next(decoded) for _ in image_data] if wanted("image") else None
    videos = [[next(decoded) for _ in video] for video in video_data] if wanted("video") else None
    return ScoreBatch(
        sample_ids=ids,
        prompts=table.column("prompt").to_pylist(),
        texts=strings("text"),
        images=images,
        videos=videos,
        metadata=metadata,
        transcripts=_transcripts(ids, table.column("transcript"), limits) if wanted("transcript") else None,
        finish_reasons=strings("finish_reason"),
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
