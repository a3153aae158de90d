"""An agentic run through the real CLI: a tiny Qwen3 warm-started on a teacher's tool calls
(`<tool_call>{"name": "add", ...}</tool_call>` for "a+b="), then GRPO with multi-turn rollouts
(stages/engines/agentic.py) on the trainside engine; its `add` tool is served by unirl's MCP server
of Python tools, sandboxed. The transcripts show calls answered by the tool, the trained rows mask
the tool's tokens, the trainer's replay of the policy's own tokens is the sampler's record, and
`unirl audit` passes. Faults too: its tool server dying mid-run (started again, the run goes on), and
the run SIGKILLed mid-iteration (the same command resumes it to where an uninterrupted run ends)."""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pyarrow.ipc as ipc
import pytest

from tests.conftest import REPO, TINY, run_unirl

pytestmark = pytest.mark.slow
CHARSET = 'abcdefghijklmnopqrstuvwxyz0123456789{}[]":,_<>/+-*=() '


def teacher(path, n=300, tool="add"):
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            call = "<tool_call>" + json.dumps({"name": tool, "arguments": {"a": a, "b": b}}, separators=(",", ":")) + "</tool_call>"
            f.write(json.dumps({"prompt": f"{a}+{b}=", "response": call}) + "\n")


def agent_run(tmp_path, root, *extra, tool="add"):
    """`unirl run` arguments of the tiny agentic run: a tiny Qwen3 warm-started (SFT, in the run) on a
    teacher's calls of `tool` for "a+b=", then 2 GRPO iterations of multi-turn rollouts with `tool`."""
    data = tmp_path / f"teacher-{tool}.jsonl"
    if not data.exists():
        teacher(data, tool=tool)
    return ["run", str(TINY), "iterations=2", f"storage.root={root}",
            f"model.tiny={{hidden_size: 32, num_hidden_layers: 1, intermediate_size: 64, charset: '{CHARSET}'}}",
            f"agent={{tools: [{tool}], max_turns: 2}}", "rollout.max_new_tokens=72", "reward.scorers=[{name: exact_match}]",
            f"sft={{source: file, path: {data}, steps: 80, lr: 0.005, batch_size: 32}}", *extra]


def agent_env(unirl_env):
    """The run's environment: its tools from tests/agent_tools.py, in the tool server too."""
    return {**unirl_env, "UNIRL_PLUGINS": "tests.agent_tools", "PYTHONPATH": str(REPO)}


def check_answered_calls(run, i, template=False):
    """Iteration i of an `add` run: calls answered by the tool with the sum of the arguments the
    policy wrote, their tool turns masked (the `<tool_response>` block alone, or inside the chat
    `template`'s user turn); the rows of trajectories that called it start with the policy's own
    tokens and hold masked ones. Returns the rows."""
    turns = ipc.open_file(str(run / f"iter-{i:06d}/rollouts.turns/transcript.arrow")).read_all().to_pylist()
    calls = [t for t in turns if t["role"] == "tool" and t["error"] is None]
    assert calls, f"iteration {i}: no call answered by the tool"
    for t in calls:
        args = json.loads(t["arguments"])
        assert t["tool"] == "add" and t["result"] == str(args["a"] + args["b"])
        block = f"<tool_response>\n{t['result']}\n</tool_response>"
        assert set(t["mask"]) == {0} and (block in t["text"] if template else t["text"] == block)
    rows = ipc.open_file(str(run / f"iter-{i:06d}/rollouts/part-000.arrow")).read_all().to_pylist()
    called = [r for r in rows if r["agent_tool_calls"]]
    assert called and all(0 in r["response_mask"] and r["response_mask"][0] == 1 for r in called)
    return rows


