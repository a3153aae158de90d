"""An agentic run through the real CLI: a tiny Qwen3 warm-started on a teacher's tool calls
(`<tool_call>{"name": "add", ...}</tool_call>` for "a+b="), then GRPO with multi-turn rollouts
(stages/tools/engine.py) on the trainside engine; its `add` tool is served by unirl's MCP server
of Python tools, sandboxed. The transcripts show calls answered by the tool, the trained rows mask
the tool's tokens, the trainer's replay of the policy's own tokens is the sampler's record, and
`unirl audit` passes."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow.ipc as ipc
import pytest

from tests.conftest import REPO, TINY, run_unirl

pytestmark = pytest.mark.slow
CHARSET = 'abcdefghijklmnopqrstuvwxyz0123456789{}[]":,_<>/+-*=() '


def teacher(path, n=300):
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            call = "<tool_call>" + json.dumps({"name": "add", "arguments": {"a": a, "b": b}}, separators=(",", ":")) + "</tool_call>"
            f.write(json.dumps({"prompt": f"{a}+{b}=", "response": call}) + "\n")


def test_an_agent_calls_its_tool_and_trains_on_its_own_tokens_only(tmp_path, unirl_env):
    from unirl.stages.runtime.audit import audit_run
    from unirl.stages.runtime.storage import RunStorage

    teacher(tmp_path / "teacher.jsonl")
    root = tmp_path / "runs"
    out = run_unirl(["run", str(TINY), "iterations=2", f"storage.root={root}", "eval.k=2", "data.heldout_size=4",
                     "tracking.preview_every=1",
               f"model.tiny={{hidden_size: 32, num_hidden_layers: 1, intermediate_size: 64, charset: '{CHARSET}'}}",
               "agent={tools: [add], max_turns: 2}", "rollout.max_new_tokens=72", "reward.scorers=[{name: exact_match}]",
               f"sft={{source: file, path: {tmp_path / 'teacher.jsonl'}, steps: 80, lr: 0.005, batch_size: 32}}"],
              {**unirl_env, "UNIRL_PLUGINS": "tests.agent_tools", "PYTHONPATH": str(REPO)})
    run = root / "tiny"
    lines = [line for line in out.stdout.splitlines() if line.startswith("[unirl] iter-")]
    assert len(lines) == 2 and all("  turns " in line and " ok " in line and "  stop " in line for line in lines), lines
    for i in range(2):
        turns = ipc.open_file(str(run / f"iter-{i:06d}/rollouts.turns/transcript.arrow")).read_all().to_pylist()
        calls = [t for t in turns if t["role"] == "tool" and t["error"] is None]
        assert calls, f"iteration {i}: no call answered by the tool"
        for t in calls:  # the tool's answer is the sum of the arguments the policy wrote
            args = json.loads(t["arguments"])
            assert t["tool"] == "add" and t["result"] == str(args["a"] + args["b"])
            assert set(t["mask"]) == {0} and t["text"] == f"<tool_response>\n{t['result']}\n</tool_response>"
        rows = ipc.open_file(str(run / f"iter-{i:06d}/rollouts/part-000.arrow")).read_all().to_pylist()
        called = [r for r in rows if r["agent_tool_calls"]]
        assert called and all(0 in r["response_mask"] and r["response_mask"][0] == 1 for r in called)
        assert all(lp == 0.0 for r in rows for lp, m in zip(r["response_logprobs"], r["response_mask"]) if not m)
        train = json.loads((run / f"iter-{i:06d}/train.json").read_text())["metrics"]
        assert train["behaviour_logp_max_abs_diff"] <= 1e-4  # the trainer replays the policy's tokens as sampled
        metrics = json.loads((run / f"iter-{i:06d}/manifests/generate.json").read_text())["metrics"]
        assert metrics["agent/tool_calls_mean"] > 0 and 0 < metrics["agent/tool_success"] <= 1
        assert abs(sum(v for k, v in metrics.items() if k.startswith("agent/stop_")) - 1.0) < 1e-9
    # the held-out evaluations ran the loop too, and MLflow holds their trajectories as chats
    from mlflow import MlflowClient

    run_id = json.loads((run / "run.json").read_text())["mlflow_run_id"]
    local = MlflowClient(unirl_env["MLFLOW_TRACKING_URI"]).download_artifacts(
        run_id, "tables/transcripts/step-000002.json", str(tmp_path))
    table = json.loads(Path(local).read_text())
    chats = [row[table["columns"].index("chat")] for row in table["data"]]
    assert len(chats) == 4 and all(c.startswith("user: ") and "\nassistant: " in c for c in chats)
    assert any("\ntool add(" in c for c in chats), chats
    import tests.agent_tools  # noqa: F401 - the run's tools, registered here too: its stored recipe names them
    report = audit_run(RunStorage(str(root), "tiny"))
    assert report.ok, report.text()
