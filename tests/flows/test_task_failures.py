"""A task failure is retried only when a retry could change it: a bad input (a ValueError, a wrong
type or key) fails at once, not three times as if the store or a worker had hiccupped."""
from __future__ import annotations

import pytest
from prefect import flow, task
from prefect.settings import PREFECT_API_SSL_CERT_FILE, PREFECT_API_URL, temporary_settings

from unirl.tasks.common import say_retry

pytestmark = pytest.mark.slow  # a real Prefect server (the session's), started on first use


@pytest.mark.parametrize("error,attempts", [(ValueError("reward.scorers.0.weight is nan"), 1), (KeyError("answer"), 1),
                                            (RuntimeError("worker group died"), 3)])
def test_only_failures_a_retry_could_change_are_retried(prefect_server, error, attempts):
    tried = []

    @task(retries=2, retry_delay_seconds=0, retry_condition_fn=say_retry)
    def fails() -> None:
        tried.append(1)
        raise error

    @flow
    def run() -> None:
        fails()

    settings = {PREFECT_API_URL: prefect_server.client_env["PREFECT_API_URL"],
                PREFECT_API_SSL_CERT_FILE: prefect_server.client_env["PREFECT_API_SSL_CERT_FILE"]}
    with temporary_settings(updates=settings), pytest.raises(type(error)):
        run()
    assert len(tried) == attempts


def test_a_run_named_with_dots_publishes_its_evaluation(prefect_server):
    """`.` is allowed in run and recipe names; the evaluation's table artifact key is made from
    them by the shared key function (a hand-made key with a `.` failed the run at its first
    evaluation)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from tests.conftest import TINY
    from unirl.flows.readers import eval_artifact
    from unirl.stages.recipe import load_recipe

    recipe = load_recipe(TINY, ["name=tiny.v2_b"])

    @flow
    def run() -> None:
        eval_artifact(recipe, "exp.1", 3, {"eval/accuracy": 0.5})

    settings = {PREFECT_API_URL: prefect_server.client_env["PREFECT_API_URL"],
                PREFECT_API_SSL_CERT_FILE: prefect_server.client_env["PREFECT_API_SSL_CERT_FILE"]}
    with temporary_settings(updates=settings):
        run()
        with get_client(sync_client=True) as client:
            found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["unirl-tiny-v2-b-exp-1-eval"])))
    assert len(found) == 1 and "0.5" in str(found[0].data), found
