"""Careless and hostile input: run names and run-relative paths cannot leave the storage root,
credentials never reach recipe.yaml / MLflow / logs, token checks are constant-time, and nothing
is unpickled."""
from __future__ import annotations

import hmac
import re
import sys

import pytest

from tests import zygote
from tests.conftest import REPO, TINY
from unirl.stages.recipe import RecipeError, load_recipe
from unirl.stages.runtime.storage import RunStorage

ESCAPES = ["../x", "..", "/etc", "a/b", ".hidden", "x/../../y", "s3://other/run", "x%2F..", "-rf", "a b", "x\x00"]


@pytest.mark.parametrize("name", ESCAPES)
def test_run_names_that_would_leave_the_root_are_refused(name, tmp_path):
    with pytest.raises(ValueError, match="is not a plain run name"):
        RunStorage(str(tmp_path), name)
    with pytest.raises(RecipeError, match=r"name: .* is not a plain run name"):
        load_recipe(TINY, [f"name={name!r}"] if "'" not in name else [])


def test_the_cli_refuses_a_run_name_before_anything_starts(tmp_path):
    out = zygote.run([sys.executable, "-m", "unirl.flows.cli", "run", str(TINY), f"storage.root={tmp_path}", "--run-name", "../../etc"],
                     cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 2 and "--run-name: '../../etc' is not a plain run name" in out.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("rel", ["../../etc/passwd", "/etc/passwd", "a/../../b", "s3://bucket/other/x", "..\x00"])
def test_run_relative_paths_cannot_leave_the_run_folder(rel, tmp_path):
    storage = RunStorage(str(tmp_path), "run")
    with pytest.raises(ValueError, match="is not a path inside the run folder"):
        storage.path(rel)
    with pytest.raises(ValueError, match="is not a path inside the run folder"):
        storage.write_bytes(rel, b"x")
    assert storage.path("iter-000000/../iter-000001/x") == storage.path("iter-000001/x")


def test_a_manifest_pointing_outside_the_run_is_refused(tmp_path):
    from unirl.stages.run import iteration as it

    (tmp_path / "secret.txt").write_text("do not read")
    storage = RunStorage(str(tmp_path / "runs"), "run")
    recipe = load_recipe(TINY, [f"storage.root={tmp_path / 'runs'}"])
    with pytest.raises(ValueError, match="'../../secret.txt' is not a path inside the run folder"):
        it.score(storage, recipe, 0, ["../../secret.txt"])


@pytest.mark.parametrize("override,field", [
    ("storage.options={key: AKIAEXAMPLE, secret: wJalrXUtnFEMI}", "storage.options.key"),
    ("storage.options={client_kwargs: {aws_secret_access_key: wJalrXUtnFEMI}}", "storage.options.client_kwargs.aws_secret_access_key"),
    ("reward.scorers=[{name: remote, params: {url: 'http://127.0.0.1:9', token: s3cr3t}}]", "reward.scorers.0.params.token"),
    ("tracking.mlflow_uri=https://bob:hunter2@mlflow.example.com", "tracking.mlflow_uri"),
    ("storage.root=s3://AKIA:wJalr@bucket/runs", "storage.root"),
])
def test_literal_credentials_in_a_recipe_are_refused(override, field):
    with pytest.raises(RecipeError) as info:
        load_recipe(TINY, [override])
    (err,) = [e for e in info.value.errors if e.startswith(field + ":")]
    assert "credential" in err and ("environment" in err or "Secret block" in err)
    for secret in ("wJalrXUtnFEMI", "s3cr3t", "hunter2", "wJalr"):
        assert secret not in err


def test_urls_shown_to_people_lose_their_credentials():
    from unirl.stages.runtime.secrets import redact_text, redact_url

    assert redact_url("https://bob:hunter2@mlflow.example.com/x?api_key=k1&page=2") == \
        "https://bob:***@mlflow.example.com/x?api_key=***&page=2"
    line = '127.0.0.1:5 - "POST /v1/score?token=abc123&x=1 HTTP/1.1" 401'
    assert redact_text(line) == '127.0.0.1:5 - "POST /v1/score?token=***&x=1 HTTP/1.1" 401'


def test_token_checks_are_constant_time(monkeypatch):
    """The reward server and the worker group's control channel compare tokens with
    hmac.compare_digest, never `==` (whose time leaks how much of a guess is right)."""
    from unirl.stages.rewards import server
    from unirl.stages.workers import control

    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    with pytest.raises(server._HttpError):
        server._check_token("Bearer guess", "the-token")
    assert calls == [(b"guess", b"the-token")]
    source = (REPO / "stages/workers/control.py").read_text() + (REPO / "stages/rewards/server.py").read_text()
    assert not re.search(r"token\s*(==|!=)|(==|!=)\s*self\.token", source)
    assert control.hmac is hmac


def test_nothing_is_unpickled():
    """No pickle anywhere in the code that reads run storage or talks between processes: shards
    are Arrow, checkpoints safetensors + JSON, collectives carry JSON bytes."""
    banned = re.compile(r"\bimport pickle\b|\bpickle\.loads?\b|torch\.load\(|weights_only\s*=\s*False|"
                        r"all_gather_object|broadcast_object_list|scatter_object_list|gather_object\(")
    found = [f"{p.relative_to(REPO)}:{n}" for d in ("stages", "flows", "tasks") for p in (REPO / d).rglob("*.py")
             for n, line in enumerate(p.read_text().splitlines(), 1) if banned.search(line)]
    assert not found, found


# ---- what a person types: one line naming the file or override, never a traceback ----

LAUGHS = "".join(f"{c}: &{c} [{', '.join([f'*{p}'] * 9) if p else ', '.join(['x'] * 9)}]\n"
                 for p, c in zip([None, *"abcdefg"], "abcdefgh"))  # 9^8 = 43M values once expanded, 0.3 KB


def _bounded_child(fn) -> str:
    """Run `fn` in a forked child whose address space may grow by at most 512 MiB over the parent's:
    an input that expands without bound dies there (MemoryError), not in the suite."""
    import os
    import resource

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what fn said, whatever happens
        os.close(read)
        try:
            vm = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize:"))
            resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), resource.RLIM_INFINITY))
            message = fn()
        except BaseException as exc:  # noqa: BLE001 - the parent asserts on the name
            message = f"{type(exc).__name__}: {exc}"
        os.write(write, message.encode()[:4096])
        os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 4096):
        chunks.append(chunk)
    os.waitpid(pid, 0)
    return b"".join(chunks).decode()


