"""One run's events (stages/run/events.py): foreground readers in order on the emitter's thread,
background readers in order on one other thread in the emitter's context, a failed background
reader fails the run at the next emit or at close, and a failed run's end reaches every reader."""
from __future__ import annotations

import contextvars
import threading

import pytest

from unirl.stages.run.events import IterationCommitted, Lane, RunEvents, RunFinished, RunStarted, VersionPublished

WHO = contextvars.ContextVar("who", default="nobody")


class Recorder:
    def __init__(self, fail_on: type | None = None):
        self.seen: list[tuple[object, str, bool]] = []
        self.fail_on = fail_on

    def on(self, event: object) -> None:
        if self.fail_on is not None and isinstance(event, self.fail_on):
            raise OSError("MLflow is down")
        self.seen.append((event, WHO.get(), threading.current_thread() is threading.main_thread()))


def test_jobs_run_in_order_on_another_thread_with_the_callers_context():
    seen = []
    release = threading.Event()
    lane = Lane()
    WHO.set("rl-train")
    lane.submit(release.wait, 10)  # the caller does not wait for a slow job
    for i in range(5):
        lane.submit(lambda i=i: seen.append((i, WHO.get(), threading.current_thread() is threading.main_thread())))
    assert seen == []
    release.set()
    lane.close()
    assert seen == [(i, "rl-train", False) for i in range(5)]


def test_readers_get_every_event_in_order_foreground_at_once_background_on_the_lane():
    console, mlflow = Recorder(), Recorder()
    events = RunEvents()
    events.subscribe(console)
    events.subscribe(mlflow, background=True)
    WHO.set("rl-train")
    sent = [RunStarted(0), VersionPublished(0), IterationCommitted(0, {"metrics": {}})]
    for event in sent:
        events.emit(event)
    assert [e for e, _, _ in console.seen] == sent and all(main for _, _, main in console.seen)
    events.close(RunFinished(ok=True))
    assert [e for e, _, _ in mlflow.seen] == [*sent, RunFinished(ok=True)]
    assert all(who == "rl-train" and not main for _, who, main in mlflow.seen)


def test_a_failed_background_reader_fails_the_run_at_the_next_emit_or_at_close():
    events = RunEvents()
    events.subscribe(Recorder(fail_on=VersionPublished), background=True)
    events.emit(VersionPublished(1))
    events._lane._pending[0].exception()  # wait until it has failed
    with pytest.raises(OSError, match="MLflow is down"):
        events.emit(RunStarted(0))
    later = RunEvents()
    later.subscribe(Recorder(fail_on=RunFinished), background=True)
    with pytest.raises(OSError, match="MLflow is down"):
        later.close(RunFinished(ok=True))


def test_a_failed_run_tells_every_reader_whatever_failed_before(caplog):
    """The run's own error is the one raised: a reader that failed earlier, or fails now, is
    logged, and the others still hear that the run ended (MLflow marks it FAILED)."""
    broken, mlflow, console = Recorder(fail_on=VersionPublished), Recorder(), Recorder()
    events = RunEvents()
    events.subscribe(console)
    events.subscribe(broken, background=True)
    events.subscribe(mlflow, background=True)
    events.emit(VersionPublished(3))
    events.close(RunFinished(ok=False))  # does not raise
    assert [e for e, _, _ in mlflow.seen] == [VersionPublished(3), RunFinished(ok=False)]
    assert [e for e, _, _ in console.seen] == [VersionPublished(3), RunFinished(ok=False)]
    assert "MLflow is down" in caplog.text


def test_after_a_failed_success_close_the_failed_end_still_reaches_the_readers():
    """`train_run` closes with ok=True inside its try; when a reader fails there, the failure path
    closes again with ok=False: the lane is gone, so the readers are told on the caller's thread."""
    mlflow = Recorder()
    events = RunEvents()
    events.subscribe(Recorder(fail_on=RunFinished), background=True)
    events.subscribe(mlflow, background=True)
    with pytest.raises(OSError):
        events.close(RunFinished(ok=True))
    events.close(RunFinished(ok=False))
    assert [e for e, _, _ in mlflow.seen] == [RunFinished(ok=True), RunFinished(ok=False)]
