"""A vision-language agent through the real CLI: a tiny Qwen3-VL whose first turn shows the user's
question and its image (the tools given to the chat template), warm-started on a teacher's tool
calls, then GRPO with multi-turn rollouts on the trainside engine and its `add` tool. Every turn is
sampled from the whole context with the prompt's image, the trained rows carry the image and mask
the tool's tokens, the trainer's replay (M-RoPE positions over image, turns and tool turns) is the
sampler's record, and `unirl audit` passes."""
from __future__ import annotations

import json
import random

import pyarrow.ipc as ipc
import pytest

from tests.conftest import REPO, run_unirl
from tests.e2e.test_agent_flow import check_answered_calls

pytestmark = pytest.mark.slow
RECIPE = str(REPO / "recipes/vlm/grpo.yaml")
CHARSET = 'abcdefghijklmnopqrstuvwxyz0123456789{}[]":,_<>/+-*=() '
# The tiny model of the tests with the text test's character set, warm-started (SFT in the run) on the
# teacher's calls, then 2 GRPO iterations of at most 2 turns; a length reward gives the groups a signal,
# a small learning rate keeps the policy calling its tool, no held-out evaluation: seconds, not minutes.
SMALL = ["iterations=2", "checkpoint_every=2", "model.train_vision=false", f"model.tiny.charset='{CHARSET}'",
         "model.tiny.text={hidden_size: 32, num_hidden_layers: 1, intermediate_size: 64}",
         "model.tiny.vision={depth: 1, hidden_size: 16, num_heads: 2, intermediate_size: 32}",
         "sft={source: synthetic, examples: 400, steps: 60, lr: 0.008, batch_size: 32}",
         "agent={tools: [add], max_turns: 2}", "rollout={prompts_per_iteration: 3, group_size: 4, max_new_tokens: 72}",
         "reward.scorers=[{name: text_length, params: {max_length: 80}}]", "train.micro_batch_size=12", "train.lr=1e-4",
         "eval.enabled=false"]
COLOURS = [(200, 40, 40), (40, 160, 60), (40, 60, 200), (220, 200, 40)]


def data(folder, n=100):
    """Questions "a+b=" each showing one of four plain images; the reference answer is the
    teacher's call (what the warm start learns)."""
    from PIL import Image

    for k, colour in enumerate(COLOURS):
        Image.new("RGB", (32, 32), colour).save(folder / f"image-{k}.png")
    rng = random.Random(0)
    pairs = [(a, b) for a in range(10) for b in range(10)]
    rng.shuffle(pairs)
    with open(folder / "questions.jsonl", "w") as f:
        for a, b in pairs[:n]:
            call = "<tool_call>" + json.dumps({"name": "add", "arguments": {"a": a, "b": b}}, separators=(",", ":")) + "</tool_call>"
            f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": call, "image": f"image-{(a + b) % 4}.png"}) + "\n")
    return folder / "questions.jsonl"


def test_a_vlm_agent_sees_its_image_calls_its_tool_and_trains_on_its_own_tokens_only(tmp_path, unirl_env):
    from unirl.stages.run.audit import audit_run
    from unirl.stages.runtime.storage import RunStorage
    from unirl.stages.runtime.tokenizer import load_tokenizer

    questions = data(tmp_path)
    root = tmp_path / "runs"
    out = run_unirl(["run", RECIPE, *SMALL, f"storage.root={root}", "--run-name", "vlm-agent",
                     f"data={{name: file, path: {questions}, image_column: image}}"],
                    {**unirl_env, "UNIRL_PLUGINS": "tests.agent_tools", "PYTHONPATH": str(REPO)})
    run = root / "vlm-agent"
    lines = [line for line in out.stdout.splitlines() if line.startswith("[unirl] iter-")]
    assert len(lines) == 2 and all("  turns " in line and "  stop " in line for line in lines), lines
    tokenizer = load_tokenizer(run / "weights/v000000")
    image_token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for i in range(2):
        rows = check_answered_calls(run, i, template=True)
        assert all(lp == 0.0 for r in rows for lp, m in zip(r["response_logprobs"], r["response_mask"]) if not m)
        # each row's first prompt shows its image: the request's PNG, and the 8 x 8 patches merged 2 x 2 as 16 image
        # tokens before the question (the trainer replays them), none in the turns after it
        requests = ipc.open_file(str(run / f"iter-{i:06d}/requests.arrow")).read_all()
        shown = dict(zip(requests.column("group_id").to_pylist(), requests.column("images").to_pylist()))
        for r in rows:
            assert r["images"] == shown[r["group_id"]] and r["images"][0].startswith(b"\x89PNG") and r["image_grids"] == [[1, 8, 8]]
            assert r["prompt_ids"].count(image_token) == 16 and image_token not in r["response_ids"]
            assert tokenizer.decode(r["prompt_ids"]).endswith(f"{r['prompt']}<|im_end|>\n<|im_start|>assistant\n")
        train = json.loads((run / f"iter-{i:06d}/train.json").read_text())["metrics"]
        assert train["behaviour_logp_max_abs_diff"] <= 1e-4  # the trainer replays the policy's tokens as sampled
        metrics = json.loads((run / f"iter-{i:06d}/manifests/generate.json").read_text())["metrics"]
        assert metrics["agent/tool_calls_mean"] > 0 and 0 < metrics["agent/tool_success"] <= 1
    import tests.agent_tools  # noqa: F401 - the run's tools, registered here too: its stored recipe names them
    report = audit_run(RunStorage(str(root), "vlm-agent"))
    assert report.ok, report.text()
