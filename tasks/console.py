"""What `unirl` shows on the console: its own lines (`[unirl] ...`) and, on a terminal, one live
progress line per run (iteration i/N, reward, loss, seconds per iteration, ETA) that held-out
results and warnings print above. Not on a terminal (a log file, CI, a test) every iteration is a
line of its own. Prefect's per-task INFO chatter stays in the Prefect UI / API and the run's log
file (`logs/` in a local run folder), and comes back on the console with `unirl run --verbose`.
"""
from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import TextIO

QUIET_ENV = {
    # Prefect's console handler shows warnings and errors only; the API handler still gets INFO.
    "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "WARNING",
    # MLflow's schema migrations and Hugging Face's progress bars say nothing a user acts on.
    "MLFLOW_LOGGING_LEVEL": "WARNING",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
}
EPHEMERAL_ENV = {
    # The ephemeral API server's telemetry heartbeat fails loudly offline (and fights the
    # server's own SQLite writes); nothing of it is needed for a local run.
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
}


def quiet_prefect(verbose: bool) -> None:
    """Before Prefect configures its logging: keep its INFO lines off the console unless `verbose`,
    and the ephemeral server's telemetry off."""
    for key, value in {**EPHEMERAL_ENV, **({} if verbose else QUIET_ENV)}.items():
        os.environ.setdefault(key, value)


class _FailureTraces(logging.Filter):
    """Prefect's engines log a failed task's or flow's whole traceback at ERROR, once per task,
    flow and retry; `unirl` prints the error once itself, so those stay in the log file and the
    Prefect UI."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and record.name.startswith(
            ("prefect.task_runs", "prefect.flow_runs", "prefect.task_engine", "prefect.flow_engine")))


def failures_once(verbose: bool) -> None:
    """After Prefect configured its logging: unless `verbose`, its console handlers leave failure
    tracebacks to the log file (the CLI's `error:` line says what failed)."""
    if verbose:
        return
    # start-up time: prefect loads on first use, not when a recipe is read
    import prefect.main  # noqa: F401 - configures Prefect's logging (its handlers exist from here on)
    from prefect.logging.handlers import PrefectConsoleHandler  # start-up time: prefect loads on first use, not when a recipe is read

    names = ["prefect", *(n for n in logging.root.manager.loggerDict if n.startswith("prefect."))]
    for logger in [logging.root, *map(logging.getLogger, names)]:
        for handler in logger.handlers:
            if isinstance(handler, PrefectConsoleHandler) and not any(isinstance(f, _FailureTraces) for f in handler.filters):
                handler.addFilter(_FailureTraces())
    # Prefect's event stream logs a traceback when its websocket's keepalive fails, as it does while
    # a local API server that died is started again (a `[unirl]` line says so; it reconnects).
    logging.getLogger("websockets.client").setLevel(logging.CRITICAL)


def error_text(exc: BaseException, lines: int = 30) -> str:
    """`Type: message`, its middle cut when longer than `lines` lines (a traceback's last lines
    name the error; the whole of it is in the run's log file)."""
    text = f"{type(exc).__name__}: {exc}".rstrip().splitlines()
    if len(text) <= lines:
        return "\n".join(text)
    head, tail = 8, lines - 8
    return "\n".join([*text[:head], f"... ({len(text) - lines} lines more in the run's logs/ folder) ...", *text[-tail:]])


def log_to_run_folder(local_dir: Path | None) -> Path | None:
    """Prefect's records of this process also go to `<run>/logs/unirl-<time>.log` (local storage)."""
    if local_dir is None:
        return None
    path = local_dir / "logs" / f"unirl-{datetime.now().strftime('%Y%m%d-%H%M%S')}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    from prefect.logging.formatters import PrefectFormatter  # start-up time: prefect loads on first use, not when a recipe is read

    handler = logging.FileHandler(path)
    handler.setFormatter(PrefectFormatter(
        format="%(asctime)s | %(levelname)-7s | %(name)s - %(message)s",
        flow_run_fmt="%(asctime)s | %(levelname)-7s | Flow run %(flow_run_name)r - %(message)s",
        task_run_fmt="%(asctime)s | %(levelname)-7s | Task run %(task_run_name)r - %(message)s",
    ))
    handler.setLevel(logging.INFO)
    logging.getLogger("prefect").addHandler(handler)
    return path


def _run_logger() -> logging.Logger | logging.LoggerAdapter | None:
    """The current Prefect flow or task run's logger (its records reach the run's Logs tab in the
    UI through the API), or None outside a run."""
    from prefect.context import FlowRunContext, TaskRunContext  # start-up time: prefect loads on first use, not when a recipe is read

    if FlowRunContext.get() is None and TaskRunContext.get() is None:
        return None
    from prefect.logging import get_run_logger  # start-up time: prefect loads on first use, not when a recipe is read

    try:
        return get_run_logger()
    except Exception:  # noqa: BLE001 - a line for the console must never fail the run
        return None


def _console_shows(logger: logging.Logger | logging.LoggerAdapter) -> bool:
    """Whether an INFO record of `logger` reaches a console handler (a deployment's worker shows
    run logs on its terminal; `unirl run` keeps Prefect's console at WARNING, QUIET_ENV)."""
    node: logging.Logger | None = logger.logger if isinstance(logger, logging.LoggerAdapter) else logger
    while node is not None:
        for handler in node.handlers:
            if (isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)
                    and handler.level <= logging.INFO):
                return True
        node = node.parent if node.propagate else None
    return False