@pytest.mark.parametrize("text,message", [
    (LAUGHS, "line 6: more than 100000 values with its aliases expanded"),
    ("a: " + "[" * 3000 + "]" * 3000, "nest"),
    ("train: " + "[" * 65 + "]" * 65, "line 1: nested more than 64 levels deep"),
    ("train: {lr: 0.1}\nname: x\ntrain: {lr: 0.2}\n", "line 3, column 1: duplicate key 'train' (first on line 1)"),
    ("name: x\n---\nname: y\n", "line 2: a second YAML document ('---')"),
    ("name: !!python/object/apply:os.system [echo]\n", "could not determine a constructor for the tag"),
    ("name: a\x07b\n", "unacceptable character #x0007"),
    ("name: [1, 2\n", "not valid YAML: line 2, column 1"),
])
def test_a_malformed_or_explosive_recipe_is_one_error_line_in_bounded_memory(tmp_path, text, message):
    path = tmp_path / "r.yaml"
    path.write_text(text)

    def validate() -> str:
        try:
            load_recipe(path)
        except RecipeError as exc:
            return "\n".join(exc.errors)
        return "accepted"

    got = _bounded_child(validate)
    assert message in got and "\n" not in got, got


def test_a_recipe_that_is_not_utf8_or_too_big_is_refused_unread(tmp_path):
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("name: café\n".encode("latin-1"))
    with pytest.raises(RecipeError) as caught:
        load_recipe(latin)
    assert caught.value.errors == ["not UTF-8 text (byte 9 is 0xe9); save it as UTF-8"]
    big = tmp_path / "big.yaml"
    big.write_text("name: x\n" + "#" * (2 << 20))
    with pytest.raises(RecipeError, match=r"more than the 1048576 bytes a YAML input may have"):
        load_recipe(big)


