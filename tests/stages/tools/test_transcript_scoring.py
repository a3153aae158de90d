"""Scorers that read an agent's transcript (issue 37, "scorers may read tool results"): the rows an
agentic generate writes carry the trajectory, the scoring task hands it to a scorer that reads
"transcript" (and only then), the reward server's wire carries it bounded like metadata, and
validate refuses such a scorer in a run without an `agent` section."""
from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pytest

from unirl.stages.rewards.base import build_scorer
from unirl.stages.rewards.wire import Limits, TooLarge, WireError, decode_batch, encode_batch
from unirl.stages.tools.agent import Trajectory, Turn, training_row


def trajectory(sid: str, calls: list[str | None], answer: str) -> Trajectory:
    """A trajectory with one tool turn per entry of `calls` (None: answered; a string: its error)."""
    traj = Trajectory(sid, "g", "abc+dfe=", {"answer": 7}, [1, 2, 3])
    for k, error in enumerate(calls):
        traj.turns.append(Turn(len(traj.turns), "assistant", [4, 5], [-0.5, -0.25], f"call {k}"))
        traj.turns.append(Turn(len(traj.turns), "tool", [6], [0.0], "<tool_response>", tool="lookup",
                               arguments=json.dumps({"key": "abc"}), result=None if error else "3", error=error))
    traj.turns.append(Turn(len(traj.turns), "assistant", [7], [-0.1], answer))
    traj.stop_reason = "answered"
    return traj


def rows() -> pa.Table:
    from unirl.stages.runtime.sample import table_from_rows

    trajs = [trajectory("g/0", [None, None], "7"), trajectory("g/1", [None, "tool 'lookup' timed out after 5 s"], "8"),
             trajectory("g/2", [], "9")]
    return table_from_rows([{**training_row(t), "iteration": 0, "parts": ["text"]} for t in trajs], "rollouts", ["text"])


def test_the_scoring_task_hands_a_transcript_reader_the_trajectories():
    from unirl.stages.run.iteration import SCORED_COLUMNS, reads, score_batch

    table = rows().select([c for c in SCORED_COLUMNS if c in rows().schema.names])
    batch = score_batch(table, transcripts=reads(["tool_success"], "transcript"))
    assert batch.transcripts is not None and [len(t) for t in batch.transcripts] == [5, 5, 1]
    second = batch.transcripts[1][3]
    assert second == {"role": "tool", "text": "<tool_response>", "tool": "lookup", "arguments": '{"key": "abc"}',
                      "result": None, "error": "tool 'lookup' timed out after 5 s"}
    # 2 of 2 calls answered; 1 of 2 (a timeout); none made: `no_calls`
    np.testing.assert_allclose(build_scorer("tool_success").__call__(batch).scores, [1.0, 0.5, 0.0])
    np.testing.assert_allclose(build_scorer("tool_success", no_calls=1.0)(batch).scores, [1.0, 0.5, 1.0])
    assert build_scorer("exact_match")(batch).scores.tolist() == [1.0, 0.0, 0.0]
    # a run whose scorers do not read transcripts does not parse them
    assert score_batch(table, transcripts=reads(["exact_match"], "transcript")).transcripts is None
    assert reads(["remote"], "transcript")  # the server decides what a remote scorer reads


def test_the_reward_server_receives_transcripts_and_bounds_them():
    from unirl.stages.rewards.server import ScoringService, ServerConfig, _decode_and_score
    from unirl.stages.run.iteration import score_batch

    batch = score_batch(rows())
    body = encode_batch(batch)
    service = ScoringService(ServerConfig(scorers=[{"name": "tool_success"}, {"name": "exact_match"}]))
    assert service.reads == {"text", "transcript"}
    assert _decode_and_score(service, body)["components"]["tool_success"] == [1.0, 0.5, 0.0]
    text_only = ScoringService(ServerConfig(scorers=[{"name": "exact_match"}]))
    assert decode_batch(body, text_only.limits, text_only.reads).transcripts is None  # not read, not parsed

    def stream(transcripts: list[str]) -> bytes:
        table = pa.table({"sample_id": [f"s{i}" for i in range(len(transcripts))], "prompt": ["p"] * len(transcripts),
                          "transcript": transcripts})
        sink = io.BytesIO()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        return sink.getvalue()

    with pytest.raises(WireError, match=r"transcript of sample 's0': turn 1 is not an object with a `role`"):
        decode_batch(stream(['[{"role": "assistant", "text": "x"}, "hi"]']))
    with pytest.raises(WireError, match=r"transcript of sample 's0' is a dict, not a list"):
        decode_batch(stream(['{"role": "tool"}']))
    with pytest.raises(WireError, match=r"transcript of sample 's0' is nested more than 32 levels deep"):
        decode_batch(stream(["[" * 40 + "]" * 40]))
    with pytest.raises(TooLarge, match=r"transcript of \d+ bytes: over the limit `max_metadata_bytes: 64`"):
        decode_batch(stream(['[{"role": "tool", "result": "' + "x" * 100 + '"}]']), Limits(max_metadata_bytes=64))


def test_a_transcript_scorer_needs_an_agent(tmp_path):
    from tests.tiny import TINY
    from unirl.stages.recipe import build_recipe

    scorers = {"reward": {"scorers": [{"name": "exact_match"}, {"name": "tool_success", "weight": 0.1}]}}
    with pytest.raises(ValueError, match=r"reward.scorers.1.name: scorer 'tool_success' reads transcript, but model.kind "
                                         r"'qwen3' produces text"):
        build_recipe({**TINY["qwen3"], **scorers})
    recipe = build_recipe({**TINY["qwen3"], **scorers, "agent": {"mcp_servers": [{"name": "kv", "command": ["kv"]}]}})
    assert [s.name for s in recipe.reward.scorers] == ["exact_match", "tool_success"]
