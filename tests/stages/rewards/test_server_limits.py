"""Hostile and careless input to the reward server (issue 40): one real server on loopback answers
each request within its limits and in bounded memory, names the limit or the fault, and still
scores a normal request afterwards."""
from __future__ import annotations

import dataclasses
import io
import logging
import mmap
import os
import struct
import zlib
from pathlib import Path

import httpx
import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from tests.e2e.test_reward_server import launch, wait_ready
from unirl.flows.reward_server import main
from unirl.stages.rewards import ScoreBatch
from unirl.stages.rewards.client import RemoteScorer, RemoteScorerError
from unirl.stages.rewards.server import ConfigError, ScoringService, ServerConfig, _decode_and_score, resolve_token
from unirl.stages.rewards.wire import Limits, TooLarge, WireError, decode_batch, encode_batch

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]
TOKEN = "limits-token-1a2b3c4d"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MAX_ROWS = 50_000  # above the 40k rows of the duplicate test; every other limit is the default
TIMEOUT_S = 10.0
SCORERS = [{"name": "exact_match"}, {"name": "brightness"}]
GROWTH_BOUND = 64 << 20  # bytes the server's peak memory may grow by while it refuses a bomb


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("limits")
    env = {**os.environ, "UNIRL_REWARD_TOKEN": TOKEN, "PYTHONPATH": str(REPO)}
    started = launch("limits", {"scorers": SCORERS, "max_rows": MAX_ROWS, "timeout_s": TIMEOUT_S}, root, env)
    try:
        wait_ready(started)
        yield started
    finally:
        started.proc.terminate()
        started.proc.wait(timeout=30)


def stream(table: pa.Table, compression: str | None = None) -> bytes:
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema, options=pa.ipc.IpcWriteOptions(compression=compression)) as writer:
        writer.write_table(table)
    return sink.getvalue()


def post(server, body: bytes) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/score", content=body, headers=AUTH, timeout=60)


def normal_batch(metadata: tuple[dict, dict] = ({"answer": "4"}, {"answer": "4"})) -> ScoreBatch:
    white, black = Image.new("RGB", (8, 8), (255, 255, 255)), Image.new("RGB", (8, 8), (0, 0, 0))
    return ScoreBatch(["n/0", "n/1"], ["2+2?", "2+2?"], texts=["4", "5"], images=[white, black], metadata=list(metadata))


def assert_still_scores(server) -> None:
    """The hostile request left the server healthy: a normal one scores as computed by hand
    (exact_match [1, 0] + brightness of white and black [1, 0])."""
    response = post(server, encode_batch(normal_batch()))
    assert response.status_code == 200, response.text
    assert response.json()["total"] == [2.0, 0.0]


def peak_growth(server, request) -> tuple[httpx.Response, int]:
    """The answer to `request()` and how far the server's peak resident memory (VmHWM) rose over
    its resident memory before it; writing 5 to clear_refs resets the peak to the current size."""
    status = Path(f"/proc/{server.proc.pid}/status")

    def kib(field: str) -> int:
        return next(int(line.split()[1]) for line in status.read_text().splitlines() if line.startswith(field + ":"))

    Path(f"/proc/{server.proc.pid}/clear_refs").write_text("5")
    before = kib("VmRSS")
    response = request()
    return response, (kib("VmHWM") - before) * 1024


def zstd_bomb(size: int) -> bytes:
    """One row whose `text` is `size` zero bytes, zstd-compressed: a few KB on the wire."""
    zeros = pa.py_buffer(mmap.mmap(-1, size))
    text = pa.Array.from_buffers(pa.string(), 1, [None, pa.py_buffer(np.array([0, size], np.int32)), zeros])
    return stream(pa.table({"sample_id": ["a"], "prompt": ["p"], "text": text}), compression="zstd")


