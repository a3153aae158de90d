"""Math answer rewards: `math_verify` (is the final answer right?) and `format` (is the
response shaped as asked?).

`math_verify` extracts the final answer: the content of the last `\\boxed{...}` (or `\\fbox{...}`,
braces balanced, escaped `\\{ \\}` ignored); without a complete box, the last number in the text.
It then compares it with the sample's `answer` metadata, in order, stopping at the first step
that decides:
1. strings: equal after normalisation (surrounding `$`, `\\left`/`\\right`, spacing commands,
   `\\text{}` wrappers, degrees and a leading `x =` removed; whitespace ignored);
2. numbers: when both sides are numbers (integers, decimals, `a/b`, `\\frac{a}{b}`, scientific
   notation, thousands separators as in `1,000`), they are compared exactly as rationals, so
   `0.5 == 1/2` and `1,000 == 1000`. A trailing `%` makes a side stand for the number itself or
   for it divided by 100: `50%` matches `50` and `0.5`;
3. lists: comma-separated answers (`(1, 2)`, `1,2`) with the same brackets and length match
   element by element with steps 1, 2 and 4;
4. expressions: both sides sanitised to plain sympy syntax (`\\frac{a}{b}` -> `(a)/(b)`,
   `\\sqrt{x}` -> `sqrt(x)`, `^` -> `**`, implicit multiplication as in `2x`) and parsed only
   when they pass a whitelist (at most 200 characters; digits, single-letter variables and a few
   named functions and constants; no power towers or exponents above 1000), since sympy parses
   by evaluating Python. Equal when the difference is exactly 0 as a rational; otherwise when
   both agree within 1e-9 relative in double precision, at 3 fixed positive points for the
   free symbols (a randomised identity test; symbolic `simplify` can run for minutes).
Score 1.0 or 0.0; component `extracted` is 1.0 when an answer was found. Weird text never
raises; a sample without `answer` metadata is an error naming it.
"""
from __future__ import annotations

import random
import re
from fractions import Fraction

import numpy as np

from stages.rewards.base import ScoreBatch, ScoreResult, register_scorer

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 1000
RELATIVE_TOLERANCE = 1e-9
IDENTITY_POINTS = 3

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
    out, unclosed, pos = [], False, 0
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


def _unwrap(text: str, commands: tuple[str, ...]) -> str:
    """`\\text{abc}` -> `abc` for each named command (balanced braces)."""
    pattern = re.compile(r"\\(?:" + "|".join(commands) + r")\s*\{")
    while True:
        m = pattern.search(text)
        if m is None:
            return text
        end = _closing_brace(text, m.end() - 1)
        if end < 0:
            return text
        text = text[:m.start()] + text[m.end():end] + text[end + 1:]


def normalize(answer: str) -> str:
    s = answer.strip()
    s = _unwrap(s, ("boxed", "fbox", "text", "textbf", "mathrm", "mathbf", "mbox"))
    for old, new in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\:", ""),
                     ("\\quad", " "), ("~", " "), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"),
                     ("\\%", "%"), ("\\$", ""), ("$", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("°", ""),
                     ("\\(", ""), ("\\)", ""), ("\\[", ""), ("\\]", "")):
        s = s.replace(old, new)
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\d)", r"\\sqrt{\1}", s)
    s = s.strip().rstrip(".").strip()
    m = re.fullmatch(r"[A-Za-z]\s*=\s*(.+)", s, re.DOTALL)
    if m:
        s = m.group(1).strip()
    return re.sub(r"\s+", " ", s)


_PLAIN = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d{1,3})?")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_LATEX_FRAC = re.compile(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}")


def parse_number(s: str) -> tuple[Fraction, bool] | None:
    """(value, had a percent sign) for a plain number, or None."""
    s = s.replace(" ", "")
    percent = s.endswith("%")
    if percent:
        s = s[:-1]
    if not s or len(s) > MAX_EXPRESSION_CHARS:
        return None
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    try:
        if _PLAIN.fullmatch(s):
            return Fraction(s), percent
        m = re.fullmatch(r"(-?\d+)/(-?\d+)", s) or _LATEX_FRAC.fullmatch(s)
        if m:
            sign, num, den = ("", *m.groups()) if len(m.groups()) == 2 else m.groups()
            value = Fraction(int(num), int(den))
            return (-value if sign else value), percent
    except (ValueError, ZeroDivisionError):
        return None
    return None


def numbers_equal(a: tuple[Fraction, bool], b: tuple[Fraction, bool]) -> bool:
    va = {a[0], a[0] / 100} if a[1] else {a[0]}
    vb = {b[0], b[0] / 100} if b[1] else {b[0]}
    return bool(va & vb)