def say(text: str, stream: TextIO | None = None) -> None:
    """A line of `unirl`'s own, above the live progress line if there is one; inside a Prefect run
    also in the run's logs (the Logs tab of a run started from the UI), printed once either way."""
    logger = _run_logger()
    if logger is not None:
        logger.info(text)
        if stream is None and _console_shows(logger):
            return
    Progress.clear_line(stream or sys.stdout)
    print(text, file=stream or sys.stdout, flush=True)


def iteration_line(i: int, total: int, m: dict[str, float]) -> str:
    """One line per iteration; kl and clip only for losses that have them (not NFT's), kl only
    when the policy moved from the one that sampled (not with one on-policy update per batch,
    where it is 0 by construction)."""
    kl = f"  kl {m['train/approx_kl']:.2e}" if m.get("train/approx_kl") else ""
    clip = f"  clip {m['train/clip_frac']:.3f}" if "train/clip_frac" in m else ""
    if "train/loss" not in m and "train/accumulated_batches" in m:  # rollout accumulation: the update comes later
        return (f"[unirl] iter-{i:06d} ({i + 1}/{total})  reward {m['rollout/reward_mean']:.3f}±{m['rollout/reward_std']:.3f}"
                f"  batch {int(m['train/accumulated_batches'])} accumulated, no update yet{agent_part(m)}  {m['time/iteration_s']:.1f}s")
    if "train/loss" not in m:  # a pipeline: each trained part's loss and gradient norm
        sides = sorted({k.split("/")[1] for k in m if k.startswith("train/") and k.endswith("/loss")})
        losses = "".join(f"  {s} loss {m[f'train/{s}/loss']:+.4f}" for s in sides)
        # a pipeline's parts step apart (a gradient norm each); a unified model's stages step together
        grads = [f" {s} {m[f'train/{s}/grad_norm']:.3f}" for s in sides if f"train/{s}/grad_norm" in m]
        losses += f"  grad{''.join(grads)}" if grads else (f"  grad {m['train/grad_norm']:.3f}" if "train/grad_norm" in m else "")
        return (f"[unirl] iter-{i:06d} ({i + 1}/{total})  reward {m['rollout/reward_mean']:.3f}±{m['rollout/reward_std']:.3f}"
                f"{losses}  {m['time/iteration_s']:.1f}s")
    return (
        f"[unirl] iter-{i:06d} ({i + 1}/{total})  reward {m['rollout/reward_mean']:.3f}±{m['rollout/reward_std']:.3f}"
        f"{domain_part(m)}  loss {m['train/loss']:+.4f}{kl}{clip}  grad {m['train/grad_norm']:.3f}{agent_part(m)}"
        f"{masked_part(m)}  {m['time/iteration_s']:.1f}s"
    )


