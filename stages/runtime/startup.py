"""Start-up of a unirl process (`unirl`, a worker rank): its imports run without the cyclic
garbage collector.

Importing torch, transformers, prefect and mlflow allocates a few million objects and frees
almost none, so the collector's passes over them are wasted: about a fifth of a process's start-up
CPU (benchmarks/README.md, "Start-up"). `imports_done()` then moves everything allocated so far
to the collector's permanent generation (`gc.freeze`: later full collections skip it) and turns
the collector back on for the run itself.
"""
from __future__ import annotations

import gc
import importlib


def importing() -> None:
    """Call first thing in an entry point: the collector is off until `imports_done()`."""
    gc.disable()


def imports_done(*modules: str) -> None:
    """The heavy imports are done (after `modules`, ones the command imports later anyway): freeze
    what they made and collect from here on as usual."""
    for module in modules:
        importlib.import_module(module)
    gc.freeze()
    gc.enable()
