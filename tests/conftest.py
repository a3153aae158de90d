"""Shared fixtures: an isolated environment for real `unirl` / Prefect subprocesses, one Prefect
server and one MLflow database for the whole session, and tiny models built once."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The suite starts a few hundred interpreters; each writes the bytecode of what it imports the first
# time (nothing is compiled at install, README "Set up"), so none compiles torch or transformers again.
# An environment with PYTHONDONTWRITEBYTECODE would have every process compile every module anew.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
# Every process the suite starts records the recipe fields its run code reads (stages/runtime/config_base.py);
# `pytest_sessionfinish` below fails the whole suite on a field no run read (tests/recipe_fields.py).
_MADE: list[str] = []  # the session's temp folders this process made (its pytest workers inherit them), removed at its end
if "UNIRL_FIELD_TRACE" not in os.environ:
    os.environ["UNIRL_FIELD_TRACE"] = tempfile.mkdtemp(prefix="unirl-field-trace-")
    _MADE.append(os.environ["UNIRL_FIELD_TRACE"])
# Tiny models are built once per `model:` section for the whole session, in every process the
# suite starts (stages/run/record.py `materialize_model`); a run's weights v000000 are copied from there.
if "UNIRL_TINY_CACHE" not in os.environ:
    os.environ["UNIRL_TINY_CACHE"] = tempfile.mkdtemp(prefix="unirl-tiny-cache-")
    _MADE.append(os.environ["UNIRL_TINY_CACHE"])
TINY = REPO / "recipes" / "ar" / "tiny.yaml"


# The files that take longest (seconds on 2 cores, `pytest --durations`), longest first: the two
# pytest workers take a file at a time (`--dist loadfile`), so these start first and the short
# files fill in around them instead of one long file running alone at the end.
LONGEST_FIRST = [
    "e2e/test_deployment.py", "e2e/test_learning_gate.py", "e2e/test_multinode.py", "e2e/test_faults_ranks.py", "e2e/test_rl_flow.py",
    "stages/test_matrix.py", "e2e/test_flow_family_runs.py", "e2e/test_pe_flow.py", "e2e/test_unified_flow.py",
    "e2e/test_faults_outages.py", "stages/engines/test_vllm.py", "e2e/test_faults_kills.py", "e2e/test_ar_algorithms.py",
    "stages/engines/test_engine_sync.py", "e2e/test_diffusion_flow.py", "e2e/test_vlm_flow.py", "e2e/test_reward_server.py",
    "e2e/test_async_rl.py", "e2e/test_accumulation_flow.py", "e2e/test_rl_s3.py", "stages/test_sharded_load.py",
    "stages/test_sd3_bundle.py", "test_zygote.py",
]


def pytest_configure(config: pytest.Config) -> None:
    """The two pytest workers (pyproject.toml `-n 2`) share the machine's cores, so every process
    of the suite computes on one thread: the workers' own torch (set here, before the workers start
    and before any test imports torch), and the worker ranks, engines and producers their runs
    start (threads_per_rank caps a rank's threads at OMP_NUM_THREADS). Two processes of two OpenMP
    threads each on two cores spend much of their CPU spinning while they wait for each other (the
    unit tier took 223 s with the default, 156 s with one thread; docs/contributing.md). Set in a
    hook, not at import: the commands a test runs may import this module."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def weight(item: pytest.Item) -> int:
        path = Path(str(item.path)).resolve()
        relative = path.relative_to(REPO / "tests").as_posix() if path.is_relative_to(REPO / "tests") else ""
        return rank.get(relative, len(rank))

    items.sort(key=weight)  # stable: a file's tests keep their order


def pytest_collection_finish(session: pytest.Session) -> None:
    """vLLM's own venv installs in the background while the first files run, when its tests are
    among those selected (not for the unit tier, `-m "not slow"`)."""
    if any(Path(str(item.path)).name == "test_vllm.py" for item in session.items):
        from tests import vllm_env

        vllm_env.start_in_background()


def whole_suite(config: pytest.Config) -> bool:
    return (config.args_source == pytest.Config.ArgsSource.TESTPATHS and not config.option.keyword and not config.option.collectonly
            and not config.option.markexpr and not config.option.deselect)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A pytest-xdist worker writes the recipe fields it read; the session's own process (after
    its workers) judges them, when the whole suite ran and passed: a field nothing read fails it."""
    from tests.recipe_fields import dump_reads

    trace = Path(os.environ["UNIRL_FIELD_TRACE"])
    if hasattr(session.config, "workerinput"):
        dump_reads(trace)
        return
    try:
        if exitstatus == 0 and whole_suite(session.config):
            _judge_fields(session, trace)
    finally:
        import shutil

        for folder in _MADE:
            shutil.rmtree(folder, ignore_errors=True)


def _judge_fields(session: pytest.Session, trace: Path) -> None:
    from tests.recipe_fields import unread_fields

    unread = unread_fields(trace)
    if unread:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = f"recipe fields no run read in the whole suite, only validators or tests if anything (remove them or use them): {unread}"
        if reporter is not None:
            reporter.write_line(f"FAILED every recipe field is used by a run: {message}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def isolated_env(tmp: Path, forked: bool = True) -> dict[str, str]:
    """Each test gets its own Prefect home (SQLite), no MLflow URI from outside, no telemetry;
    `forked`: the worker ranks, engines and producers of its `unirl` commands are forked from this
    pytest worker's fork server (tests/zygote.py) instead of started cold."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env.update({
        "PREFECT_HOME": str(tmp / "prefect-home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PYTHONUNBUFFERED": "1",
    })
    # OMP_NUM_THREADS stays as `pytest_configure` sets it: worker ranks take cores / ranks
    # threads, capped at one while two pytest workers share the cores.
    env.pop("UNIRL_FORKSERVER", None)
    env.pop("UNIRL_LAUNCHER", None)
    if forked:
        from tests import forkserver, zygote

        env.update(forkserver.env(zygote.server().path))
    return env


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """One real Prefect server for the session (tests/prefect_server.py), started on first use."""
    from tests.prefect_server import PrefectServer

    tmp = tmp_path_factory.mktemp("prefect-server")
    server = PrefectServer(tmp, isolated_env(tmp, forked=False), REPO).serve()  # its workers' runs start cold
    try:
        yield server
    finally:
        server.stop_all()


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory) -> str:
    """One MLflow database for the session, its schema created once (a new SQLite database takes
    about 3 s of migrations; runs are told apart by their MLflow run id in run.json)."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    MlflowClient(tracking_uri=uri).search_experiments()
    return uri


@pytest.fixture
def unirl_env(tmp_path: Path, prefect_server, mlflow_uri: str) -> dict[str, str]:
    """For `unirl` subprocesses: their own Prefect home, the session's Prefect server and MLflow."""
    return {**isolated_env(tmp_path), **prefect_server.client_env, "MLFLOW_TRACKING_URI": mlflow_uri}


