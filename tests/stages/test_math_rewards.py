import numpy as np
import pytest

from unirl.stages.rewards.base import ScoreBatch, ScorerError, aggregate, build_scorer, run_scorer, scorer_names
from unirl.stages.rewards.math import answers_equal, extract_final_answer


def score(name: str, texts: list[str], answers: list[str], **params) -> tuple[list[float], dict]:
    batch = ScoreBatch([f"g/{i}" for i in range(len(texts))], ["p"] * len(texts), texts=texts,
                       metadata=[{"answer": a} for a in answers])
    result = run_scorer(build_scorer(name, **params), batch)
    return result.scores.tolist(), {k: v.tolist() for k, v in result.components.items()}


def test_registered():
    assert {"math_verify", "format"} <= set(scorer_names())


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        ("so \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("The total is 1,000.", "1000", 1.0),
        ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 1.0),  # nested braces
        ("\\boxed{\\dfrac{3}{4}}", "3/4", 1.0),
        ("\\boxed{\\{1, 2\\}}", "\\{1,2\\}", 1.0),
        ("\\boxed{(1, 2)}", "(2, 1)", 0.0),
        ("\\boxed{x = 5}", "5", 1.0),
        ("$\\boxed{50\\%}$", "0.5", 1.0),
        ("\\boxed{50\\%}", "50", 1.0),
        ("\\boxed{50}", "0.5", 0.0),
        ("\\boxed{2^{10}}", "1024", 1.0),
        ("\\boxed{1000000001}", "10^9", 0.0),
        ("\\boxed{\\sqrt{2}}", "1.41421356237", 1.0),
        ("\\boxed{\\pi}", "3.14", 0.0),
        ("first \\boxed{1}, finally \\boxed{2}", "2", 1.0),
        ("12 - 5 = 7", "7", 1.0),
        ("x-3", "3", 1.0),  # a minus between terms is not a sign
        ("\\boxed{-7}", "-7", 1.0),
        ("\\boxed{\\text{(B)}}", "B", 1.0),
        ("the answer is 41", "42", 0.0),
    ],
)
def test_math_verify_by_hand(response, answer, expected):
    scores, comps = score("math_verify", [response], [answer])
    assert scores == [expected]
    assert comps == {"extracted": [1.0]}


def test_no_answer_is_zero_with_extracted_zero():
    scores, comps = score("math_verify", ["no idea", "\\boxed{}", "the answer is 5"], ["5", "5", "5"], fallback="none")
    assert scores == [0.0, 0.0, 0.0]
    assert comps["extracted"] == [0.0, 0.0, 0.0]
    assert score("math_verify", ["the answer is 5"], ["5"])[0] == [1.0]  # default falls back to the last number


def test_extraction():
    assert extract_final_answer("\\boxed{\\frac{a}{b}} and \\boxed{ {x} }") == "{x}"
    assert extract_final_answer("\\boxed{\\boxed{3}}") == "\\boxed{3}"
    assert answers_equal("\\boxed{3}", "3")
    assert extract_final_answer("truncated \\boxed{12") == "12"  # an unclosed box is no box
    assert extract_final_answer("v1.2 and x2 and 3.") == "3"


WEIRD = [
    "", "}}}{{{", "\\boxed{", "\\boxed{\\frac{1}{}}", "\\boxed{9^{9^{9^{9}}}}", "\\boxed{((2^{100})^{100})^{100}}",
    "\\boxed{exp(exp(exp(exp(100))))}", "\\boxed{x^{x^{x^{x}}}}", "\\boxed{1/0}", "\\boxed{" + "(" * 500 + "}",
    "\\boxed{__import__('os').system('echo pwned')}", "\\boxed{x.n()}", "9" * 5000, "\u00bd \u221e \U0001f600",
    "\\boxed{\\sqrt[}", "\\boxed{\\frac{1}", "\\boxed{(x+1)^{1000}}", "1e999999999", "\\boxed{2^{exp(exp(exp(100)))}}",
    "\\boxed{" + "9" * 59 + "^{999}}", "\\boxed{2^{999999*999999}}",
]


def test_weird_text_never_raises():
    scores, comps = score("math_verify", WEIRD, ["2"] * len(WEIRD))
    assert scores == [0.0] * len(WEIRD)
    scores, _ = score("format", WEIRD, ["2"] * len(WEIRD), preset="think_boxed")
    assert scores == [0.0] * len(WEIRD)


def test_missing_answer_names_the_sample():
    batch = ScoreBatch(["g/0", "g/1"], ["p", "p"], texts=["1", "2"], metadata=[{"answer": "1"}, {}])
    with pytest.raises(ScorerError, match="math_verify.*'g/1' has no 'answer'"):
        run_scorer(build_scorer("math_verify"), batch)


