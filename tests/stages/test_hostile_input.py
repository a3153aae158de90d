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
    from unirl.stages.runtime import iteration as it

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