def test_yaml_merge_keys_may_be_overridden_but_plain_keys_not_repeated():
    from unirl.stages.runtime.yaml_input import YamlInputError, load_yaml

    assert load_yaml("base: &b {x: 1, y: 2}\nc: {<<: *b, y: 3}\n", "t")["c"] == {"x": 1, "y": 3}
    with pytest.raises(YamlInputError, match="line 2, column 8: duplicate key 'y'"):
        load_yaml("c: {y: 1,\n       y: 2}\n", "t")


@pytest.mark.parametrize("override,message", [
    ("train.lr=[1", "override 'train.lr=[1': not valid YAML: line 2, column 1: did not find expected ',' or ']'"),
    ("x=!!python/object/apply:os.system [ls]", "override 'x=!!python/object/apply:os.system [ls]': not valid YAML"),
    ("train.lr=1\n---\nb: 2", "override 'train.lr=1\\n---\\nb: 2': line 2: a second YAML document"),
    ("name=a\x07b", "unacceptable character #x0007"),
    ("train={lr: 1, lr: 2}", "duplicate key 'lr'"),
    ("{a: 1", "'{a: 1': expected key.sub=value"),
    ("name=" + "x" * (70 << 10), "more than the 65536 bytes a YAML input may have"),
])
def test_a_malformed_override_is_one_line_naming_it(override, message):
    with pytest.raises(RecipeError) as caught:
        load_recipe(TINY, [override])
    assert caught.value.source == "overrides" and len(caught.value.errors) == 1
    assert message in caught.value.errors[0] and "\n" not in caught.value.errors[0], caught.value.errors


@pytest.mark.parametrize("override,message", [
    ("rollout.group_size=true", "rollout.group_size: expected a number, got true"),
    ("train.lr=false", "train.lr: expected a number, got false"),
    ("rollout.group_size=1000000000000", "rollout.group_size: Input should be less than or equal to 4096"),
    ("rollout.prompts_per_iteration=10000000", "rollout.prompts_per_iteration: Input should be less than or equal to 1048576"),
    ("iterations=100000000000000000000", "iterations: Input should be less than or equal to 10000000"),
    ("data.seed=99999999999999999999999", "data.seed: does not fit in a signed 64-bit integer"),
    ("seed=-1", "seed: Input should be greater than or equal to 0"),
    ("seed=99999999999999999999999", "seed: does not fit in a signed 64-bit integer"),
    ("model.tiny.seed=-3", "model.tiny.seed: Input should be greater than or equal to 0"),
    ("train.betas=[0.9, 1.0]", "train.betas: AdamW betas must each lie in [0, 1)"),
    ("train.betas=[.nan, 0.9]", "train.betas.0: Input should be a finite number"),
    ("train.lr=.inf", "train.lr: Input should be a finite number"),
    ("rollout.temperature=.inf", "rollout.temperature: Input should be a finite number"),
    ("reward.scorers=[{name: text_length, weight: .nan}]", "reward.scorers.0.weight: Input should be a finite number"),
    ("reward.scorers=[{name: text_length, params: {max_length: .inf}}]", "reward.scorers.0.params.max_length: "),
    ("rollout.max_new_tokens=100000", "rollout.max_new_tokens: 100000 does not fit the model's context of 256 tokens"),
    ("model.tiny.num_attention_heads=3", "model.tiny.num_key_value_heads: 2 does not divide num_attention_heads (3)"),
    ("storage.root=''", "storage.root: String should have at least 1 character"),
    ("storage.root=ftpx://bucket/runs", "storage.root: no filesystem for 'ftpx://' (Protocol not known: ftpx)"),
    ("tracking.experiment=''", "tracking.experiment: String should have at least 1 character"),
    ('name="run\\n"', "name: 'run\\n' is not a plain run name"),
])
def test_values_no_run_can_use_are_refused_at_validate_time(override, message):
    with pytest.raises(RecipeError) as caught:
        load_recipe(TINY, [override])
    assert any(message in e for e in caught.value.errors), caught.value.errors