def test_format_presets_and_pattern():
    texts = [
        "reasoning \\boxed{4}",
        "\\boxed{4} or \\boxed{5}",
        "\\boxed{}",
        "<think>2+2</think> 4",
        "<think>2+2</think> \\boxed{4}",
        "<think>a</think><think>b</think> 4",
        "<think>2+2</think>   ",
        "no tags 4",
    ]
    answers = ["4"] * len(texts)
    assert score("format", texts, answers)[0] == [1, 0, 0, 0, 1, 0, 0, 0]
    assert score("format", texts, answers, preset="think")[0] == [0, 0, 0, 1, 1, 0, 0, 0]
    assert score("format", texts, answers, preset="think_boxed")[0] == [0, 0, 0, 0, 1, 0, 0, 0]
    assert score("format", texts, answers, pattern=r".*\d")[0] == [0, 0, 0, 1, 0, 1, 0, 1]
    with pytest.raises(ValueError, match="not a regular expression"):
        build_scorer("format", pattern="(")
    with pytest.raises(ValueError, match="either preset or pattern"):
        build_scorer("format", preset="think", pattern=".*")
    with pytest.raises(ValueError, match="unknown preset 'xml'"):
        build_scorer("format", preset="xml")


def test_weighted_sum_keeps_components():
    batch = ScoreBatch(["g/0", "g/1"], ["p", "p"], texts=["\\boxed{4}", "4"], metadata=[{"answer": "4"}] * 2)
    results = {n: run_scorer(build_scorer(n), batch) for n in ("math_verify", "format")}
    total = aggregate(results, {"math_verify": 1.0, "format": 0.5})
    np.testing.assert_allclose(total.scores, [1.5, 1.0])
    assert total.components["math_verify/extracted"].tolist() == [1.0, 1.0]
    assert total.components["format"].tolist() == [1.0, 0.0]


def test_scores_in_a_thread_as_the_reward_server_does():
    """math-verify's own timeouts are SIGALRM alarms that refuse to run outside a main thread: the
    scorer must still score there, and a power tower must not hang it."""
    from concurrent.futures import ThreadPoolExecutor

    texts = ["\\boxed{\\frac{1}{2}}", "\\boxed{x^2+2x+1}", "\\boxed{9^{9^{9^{9}}}}", "\\boxed{3}"]
    with ThreadPoolExecutor(1) as pool:
        scores, comps = pool.submit(score, "math_verify", texts, ["0.5", "(x+1)^2", "2", "4"]).result(timeout=120)
    assert scores == [1.0, 1.0, 0.0, 0.0]
    assert comps["extracted"] == [1.0] * 4


def test_a_started_worker_compares_without_loading_anything_under_the_alarm():
    """math-verify loads its LaTeX grammar and parts of sympy on its first comparison; under the
    TIMEOUT_S alarm that took 2.3 s on a loaded 2-core machine and scored a right answer (x^2+2x+1
    against (x+1)^2) 0. A started Checker worker has loaded them: a fresh interpreter, after
    `_start_worker`, imports no module while comparing answers of every kind the scorer meets."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(r"""
        import sys
        from unirl.stages.rewards.math import _start_worker, answers_equal
        _start_worker()
        before = set(sys.modules)
        pairs = [("x^2+2x+1", "(x+1)^2"), (r"\frac{\sqrt{3}}{2}", r"\frac{\sqrt3}{2}"), (r"50\%", "0.5"),
                 (r"\{1, 2\}", r"\{1,2\}"), ("x = 5", "5"), ("3/4", "0.75"), (r"\text{(B)}", "B")]
        assert all(answers_equal(a, b) for a, b in pairs)
        print(sorted(set(sys.modules) - before))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", f"loaded under the alarm: {done.stdout.strip()}"


def test_a_comparison_past_the_deadline_is_wrong_and_its_worker_replaced(monkeypatch):
    from unirl.stages.rewards import math as math_rewards

    checker = math_rewards.Checker(workers=1)
    kills = []
    terminate = checker._terminate
    monkeypatch.setattr(checker, "_terminate", lambda: (kills.append(1), terminate()))
    try:
        assert checker.equal([("2", "2")]) == [True]  # started: the deadline below is not spent on a spawn
        # Expanding (x+1)^1000 runs until math-verify's alarm (TIMEOUT_S, 2 s), past this deadline.
        monkeypatch.setattr(math_rewards, "DEADLINE_S", 1.0)
        assert checker.equal([("3", "3"), ("(x+1)^{1000}", "(x+2)^{1000}")]) == [True, False]
        assert len(kills) == 1
        monkeypatch.setattr(math_rewards, "DEADLINE_S", 30.0)
        assert checker.equal([("\\frac{1}{2}", "0.5")]) == [True]  # a fresh worker
    finally:
        checker.close()
