import re

import pytest

from stages.arithmetic import Arithmetic, arithmetic_source, evaluate, render


def test_precedence_by_hand():
    assert evaluate([2, 3, 4], ["+", "*"]) == 14
    assert evaluate([2, 3, 4], ["*", "+"]) == 10
    assert evaluate([10, 2, 3], ["-", "-"]) == 5
    assert evaluate([2, 3, 4, 5], ["*", "+", "*"]) == 26
    assert evaluate([7, 2, 3, 4], ["-", "*", "-"]) == -3
    assert render([-3, 4, -2], ["+", "*"]) == "(-3)+4*(-2)"


@pytest.mark.parametrize("operands", [2, 3, 4])
def test_operands_ranges_and_answers(operands):
    src = Arithmetic(digits=2, operators=["+", "-", "*"], operands=operands, heldout_size=4, seed=1)
    for p in src.batch(0, 50) + src.heldout():
        expr = p.text[:-1]
        assert p.text.endswith("=") and p.metadata["expr"] == expr
        numbers = [int(x) for x in re.findall(r"\d+", expr)]
        assert len(numbers) == operands and all(10 <= x <= 99 for x in numbers)
        assert int(p.metadata["answer"]) == eval(expr)  # our own generated text; Python has the same precedence


def test_min_max_values_and_template():
    src = Arithmetic(operators=["-"], operands=3, min_value=-5, max_value=5, heldout_size=2,
                     template="What is {expr}? Answer: ", seed=2)
    batch = src.batch(0, 40)
    assert any("(-" in p.text for p in batch)
    for p in batch:
        m = re.fullmatch(r"What is (.+)\? Answer: ", p.text)
        assert m and m.group(1) == p.metadata["expr"]
        values = [int(neg or pos) for neg, pos in re.findall(r"\((-\d+)\)|(\d+)", m.group(1))]
        assert len(values) == 3 and all(-5 <= v <= 5 for v in values)
        assert int(p.metadata["answer"]) == values[0] - values[1] - values[2]


def test_heldout_fixed_distinct_and_never_trained_on():
    a = Arithmetic(heldout_size=30, seed=3)  # 100 possible one-digit sums: held-out is 30% of them
    b = Arithmetic(heldout_size=30, seed=3)
    held = [p.metadata["expr"] for p in a.heldout()]
    assert held == [p.metadata["expr"] for p in b.heldout()]
    assert len(set(held)) == 30
    trained = {p.metadata["expr"] for it in range(50) for p in a.batch(it, 16)}
    assert trained and not trained & set(held)
    assert len(trained) == 70  # every other expression does show up


def test_deterministic_per_seed_and_iteration():
    a, b = Arithmetic(digits=3, seed=7), Arithmetic(digits=3, seed=7)
    assert [p.text for p in a.batch(4, 8)] == [p.text for p in b.batch(4, 8)]
    assert [p.text for p in a.batch(4, 8)] != [p.text for p in a.batch(5, 8)]
    assert [p.text for p in a.batch(4, 8)] != [p.text for p in Arithmetic(digits=3, seed=8).batch(4, 8)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(operands=5), "data.operands"),
        (dict(operators=["/"]), "data.operators"),
        (dict(template="Compute:"), "data.template"),
        (dict(min_value=9, max_value=2), "data.min_value"),
        (dict(heldout_size=100), "cannot give 100 distinct held-out"),
    ],
)
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Arithmetic(**kwargs)


def test_built_from_a_recipe_section():
    from stages.sources.arithmetic import ArithmeticData

    src = arithmetic_source(ArithmeticData(digits=2, heldout_size=3, seed=9))
    assert len(src.heldout()) == 3 and src.operands == 2 and src.template == "{expr}="
