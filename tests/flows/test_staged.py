"""Tasks keep their tags on a Prefect server and run untagged on the ephemeral API, where every
tagged task run would first ask the API for concurrency slots (seconds per iteration when busy)."""
from __future__ import annotations

from prefect.settings import PREFECT_API_URL, temporary_settings

from unirl.tasks.common import on_server, staged
from unirl.tasks.generate import generate
from unirl.tasks.score import score


def test_ephemeral_api_runs_tasks_untagged_and_a_server_keeps_the_tags() -> None:
    assert "gpu" in generate.tags
    with temporary_settings(set_defaults={PREFECT_API_URL: None}, restore_defaults={PREFECT_API_URL}):
        assert not on_server()
        local = staged(generate)
        assert local.tags == set() and local.fn is generate.fn and local.name == "generate"
        assert staged(generate) is local and staged(score) is not local  # built once per task
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:4200/api"}):
        assert on_server() and staged(generate) is generate


def test_a_task_made_per_call_is_never_confused_with_another() -> None:
    """Each `with_options` copy is a new object; once one is gone its id may be reused by the next,
    and the untagged copy of the dead one must not be handed out for it (a pipeline once called
    sync with generate's arguments)."""
    with temporary_settings(set_defaults={PREFECT_API_URL: None}, restore_defaults={PREFECT_API_URL}):
        for i in range(50):
            task = (generate if i % 2 else score).with_options(name=f"t{i}")
            assert staged(task).name == f"t{i}" and staged(task).fn is task.fn
