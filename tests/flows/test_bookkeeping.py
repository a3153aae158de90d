"""The run loop's background bookkeeping (flows/bookkeeping.py): jobs run in order, off the caller's
thread, in the caller's context, and a failed job fails the run on the caller's thread."""
from __future__ import annotations

import contextvars
import threading

import pytest

from unirl.flows.bookkeeping import Bookkeeping

WHO = contextvars.ContextVar("who", default="nobody")


def test_jobs_run_in_order_on_another_thread_with_the_callers_context():
    seen = []
    release = threading.Event()
    books = Bookkeeping()
    WHO.set("rl-train")
    books.submit(release.wait, 10)  # the caller does not wait for a slow job
    for i in range(5):
        books.submit(lambda i=i: seen.append((i, WHO.get(), threading.current_thread() is threading.main_thread())))
    assert seen == []
    release.set()
    books.close()
    assert seen == [(i, "rl-train", False) for i in range(5)]


def test_a_failed_job_is_raised_at_the_next_submit_or_at_close():
    books = Bookkeeping()
    books.submit(lambda: (_ for _ in ()).throw(OSError("MLflow is down")))
    books._pending[0].exception()  # wait until it has failed
    with pytest.raises(OSError, match="MLflow is down"):
        books.submit(lambda: None)
    books.close()
    later = Bookkeeping()
    later.submit(lambda: (_ for _ in ()).throw(ValueError("bad metric")))
    with pytest.raises(ValueError, match="bad metric"):
        later.close()