# --- expressions -----------------------------------------------------------------------------
_FUNCTIONS = {"sqrt", "log", "exp", "sin", "cos", "tan"}
_CONSTANTS = {"pi", "oo"}
_LATEX_NAMES = {
    "\\cdot": "*", "\\times": "*", "\\div": "/", "\\pi": " pi ", "\\infty": " oo ", "\\ln": " log",
    "\\log": " log", "\\exp": " exp", "\\sin": " sin", "\\cos": " cos", "\\tan": " tan",
}


def _latex_to_plain(s: str) -> str | None:
    """Rewrite \\frac, \\sqrt and a few commands to plain syntax; None if LaTeX is left over."""
    for _ in range(50):
        m = re.search(r"\\(frac|sqrt)\s*", s)
        if m is None:
            break
        i = m.end()
        root = None
        if m.group(1) == "sqrt" and i < len(s) and s[i] == "[":
            close = s.find("]", i)
            if close < 0:
                return None
            root, i = s[i + 1:close], close + 1
        if i >= len(s) or s[i] != "{":
            return None
        end = _closing_brace(s, i)
        if end < 0:
            return None
        first = s[i + 1:end]
        if m.group(1) == "frac":
            if end + 1 >= len(s) or s[end + 1] != "{":
                return None
            end2 = _closing_brace(s, end + 1)
            if end2 < 0:
                return None
            replacement, end = f"(({first})/({s[end + 2:end2]}))", end2
        elif root is not None:
            replacement = f"(({first})**(1/({root})))"
        else:
            replacement = f"sqrt({first})"
        s = s[:m.start()] + replacement + s[end + 1:]
    for name, plain in sorted(_LATEX_NAMES.items(), key=lambda kv: -len(kv[0])):
        s = s.replace(name, plain)
    if "\\" in s:
        return None
    return s.replace("{", "(").replace("}", ")").replace("^", "**")


def _split_names(match: re.Match[str]) -> str:
    word = match.group(0)
    if word in _FUNCTIONS or word in _CONSTANTS:
        return word
    return "*".join(word)  # `xy` is x*y


def sanitize(s: str) -> str | None:
    """Plain, whitelisted sympy syntax for a short answer, or None when it is not one."""
    if len(s) > MAX_EXPRESSION_CHARS:
        return None
    plain = _latex_to_plain(s)
    if plain is None or len(plain) > 2 * MAX_EXPRESSION_CHARS:
        return None
    if not re.fullmatch(r"[0-9A-Za-z+\-*/(). ]*", plain) or not plain.strip():
        return None
    if re.search(r"\.(?!\d)", plain) or "__" in plain or re.search(r"\d{60,}", plain):
        return None
    if any(len(w) > 3 and w not in _FUNCTIONS | _CONSTANTS for w in re.findall(r"[A-Za-z]+", plain)):
        return None  # words, not algebra
    return re.sub(r"[A-Za-z]+", _split_names, plain)