def masked_part(m: dict[str, float]) -> str:
    """The share of response tokens the behaviour check masked (a replay a hair off its record,
    stages/algorithms/base.py), when any was."""
    frac = m.get("train/behaviour_masked_frac", 0.0)
    return f"  masked {frac:.2%} tok (replay off record)" if frac > 0 else ""


def domain_part(m: dict[str, float]) -> str:
    """A mixture's reward per domain and, with distillation, the reverse KL to the teachers per
    domain (`rkl`): `(add 0.62 rkl 0.31, sub 0.41 rkl 0.55)`."""
    domains = [k.split("/")[1] for k in m if k.startswith("rollout/") and k.endswith("/reward_mean") and k.count("/") == 2]
    parts = [f"{d} {m[f'rollout/{d}/reward_mean']:.2f}" + (f" rkl {m[f'distill/{d}/reverse_kl']:.3f}"
                                                             if f"distill/{d}/reverse_kl" in m else "") for d in domains]
    if not parts and "distill/reverse_kl" in m:
        return f"  rkl {m['distill/reverse_kl']:.3f}"
    return f"  ({', '.join(parts)})" if parts else ""


def agent_part(m: dict[str, float]) -> str:
    """An agentic run's turns per trajectory, tool calls and their success, and why trajectories stopped."""
    if "agent/turns_mean" not in m:
        return ""
    stops = " ".join(f"{k.removeprefix('agent/stop_')} {v:.2f}" for k, v in sorted(m.items())
                     if k.startswith("agent/stop_") and v > 0)
    return (f"  turns {m['agent/turns_mean']:.2f}  calls {m['agent/tool_calls_mean']:.2f}"
            f" ok {m['agent/tool_success']:.2f}  stop {stops}")


class Progress:
    """The run's progress: a live line on a terminal, a line per iteration elsewhere."""

    _live: bool = False  # a live line is on screen (class-wide: one console)

    def __init__(self, total: int, first: int, stream: TextIO | None = None):
        self.total, self.first, self.stream = total, first, stream or sys.stdout
        self.tty = self.stream.isatty()
        self.started = time.monotonic()

    def iteration(self, i: int, m: dict[str, float]) -> None:
        if not self.tty:
            say(iteration_line(i, self.total, m), self.stream if self.stream is not sys.stdout else None)
            return
        logger = _run_logger()
        if logger is not None:  # the run's logs get the full line; the terminal the live one
            logger.info(iteration_line(i, self.total, m))
        done = i + 1 - self.first
        per = (time.monotonic() - self.started) / max(done, 1)
        left = per * (self.total - i - 1)
        width = max(10, min(30, shutil.get_terminal_size((100, 20)).columns - 90))
        filled = int(width * (i + 1) / self.total)
        bar = "█" * filled + "░" * (width - filled)
        loss = m.get("train/loss", next((v for k, v in sorted(m.items()) if k.startswith("train/") and k.endswith("/loss")), 0.0))
        line = (f"[unirl] {bar} {i + 1}/{self.total}  reward {m['rollout/reward_mean']:.3f}  loss {loss:+.4f}"
                f"  {per:.1f} s/it  ETA {_clock(left)}")
        self.stream.write("\r\x1b[2K" + line)
        self.stream.flush()
        Progress._live = True

    def close(self) -> None:
        if self.tty and Progress._live:
            self.stream.write("\n")
            self.stream.flush()
            Progress._live = False

    @staticmethod
    def clear_line(stream: TextIO) -> None:
        if Progress._live and stream.isatty():
            stream.write("\r\x1b[2K")
            stream.flush()


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else f"{seconds // 60}:{seconds % 60:02d}"
