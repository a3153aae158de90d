import io

import numpy as np
import pyarrow as pa
import pytest

from tests.tiny_reward_models import random_images
from unirl.stages.rewards import ScoreBatch, ScoreResult
from unirl.stages.rewards.wire import WireError, decode_batch, encode_batch, result_from_json, result_to_json


def stream(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


def test_round_trip_keeps_every_field_and_pixel():
    images = random_images(3, seed=1)
    batch = ScoreBatch(
        sample_ids=["g/0", "g/1", "h/0"], prompts=["a", "b", 'say "hi"'], texts=["x", "", "z"],
        images=images, videos=[images, images[:1], images[1:]],
        metadata=[{"answer": 3}, {}, {"tags": ["a"]}], finish_reasons=["stop", "length", "stop"],
    )
    back = decode_batch(encode_batch(batch))
    assert back.sample_ids == batch.sample_ids and back.prompts == batch.prompts
    assert back.texts == batch.texts and back.metadata == batch.metadata
    assert back.finish_reasons == batch.finish_reasons
    for got, want in zip(back.images, images):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert [len(v) for v in back.videos] == [3, 1, 2]
    np.testing.assert_array_equal(np.asarray(back.videos[2][1]), np.asarray(images[2]))


def test_minimal_batch_has_no_optional_fields():
    back = decode_batch(encode_batch(ScoreBatch(["a"], ["p"])))
    assert back.texts is None and back.images is None and back.videos is None
    assert back.metadata == [{}]


@pytest.mark.parametrize(
    "table, message",
    [
        (pa.table({"sample_id": ["a"]}), "missing required column 'prompt'"),
        (pa.table({"sample_id": ["a"], "prompt": ["p"], "images": [b"x"]}), r"unknown column\(s\) \['images'\]"),
        (pa.table({"sample_id": [1], "prompt": ["p"]}), "column 'sample_id' has type int64, expected string"),
        (pa.table({"sample_id": ["a", None], "prompt": ["p", "q"]}), "column 'sample_id' is null in row 1"),
        (pa.table({"sample_id": ["a", "a"], "prompt": ["p", "q"]}), "sample_id 'a' appears more than once"),
        (pa.table({"sample_id": ["a"], "prompt": ["p"], "image": [b"not a png"]}), "image of sample 'a' is not a decodable image"),
        (pa.table({"sample_id": ["a"], "prompt": ["p"], "video": pa.array([[]], pa.list_(pa.binary()))}), "video of sample 'a' has no frames"),
        (pa.table({"sample_id": ["a"], "prompt": ["p"], "metadata": ["[1]"]}), "metadata of sample 'a' is a list"),
        (pa.table({"sample_id": ["a"], "prompt": ["p"], "metadata": ["{"]}), "metadata of sample 'a' is not JSON"),
        (pa.table({"sample_id": pa.array([], pa.string()), "prompt": pa.array([], pa.string())}), "no rows"),
    ],
)
def test_malformed_tables_name_the_problem(table, message):
    with pytest.raises(WireError, match=message):
        decode_batch(stream(table))


def test_not_a_stream():
    with pytest.raises(WireError, match="not a readable Arrow IPC stream"):
        decode_batch(b"{\"sample_id\": [1]}")
    with pytest.raises(WireError, match="empty body"):
        decode_batch(b"")
    sink = io.BytesIO()
    table = pa.table({"sample_id": ["a"], "prompt": ["p"]})
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    with pytest.raises(WireError, match="IPC file format; send the Arrow IPC stream format"):
        decode_batch(sink.getvalue())


def test_response_round_trip_is_exact_and_checked():
    result = ScoreResult(np.array([0.1, 1 / 3]), {"clip": np.array([2 / 7, -1e-300])})
    payload = result_to_json(["a", "b"], result, "mean")
    back = result_from_json(payload, ["a", "b"])
    np.testing.assert_array_equal(back.scores, result.scores)
    np.testing.assert_array_equal(back.components["clip"], result.components["clip"])
    with pytest.raises(WireError, match="expected"):
        result_from_json(payload, ["b", "a"])
    payload["components"]["clip"] = [1.0]
    with pytest.raises(WireError, match="component 'clip' is not a list of 2 numbers"):
        result_from_json(payload, ["a", "b"])