def _parse(plain: str, evaluate: bool):
    import sympy
    from sympy.parsing.sympy_parser import implicit_multiplication, parse_expr, standard_transformations

    letters = {c: sympy.Symbol(c) for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"}
    names = {"sqrt": sympy.sqrt, "log": sympy.log, "exp": sympy.exp, "sin": sympy.sin, "cos": sympy.cos,
             "tan": sympy.tan, "pi": sympy.pi, "oo": sympy.oo}
    return parse_expr(plain, local_dict={**letters, **names}, global_dict={"__builtins__": {}, **_sympy_core()},
                      transformations=standard_transformations + (implicit_multiplication,), evaluate=evaluate)


def _sympy_core() -> dict[str, object]:
    import sympy

    # What parse_expr's generated code calls (Integer(2), Float('0.5'), Symbol('x'), ...).
    return {"Integer": sympy.Integer, "Float": sympy.Float, "Rational": sympy.Rational, "Symbol": sympy.Symbol,
            "Add": sympy.Add, "Mul": sympy.Mul, "Pow": sympy.Pow}


def _bounded(expr, budget: int = MAX_EXPONENT) -> bool:
    """No power towers and no exponent (multiplied along nested powers) above MAX_EXPONENT, so
    evaluating cannot build astronomically large numbers."""
    import sympy

    if isinstance(expr, sympy.Pow):
        exponent = expr.exp
        if not exponent.free_symbols:
            if any(isinstance(p, sympy.Pow) and p.exp != -1 for p in sympy.preorder_traversal(exponent)):
                return False
            value = abs(_values((exponent,), [], [])[0])
            if not np.isfinite(value) or value > budget:
                return False
            budget = int(budget / max(value, 1))
        elif not _bounded(exponent, MAX_EXPONENT):
            return False
        return _bounded(expr.base, budget)
    return all(_bounded(arg, budget) for arg in expr.args)


def to_sympy(answer: str):
    """A sympy expression for a whitelisted answer, or None."""
    plain = sanitize(answer)
    if plain is None:
        return None
    try:
        if not _bounded(_parse(plain, evaluate=False)):
            return None
        return _parse(plain, evaluate=True)
    except Exception:  # noqa: BLE001 - any parse failure means "not an expression"
        return None


def _values(exprs, symbols, point: list[complex]) -> list[complex]:
    """Each expression evaluated in complex double precision. Floats overflow to inf instead of
    growing without bound the way sympy's arbitrary precision does on e.g. exp(exp(exp(100)))."""
    import sympy

    out = []
    with np.errstate(all="ignore"):
        for expr in exprs:
            fn = sympy.lambdify(symbols, expr, modules="numpy")
            out.append(complex(fn(*[np.complex128(v) for v in point])))
    return out


def expressions_equal(a, b) -> bool:
    """Equal expressions: exactly when their difference is rational; otherwise within
    RELATIVE_TOLERANCE in double precision, and with free symbols at each of a few fixed
    positive points (a randomised identity test: expanding or simplifying symbolically can take
    minutes on short inputs such as `(x+1)^1000`)."""
    try:
        if a == b:
            return True
        diff = a - b
        if not diff.free_symbols and diff.is_Rational:
            return diff == 0
        symbols = sorted(diff.free_symbols, key=lambda s: s.name)
        for k in range(IDENTITY_POINTS if symbols else 1):
            point = [random.Random(f"{k}-{s.name}").uniform(0.5, 2.5) for s in symbols]
            va, vb = _values((a, b), symbols, point)
            if not (np.isfinite(va) and np.isfinite(vb)):
                return False
            if abs(va - vb) > RELATIVE_TOLERANCE * max(1.0, abs(va), abs(vb)):
                return False
        return True
    except Exception:  # noqa: BLE001 - overflow, domain errors, unprintable functions: not equal
        return False


def _split_list(s: str) -> tuple[str, list[str]] | None:
    """('(', items) for `(a, b)`, ('', items) for `a, b`; None without a top-level comma."""
    bracket = ""
    for open_, close in (("(", ")"), ("[", "]"), ("\\{", "\\}")):
        if s.startswith(open_) and s.endswith(close):
            bracket, s = open_, s[len(open_):len(s) - len(close)]
            break
    items, depth, current = [], 0, ""
    for c in s:
        depth += c in "([{"
        depth -= c in ")]}"
        if c == "," and depth == 0:
            items.append(current.strip())
            current = ""
        else:
            current += c
    items.append(current.strip())
    return (bracket, items) if len(items) > 1 else None


def _atoms_equal(a: str, b: str) -> bool:
    if a.replace(" ", "") == b.replace(" ", ""):
        return True
    na, nb = parse_number(a), parse_number(b)
    if na is not None and nb is not None:
        return numbers_equal(na, nb)
    ea, eb = to_sympy(a), to_sympy(b)
    return ea is not None and eb is not None and expressions_equal(ea, eb)


def answers_equal(predicted: str, reference: str) -> bool:
    """Whether two final answers are the same (the four steps of this module's docstring)."""
    a, b = normalize(predicted), normalize(reference)
    if a.replace(" ", "") == b.replace(" ", ""):
        return True
    na, nb = parse_number(a), parse_number(b)
    if na is not None and nb is not None:
        return numbers_equal(na, nb)
    la, lb = _split_list(a), _split_list(b)
    if la is not None and lb is not None:
        return la[0] == lb[0] and len(la[1]) == len(lb[1]) and all(_atoms_equal(x, y) for x, y in zip(la[1], lb[1]))
    if la is not None or lb is not None:
        return False
    return _atoms_equal(a, b)


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

    def __init__(self, fallback: str = "last_number") -> None:
        if fallback not in ("last_number", "none"):
            raise ValueError(f"scorer 'math_verify': fallback must be 'last_number' or 'none', got {fallback!r}")
        self.fallback = fallback

    def __call__(self, batch: ScoreBatch) -> ScoreResult:
        if batch.texts is None:
            raise ValueError("scorer 'math_verify' needs decoded texts")
        references = _answers(batch, self.name)
        scores = np.zeros(len(batch), dtype=np.float64)
        extracted = np.zeros(len(batch), dtype=np.float64)
        for i, (text, reference) in enumerate(zip(batch.texts, references)):
            found = extract_final_answer(text or "", self.fallback)
            if found is None:
                continue
            extracted[i] = 1.0
            scores[i] = float(answers_equal(found, reference))
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