@pytest.mark.parametrize("recipe,scorer,params,message", [
    ("diffusion/quickstart", "geneval", "{mode: bogus}", "params.mode: Input should be 'strict', 'mean' or 'partial'"),
    ("video/quickstart", "videotoy", "{mode: bogus}", "params.mode: Input should be 'strict', 'mean' or 'motion'"),
    ("ar/tiny", "math_verify", "{fallback: first}", "params.fallback: Input should be 'last_number' or 'none'"),
    ("ar/tiny", "text_length", "{unit: bytes}", "params.unit: Input should be 'chars' or 'words'"),
])
def test_a_scorer_option_outside_its_choices_fails_validate_not_scoring(recipe, scorer, params, message):
    with pytest.raises(RecipeError) as caught:
        load_recipe(REPO / "recipes" / f"{recipe}.yaml", [f"reward.scorers=[{{name: {scorer}, params: {params}}}]"])
    assert any(message in e for e in caught.value.errors), caught.value.errors


def test_the_cli_answers_malformed_input_with_exit_2_and_one_line(tmp_path):
    (tmp_path / "laughs.yaml").write_text(LAUGHS)
    out = zygote.run([sys.executable, "-m", "unirl.flows.cli", "validate", str(tmp_path / "laughs.yaml"), "train.lr=[1"],
                     cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "more than 100000 values with its aliases expanded" in out.stderr


@pytest.mark.parametrize("url", ["sqlite:////tmp/runs/m.db", "sqlite:///m.db", "s3://", "file:///a//b", "http://h/a?x=1&&y=2",
                                 "memory://x"])
def test_urls_without_credentials_are_shown_exactly_as_given_and_accepted(url):
    from unirl.stages.runtime.secrets import redact_url

    assert redact_url(url) == url
    field = "tracking.mlflow_uri" if url.startswith(("sqlite", "http")) else "storage.root"
    assert getattr(load_recipe(TINY, [f"{field}={url}"]), field.split(".")[0]).model_dump()[field.split(".")[1]] == url


@pytest.mark.slow  # a `unirl run` started and interrupted
def test_ctrl_c_stops_a_run_promptly_while_the_object_store_is_unreachable(tmp_path):
    """SIGINT used to wait for the storage retries (up to UNIRL_STORAGE_RETRY_S, 300 s) to run out; now it stops
    every retry at once and the run exits 130, resumable."""
    import signal
    import time

    from unirl.stages.runtime.storage import transient

    assert not transient(KeyboardInterrupt())
    cmd = [sys.executable, "-m", "unirl.flows.cli", "run", str(TINY), "storage.root=s3://bucket/runs", "--run-name", "s",
           "storage.options={client_kwargs: {endpoint_url: 'http://127.0.0.1:9'}}"]  # nothing listens on port 9
    env = {**__import__("os").environ, "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y", "UNIRL_STORAGE_RETRY_S": "300"}
    log = tmp_path / "out.log"
    with open(log, "w") as out:
        proc = zygote.popen(cmd, cwd=REPO, env=env, stdout=out, stderr=out)
        try:
            deadline = time.monotonic() + 120
            while "retrying in" not in log.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=20) == 130, log.read_text()
        finally:
            proc.kill()
    assert "interrupted; run the same command again to resume" in log.read_text()