def test_an_agent_calls_its_tool_and_trains_on_its_own_tokens_only(tmp_path, unirl_env):
    from unirl.stages.run.audit import audit_run
    from unirl.stages.runtime.storage import RunStorage

    root = tmp_path / "runs"
    out = run_unirl(agent_run(tmp_path, root, "eval.k=2", "data.heldout_size=4", "tracking.preview_every=1"),
                    agent_env(unirl_env))
    run = root / "tiny"
    lines = [line for line in out.stdout.splitlines() if line.startswith("[unirl] iter-")]
    assert len(lines) == 2 and all("  turns " in line and " ok " in line and "  stop " in line for line in lines), lines
    # held-out evaluations report the agent's tool use too: turns per trajectory and calls that gave a result
    held = [line for line in out.stdout.splitlines() if line.startswith("[unirl] held-out v")]
    assert len(held) == 2 and all(re.search(r"  turns \d\.\d\d  tool ok \d\.\d\d  ", line) for line in held), held
    after = json.loads((run / "eval/v000002/metrics.json").read_text())["metrics"]
    assert after["eval/turns_mean"] >= 1.0 and 0.0 <= after["eval/tool_success"] <= 1.0, after
    for i in range(2):
        rows = check_answered_calls(run, i)
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


def transcript(run, i):
    return ipc.open_file(str(run / f"iter-{i:06d}/rollouts.turns/transcript.arrow")).read_all().to_pylist()


def served(turns):
    """The calls that reached the tool server (a malformed one never does: it has no latency), in
    the order the loop made them: turn by turn, trajectory by trajectory (stages/tools/agent.py `run`)."""
    by = {}
    for t in turns:
        by.setdefault(t["sample_id"], []).append(t)
    calls = []
    for sid, rows in by.items():
        rows.sort(key=lambda r: r["turn"])
        for t in rows:
            if t["role"] == "tool" and t["latency_s"] is not None:
                step = sum(r["role"] == "assistant" for r in rows if r["turn"] < t["turn"])
                calls.append(((step, sid, t["turn"]), t))
    return [t for _, t in sorted(calls, key=lambda c: c[0])]


def test_a_tool_server_that_dies_mid_run_is_started_again(tmp_path, unirl_env):
    """The run's first call of `sum` ends its MCP server's process (tests/agent_tools.py): that call
    is an error observation in iteration 0's transcript, the server is started again and answers
    every later call, the run finishes both iterations, and `unirl audit` passes."""
    from unirl.stages.run.audit import audit_run
    from unirl.stages.runtime.storage import RunStorage

    root = tmp_path / "runs"
    out = run_unirl(agent_run(tmp_path, root, "eval.enabled=false", tool="sum"), agent_env(unirl_env))
    run = root / "tiny"
    assert [line.split()[1] for line in out.stdout.splitlines() if line.startswith("[unirl] iter-")] == [
        "iter-000000", "iter-000001"], out.stdout
    calls = [served(transcript(run, i)) for i in range(2)]
    died = [(i, k) for i in range(2) for k, t in enumerate(calls[i]) if "died" in (t["error"] or "")]
    assert len(died) == 1 and died[0][0] == 0, died  # one death, in iteration 0: no evaluation ran before it
    k = died[0][1]
    dead = calls[0][k]
    assert dead["tool"] == "sum" and dead["result"] == "" and dead["error"].startswith(
        "tool server 'python-tools' died during sum (") and dead["error"].endswith("; it is started again"), dead
    # the calls before it, if any, never ran the tool: their arguments did not validate
    assert all(t["error"].startswith("sum failed") for t in calls[0][:k]), calls[0][:k]
    # the policy read the error in its tool turn
    assert any(f"error: {dead['error']}" in t["text"] for t in transcript(run, 0) if t["sample_id"] == dead["sample_id"])
    for i, later in ((0, calls[0][k + 1:]), (1, calls[1])):
        answered = [t for t in later if t["error"] is None]
        assert answered, f"iteration {i}: no call answered after the server died"
        for t in answered:  # by the restarted server: the sum of the arguments the policy wrote
            args = json.loads(t["arguments"])
            assert t["result"] == str(args["a"] + args["b"]), t
    import tests.agent_tools  # noqa: F401 - the run's tools, registered here too: its stored recipe names them
    report = audit_run(RunStorage(str(root), "tiny"))
    assert report.ok, report.text()


