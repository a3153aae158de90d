"""Math answer rewards: `math_verify` (is the final answer right?) and `format` (is the
response shaped as asked?).

`math_verify` extracts the final answer: the content of the last `\\boxed{...}` (or `\\fbox{...}`,
braces balanced, escaped `\\{ \\}` ignored); without a complete box, the last number in the text.
It compares it with the sample's `answer` metadata with Hugging Face's math-verify (`parse` of
each as LaTeX or a plain expression, then `verify(gold, answer)`): numbers after rounding to 6
decimals (`0.5 == 1/2`, `50\\% == 0.5`, `1,000 == 1000`), sets, intervals and tuples element by
element, an equation by its right side (`x = 5` is 5), otherwise sympy expressions that
simplify to each other (`x^2+2x+1 == (x+1)^2`); units and letter case are ignored (`5 cm` is 5,
`B` is `b`).

sympy can run for ever on short input (`9^{9^{9^{9}}}`), and math-verify's timeouts are SIGALRM
alarms that work only in a process's main thread, while the reward server scores in threads. So
the comparisons run in a few spawned worker processes (`Checker`), in their main threads under
math-verify's TIMEOUT_S per parse and per comparison; a worker that still has no answer after
DEADLINE_S (C code the alarm cannot interrupt) is killed and its answer counts as wrong. An
answer longer than MAX_ANSWER_CHARS is wrong without being parsed.
Score 1.0 or 0.0; component `extracted` is 1.0 when an answer was found. Weird text never
raises; a sample without `answer` metadata is an error naming it.
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.pool
import os
import re
import threading
from typing import Literal

import numpy as np

from unirl.stages.rewards.base import ScoreBatch, ScoreResult, register_scorer

MAX_ANSWER_CHARS = 1000
TIMEOUT_S = 2  # math-verify's alarms take whole seconds
DEADLINE_S = 30.0

_BOX_START = re.compile(r"\\(?:boxed|fbox)\s*\{")
_NUMBER = re.compile(
    r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?%?"
    r"|(?<![\w.])-?\.\d+%?"
)


def _closing_brace(text: str, open_at: int) -> int:
    """Index of the `}` matching the `{` at `open_at`, or -1. `\\{` and `\\}` are not structure."""
    depth, i = 0, open_at
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text) and text[i + 1] in "{}":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return -1


def boxed_contents(text: str) -> tuple[list[str], bool]:
    """Contents of the outermost complete `\\boxed{...}`s, in order, and whether an unclosed box was seen."""
    out: list[str] = []
    unclosed, pos = False, 0
    while True:
        m = _BOX_START.search(text, pos)
        if m is None:
            return out, unclosed
        end = _closing_brace(text, m.end() - 1)
        if end < 0:
            return out, True
        out.append(text[m.end():end])
        pos = end + 1


def extract_final_answer(text: str, fallback: str = "last_number") -> str | None:
    """The last complete `\\boxed{}`'s content; else (with `fallback="last_number"`) the last
    number in the text; None when there is none. An empty last box counts as no answer."""
    boxes, _ = boxed_contents(text)
    if boxes:
        content = boxes[-1].strip()
        return content or None
    if fallback == "last_number":
        numbers = _NUMBER.findall(text)
        return numbers[-1] if numbers else None
    return None


def answers_equal(predicted: str, reference: str) -> bool:
    """Whether two final answers are the same, by math-verify. Uses its SIGALRM timeouts, so it runs
    in a process's main thread (the Checker's workers); never raises."""
    # start-up time: math_verify loads on first use, not when a recipe is read
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    if len(predicted) > MAX_ANSWER_CHARS:
        return False
    # `$...$` makes a bare answer LaTeX for the extractor; a plain `3/4` is found as an expression.
    configs = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    try:
        gold = parse(f"${reference}$", configs, parsing_timeout=TIMEOUT_S)
        answer = parse(f"${predicted}$", configs, parsing_timeout=TIMEOUT_S)
        return bool(gold and answer and verify(gold, answer, timeout_seconds=TIMEOUT_S))
    except Exception:  # noqa: BLE001 - math-verify returns False on its own errors; anything else is "not equal" too
        return False


def _start_worker() -> None:
    """Import and warm math-verify before the first answer's alarm: its first comparison in a process
    loads the LaTeX grammar and sympy's simplifier lazily (2.3 s on a loaded 2-core machine, against
    0.02 s after), which under TIMEOUT_S would score that process's first right answer wrong."""
    answers_equal("\\frac{x^2+2x+1}{2}", "(x+1)^2/2")
    # A timed-out comparison is the expected fate of a runaway answer (it scores 0), not news.
    logging.getLogger("math_verify").setLevel(logging.ERROR)