@pytest.fixture
def forked_children(monkeypatch) -> None:
    """For a test that starts worker groups or engines in its own process: they are forked from
    this pytest worker's fork server, as the ones `unirl` commands start in the e2e tests are."""
    from tests import forkserver, zygote

    for key, value in forkserver.env(zygote.server().path).items():
        monkeypatch.setenv(key, value)
    for key, value in zygote.import_env().items():  # what `unirl` sets before its children start
        monkeypatch.setenv(key, value)


@pytest.fixture
def ephemeral_env(tmp_path: Path) -> dict[str, str]:
    """For `unirl` as a user first runs it: Prefect's ephemeral API, MLflow in the run folder."""
    return isolated_env(tmp_path)


def run_unirl(args: list[str], env: dict[str, str], timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    from tests import zygote

    proc = zygote.run(
        [sys.executable, "-m", "unirl.flows.cli", *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"unirl {' '.join(args)} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-6000:]}")
    return proc


@pytest.fixture(scope="session")
def tiny_weights(tmp_path_factory):
    """`tiny_weights(case)`: the tiny model of a family (or a family's variant, "wan2.2") of
    tests/tiny.py, built once per session and saved in its checkpoint layout, so tests load it by
    path like real weights."""
    from tests.tiny import CASES
    from unirl.stages.runtime.registry import families

    built: dict[str, Path] = {}

    def get(case: str) -> Path:
        if case not in built:
            model = CASES[case]["model"]
            fam = families.get(model["kind"])
            built[case] = fam.materialize(fam.config.model_validate(model), tmp_path_factory.mktemp(case) / "tiny")
        return built[case]

    return get


def perturbed_copy(folder: Path, into: Path, case: str, *, scale: float, seed: int = 1) -> Path:
    """The model of `folder` (tests/tiny.py `case`) with Gaussian noise of `scale` times each
    trainable tensor's std added, saved to `into`; every other component is the folder's own."""
    import torch

    from tests.tiny import CASES
    from unirl.stages.runtime.registry import families

    model = CASES[case]["model"]
    fam = families.get(model["kind"])
    bundle = fam.load(folder, fam.config.model_validate(model), "cpu")
    g = torch.Generator().manual_seed(seed)
    state = {k: v + scale * v.float().std() * torch.randn(v.shape, generator=g) if v.is_floating_point() and v.numel() > 1 else v
             for k, v in bundle.module.state_dict().items()}
    fam.export(bundle, into, state, lora=None)
    return into


@pytest.fixture(scope="session")
def teacher_weights(tiny_weights, tmp_path_factory):
    """`teacher_weights(case)`: a distillation teacher for the tiny model of `case`: its trained
    module perturbed (its VAE and text encoders the student's), built once per session."""
    built: dict[str, Path] = {}

    def get(case: str) -> Path:
        if case not in built:
            built[case] = perturbed_copy(tiny_weights(case), tmp_path_factory.mktemp(f"{case}-teacher") / "teacher", case,
                                         scale=0.3)
        return built[case]

    return get


def recipe_errors(data: dict) -> list[str]:
    """The `field.path: ...` lines of a recipe that must not validate."""
    from unirl.stages.recipe import RecipeError, build_recipe

    with pytest.raises(RecipeError) as caught:
        build_recipe(data)
    return caught.value.errors