def test_an_agentic_run_killed_mid_iteration_resumes_without_loss_or_duplication(tmp_path, unirl_env):
    """The fault table's SIGKILL row for generate (benchmarks/faults.py) in a run with tools: killed
    when iteration 1's multi-turn generate is done but not committed, then resumed by the same
    command (which replays iteration 0's update and samples iteration 1 again, tools and all). Each
    iteration is committed and reported once, the resumed iteration 1 is the killed one's trajectories
    again (same transcripts: the seeds depend on the sample, the turn and the iteration), both updates
    moved the weights, and `unirl audit` passes (each group trained once, versions, weights). A length
    reward gives the groups a signal; a small learning rate keeps the policy calling its tool. (The
    fault table's runs compare a resumed run's weights with an uninterrupted one's bit for bit:
    tests/e2e/test_faults_kills.py.)"""
    import shutil
    import signal

    from unirl.stages.run.audit import audit_run
    from unirl.stages.runtime.storage import RunStorage

    root, env = tmp_path / "runs", agent_env(unirl_env)
    args = agent_run(tmp_path, root, "eval.enabled=false", "train.lr=1e-4",
                     "reward.scorers=[{name: exact_match}, {name: text_length, params: {max_length: 40}}]")
    killed = run_unirl([*args, "--run-name", "killed"], {**env, "UNIRL_FAULTS": "generate@1"}, check=False)
    assert killed.returncode == -signal.SIGKILL, f"not killed at its fault point\n{killed.stderr[-3000:]}"
    assert not (root / "killed/iter-000001/_SUCCESS").exists()
    # what the killed generate wrote, uncommitted: the resumed one samples it again
    shutil.copytree(root / "killed/iter-000001/rollouts.turns", tmp_path / "killed-turns")
    resumed = run_unirl([*args, "--run-name", "killed"], env)
    lines = [line.split()[1] for out in (killed, resumed) for line in out.stdout.splitlines() if line.startswith("[unirl] iter-")]
    assert lines == ["iter-000000", "iter-000001"], (killed.stdout, resumed.stdout)  # each committed (and reported) once

    def rows(path):
        return [{k: v for k, v in r.items() if k != "latency_s"} for r in ipc.open_file(str(path)).read_all().to_pylist()]

    turns = rows(root / "killed/iter-000001/rollouts.turns/transcript.arrow")
    assert any(r["role"] == "tool" and r["error"] is None for r in turns), "iteration 1: no call answered"
    assert rows(tmp_path / "killed-turns/transcript.arrow") == turns
    assert all(json.loads((root / f"killed/iter-{i:06d}/train.json").read_text())["metrics"]["grad_norm"] > 0
               for i in range(2)), resumed.stdout
    import tests.agent_tools  # noqa: F401 - the run's tools, registered here too: its stored recipe names them
    report = audit_run(RunStorage(str(root), "killed"))
    assert report.ok and report.committed == [0, 1], report.text()


def test_an_agent_samples_ahead_on_the_engine_server_async(tmp_path, unirl_env):
    """Async RL with an agent (max_staleness 1, GSPO with the off-policy correction): the producer
    samples multi-turn trajectories on the engine server one version behind the trainer; each
    iteration's rows are the schedule's version and call the tool, and `unirl audit` passes."""
    from unirl.stages.run.audit import audit_run
    from unirl.stages.runtime.storage import RunStorage

    root = tmp_path / "runs"
    run_unirl(agent_run(tmp_path, root, "eval.enabled=false", "rollout.engine.name=engine_server",
                        "rollout.mode=async", "rollout.max_staleness=1", "rollout.correction={level: sequence}", "algorithm.name=gspo",
                        "train.lr=1e-4"), agent_env(unirl_env))
    run = root / "tiny"
    for i in range(2):
        produced = json.loads((run / f"iter-{i:06d}/manifests/produce.json").read_text())
        assert produced["policy_version"] == max(0, i - 1)  # the schedule: version k - max_staleness
        rows = check_answered_calls(run, i)
        assert {r["policy_version"] for r in rows} == {max(0, i - 1)}
        train = json.loads((run / f"iter-{i:06d}/train.json").read_text())["metrics"]
        assert train["stale_frac"] == (0.0 if i == 0 else 1.0) and train["is_weight_mean"] > 0
    import tests.agent_tools  # noqa: F401 - the run's tools, registered here too: its stored recipe names them
    report = audit_run(RunStorage(str(root), "tiny"))
    assert report.ok and [line.versions for line in report.lines] == [(0, 0), (0, 0)], report.text()