class Checker:
    """`answers_equal` in `workers` spawned processes, started on first use and shared by every
    `math_verify` scorer of this process (owned by CHECKER, closed at exit). Spawned, not forked:
    the scorer's process has threads (the reward server, torch)."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._pool: multiprocessing.pool.Pool | None = None
        self._lock = threading.Lock()  # one batch at a time: a kill must not take another batch's jobs

    def equal(self, pairs: list[tuple[str, str]]) -> list[bool]:
        """Whether each (predicted, reference) is the same answer; False for one still running after
        DEADLINE_S (its worker is killed; the rest of the batch goes to fresh workers)."""
        out = [False] * len(pairs)
        todo = list(range(len(pairs)))
        with self._lock:
            while todo:
                if self._pool is None:
                    self._pool = multiprocessing.get_context("spawn").Pool(self.workers, initializer=_start_worker)
                jobs = [(i, self._pool.apply_async(answers_equal, pairs[i])) for i in todo]
                todo = []
                for k, (i, job) in enumerate(jobs):
                    try:
                        out[i] = job.get(timeout=DEADLINE_S)
                    except multiprocessing.TimeoutError:
                        self._terminate()
                        todo = [j for j, _ in jobs[k + 1:]]
                        break
        return out

    def _terminate(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def close(self) -> None:
        with self._lock:
            self._terminate()


CHECKER = Checker(workers=min(4, os.cpu_count() or 1))
atexit.register(CHECKER.close)


def _answers(batch: ScoreBatch, scorer: str) -> list[str]:
    out = []
    for sid, meta in zip(batch.sample_ids, batch.metadata):
        if meta.get("answer") is None:
            raise ValueError(f"scorer {scorer!r}: sample {sid!r} has no 'answer' metadata")
        out.append(str(meta["answer"]))
    return out


@register_scorer("math_verify", reads=("text",))
class MathVerify:
    """1.0 when the final answer equals the `answer` metadata (see the module docstring), else 0.0.

    fallback: `last_number` (default) takes the last number when no box is complete; `none`
    requires a `\\boxed{}` answer. Component `extracted`: 1.0 when an answer was found.
    """

    name = "math_verify"

    def __init__(self, fallback: Literal["last_number", "none"] = "last_number") -> None:
        if fallback not in ("last_number", "none"):
            raise ValueError(f"scorer 'math_verify': fallback must be 'last_number' or 'none', got {fallback!r}")
        self.fallback = fallback

    def __call__(self, batch: ScoreBatch) -> ScoreResult:
        if batch.texts is None:
            raise ValueError("scorer 'math_verify' needs decoded texts")
        references = _answers(batch, self.name)
        found = [extract_final_answer(text or "", self.fallback) for text in batch.texts]
        extracted = np.array([f is not None for f in found], dtype=np.float64)
        asked = [i for i, f in enumerate(found) if f is not None]
        scores = np.zeros(len(batch), dtype=np.float64)
        scores[asked] = CHECKER.equal([(f, references[i]) for i, f in enumerate(found) if f is not None])
        return ScoreResult(scores, {"extracted": extracted})


# --- format ----------------------------------------------------------------------------------
FORMAT_PRESETS = ("boxed", "think", "think_boxed")


def one_box(text: str) -> bool:
    boxes, unclosed = boxed_contents(text)
    return len(boxes) == 1 and not unclosed and bool(boxes[0].strip())


def think_then_answer(text: str) -> str | None:
    """The answer after one leading `<think>...</think>` block (reasoning may be empty), or None."""
    s = text.strip()
    if not s.startswith("<think>"):
        return None
    end = s.find("</think>")
    if end < 0:
        return None
    inner, rest = s[len("<think>"):end], s[end + len("</think>"):]
    if "<think>" in inner or "<think>" in rest or "</think>" in rest or not rest.strip():
        return None
    return rest


@register_scorer("format", reads=("text",))
class Format:
    """1.0 when the response has the asked-for shape, else 0.0.

    preset `boxed` (the default): exactly one complete, non-empty `\\boxed{...}`;
    `think`: `<think>reasoning</think>` first, then a non-empty answer, no other think tags;
    `think_boxed`: `think` whose answer has exactly one box.
    pattern: a regular expression the whole response must match instead (`re.DOTALL`).
    """

    name = "format"

    def __init__(self, preset: str | None = None, pattern: str | None = None) -> None:
        if preset is not None and pattern is not None:
            raise ValueError("scorer 'format': give either preset or pattern, not both")
        if preset is not None and preset not in FORMAT_PRESETS:
            raise ValueError(f"scorer 'format': unknown preset {preset!r} (allowed: {', '.join(FORMAT_PRESETS)})")
        self.preset = preset or ("boxed" if pattern is None else None)
        try:
            self.pattern = re.compile(pattern, re.DOTALL) if pattern is not None else None
        except re.error as exc:
            raise ValueError(f"scorer 'format': pattern {pattern!r} is not a regular expression ({exc})") from None

    def check(self, text: str) -> bool:
        if self.pattern is not None:
            return self.pattern.fullmatch(text) is not None
        if self.preset == "boxed":
            return one_box(text)
        answer = think_then_answer(text)
        return answer is not None and (self.preset == "think" or one_box(answer))

    def __call__(self, batch: ScoreBatch) -> ScoreResult:
        if batch.texts is None:
            raise ValueError("scorer 'format' needs decoded texts")
        return ScoreResult(np.array([float(self.check(t or "")) for t in batch.texts], dtype=np.float64))