def blank_png(width: int, height: int) -> bytes:
    """A 1-bit grey PNG of zeros written row by row, so the test never holds its pixels."""
    row = b"\0" * (1 + (width + 7) // 8)  # filter byte + packed bits
    packer = zlib.compressobj(9)
    idat = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


# ---- duplicates: found in linear time ----

def test_a_duplicate_among_40k_sample_ids_is_named_within_the_timeout(server):
    """The old check counted every id against every other: with 40k rows it ran past timeout_s
    and answered 504 instead of naming the duplicate."""
    ids = [f"g/{i}" for i in range(40_000)]
    ids[-1] = ids[-2]  # the duplicate comes last, the worst case for a quadratic scan
    response = post(server, stream(pa.table({"sample_id": ids, "prompt": ["p"] * len(ids)})))
    assert response.status_code == 400, response.text
    assert response.json()["error"] == "malformed request: sample_id 'g/39998' appears more than once"
    assert_still_scores(server)


# ---- sizes: bounded before the memory is taken ----

def test_more_rows_than_max_rows_is_413_naming_the_limit(server):
    n = MAX_ROWS + 1
    response = post(server, stream(pa.table({"sample_id": [str(i) for i in range(n)], "prompt": ["p"] * n})))
    assert response.status_code == 413, response.text
    assert f"over the limit `max_rows: {MAX_ROWS}`" in response.json()["error"]
    assert_still_scores(server)


def test_a_zstd_bomb_is_refused_in_bounded_memory(server):
    size = 300 << 20  # past max_decoded_bytes (256 MiB) once decompressed
    body = zstd_bomb(size)
    assert len(body) < 64 << 10
    response, growth = peak_growth(server, lambda: post(server, body))
    assert response.status_code == 413, response.text
    assert f"over the limit `max_decoded_bytes: {Limits.max_decoded_bytes}`" in response.json()["error"]
    assert growth < GROWTH_BOUND, f"the server's peak memory grew by {growth >> 20} MiB"
    assert_still_scores(server)


def test_a_png_bomb_is_refused_before_decoding_in_bounded_memory(server):
    """Nine 4000x4000 PNGs of 2 KB each: 144M pixels, past max_pixels (2**27), 576 MB as PIL RGB."""
    png = blank_png(4000, 4000)
    body = stream(pa.table({"sample_id": [f"s{i}" for i in range(9)], "prompt": ["p"] * 9, "text": ["4"] * 9,
                            "image": [png] * 9, "metadata": ['{"answer": "4"}'] * 9}))
    assert len(body) < 64 << 10
    response, growth = peak_growth(server, lambda: post(server, body))
    assert response.status_code == 413, response.text
    assert response.json()["error"].startswith("request too large: image of sample 's8' (4000x4000) brings the request to "
                                               "144000000 pixels: over the limit `max_pixels: 134217728`")
    assert growth < GROWTH_BOUND, f"the server's peak memory grew by {growth >> 20} MiB"
    assert_still_scores(server)


def test_images_no_scorer_reads_are_not_decoded():
    """A server of text scorers answers a request whose image column would not even decode."""
    service = ScoringService(ServerConfig(scorers=[{"name": "exact_match"}]))
    assert service.reads == {"text"}
    body = stream(pa.table({"sample_id": ["a"], "prompt": ["p"], "text": ["4"], "image": [b"\x89PNG broken"],
                            "metadata": ['{"answer": "4"}']}))
    assert _decode_and_score(service, body)["total"] == [1.0]
    with pytest.raises(WireError, match="image of sample 'a' is not a decodable image"):
        decode_batch(body)


@pytest.mark.parametrize("limits, table, message", [
    (Limits(max_images=3), pa.table({"sample_id": ["a", "b"], "prompt": ["p", "q"],
                                     "video": pa.array([[b"f"] * 2, [b"f"] * 2], pa.list_(pa.binary()))}),
     "4 images and video frames: over the limit `max_images: 3`"),
    (Limits(max_metadata_bytes=20), pa.table({"sample_id": ["a", "b"], "prompt": ["p", "q"],
                                              "metadata": ['{"answer": "12345"}', '{"answer": "6"}']}),
     "metadata of 34 bytes: over the limit `max_metadata_bytes: 20`"),
    (Limits(max_pixels=99), pa.table({"sample_id": ["a"], "prompt": ["p"], "image": [blank_png(10, 10)]}),
     r"image of sample 'a' \(10x10\) brings the request to 100 pixels: over the limit `max_pixels: 99`"),
])
def test_each_size_limit_refuses_before_decoding(limits, table, message):
    with pytest.raises(TooLarge, match=message):
        decode_batch(stream(table), limits)


# ---- the client's faults are 400s, not retried ----

def test_input_a_scorer_cannot_score_is_400_and_not_retried(server, caplog):
    batch = normal_batch(metadata=({"answer": "4"}, {}))
    response = post(server, encode_batch(batch))
    assert response.status_code == 400, response.text
    assert response.json() == {"error": "scorer 'exact_match' failed: ValueError: sample 'n/1' has no 'answer' metadata",
                               "scorer": "exact_match"}
    remote = RemoteScorer(server.url, token=TOKEN, attempts=3, backoff_s=0.05)
    with caplog.at_level(logging.WARNING, logger="unirl.stages.rewards.client"):
        with pytest.raises(RemoteScorerError, match="refused the request: HTTP 400: scorer 'exact_match' failed"):
            remote(batch)
    assert not [r for r in caplog.records if "retrying" in r.getMessage()]
    assert_still_scores(server)


def test_deeply_nested_metadata_is_400_naming_the_limit(server):
    """100,000 levels used to blow the JSON parser's recursion limit: an internal error, a 500."""
    deep = '{"answer": ' + "[" * 100_000 + "]" * 100_000 + "}"
    response = post(server, stream(pa.table({"sample_id": ["a"], "prompt": ["p"], "metadata": [deep]})))
    assert response.status_code == 400, response.text
    assert "over the limit `max_metadata_depth: 32`" in response.json()["error"]
    shallow = '{"answer": ' + "[" * 40 + "]" * 40 + "}"
    response = post(server, stream(pa.table({"sample_id": ["a"], "prompt": ["p"], "metadata": [shallow]})))
    assert response.status_code == 400 and "nested more than 32 levels deep" in response.json()["error"]
    assert_still_scores(server)


def test_malformed_arrow_is_400_not_500(server):
    """A string column of invalid UTF-8 used to fail while being read into Python: a 500."""
    prompt = pa.Array.from_buffers(pa.string(), 1, [None, pa.py_buffer(np.array([0, 2], np.int32)), pa.py_buffer(b"\xff\xfe")])
    response = post(server, stream(pa.table({"sample_id": ["a"], "prompt": prompt})))
    assert response.status_code == 400, response.text
    assert "not a readable Arrow IPC stream: In column 1: Invalid: Invalid UTF8" in response.json()["error"]
    assert_still_scores(server)


# ---- no token off loopback unless asked for ----

def test_auth_off_on_a_non_loopback_host_refuses_to_start(tmp_path, capsys):
    config = tmp_path / "open.yaml"
    config.write_text("scorers: [{name: constant}]\nauth: false\nhost: 192.0.2.1\n")
    assert main(["--config", str(config)]) == 2
    assert "auth: false with host 192.0.2.1" in capsys.readouterr().err
    for host in ("127.0.0.1", "localhost", "::1"):
        assert resolve_token(ServerConfig(scorers=[{"name": "constant"}], auth=False, host=host)) is None


def test_insecure_allows_it_with_a_loud_warning(caplog):
    config = ServerConfig(scorers=[{"name": "constant"}], auth=False, host="0.0.0.0", insecure=True)
    with caplog.at_level(logging.WARNING, logger="unirl.stages.rewards.server"):
        assert resolve_token(config) is None
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and record.getMessage().startswith("INSECURE: auth is off and the server binds 0.0.0.0")
    with pytest.raises(ConfigError, match="set `insecure: true`"):
        resolve_token(config.model_copy(update={"insecure": False}))


def test_every_limit_is_a_documented_config_field():
    docs = (REPO / "docs" / "rewards.md").read_text()
    limits = docs[docs.index("### Limits"):]
    for field in [f.name for f in dataclasses.fields(Limits)] + ["max_body_bytes", "insecure"]:
        spec = ServerConfig.model_fields[field]
        assert spec.description, field
        assert f"`{field}`" in limits, f"docs/rewards.md, Limits: no `{field}`"
