import re

import pytest

from unirl.stages.toys.arithmetic import Arithmetic, arithmetic_source, evaluate, render


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


def test_dev_and_test_fixed_distinct_disjoint_and_never_trained_on():
    a = Arithmetic(heldout_size=30, seed=3)  # 100 possible one-digit sums: dev and test are 30% of them each
    b = Arithmetic(heldout_size=30, seed=3)
    dev, test = ([p.metadata["expr"] for p in a.heldout(split)] for split in ("dev", "test"))
    assert dev == [p.metadata["expr"] for p in b.heldout("dev")] and test == [p.metadata["expr"] for p in b.heldout("test")]
    assert a.heldout() == a.heldout("dev")
    assert len(set(dev)) == len(set(test)) == 30 and not set(dev) & set(test)
    trained = {p.metadata["expr"] for it in range(60) for p in a.batch(it, 16)}
    assert trained and not trained & (set(dev) | set(test))
    assert len(trained) == 40  # every other expression does show up
    assert [p.prompt_id for p in a.heldout("test")[:2]] == ["test-00000", "test-00001"]
    with pytest.raises(ValueError, match="unknown held-out split 'train' \\(allowed: dev, test\\)"):
        a.heldout("train")


def test_dev_is_the_heldout_split_of_before_the_test_split():
    # Computed before the test split existed: recipes tuned on the held-out split were tuned on dev.
    src = Arithmetic(heldout_size=16, seed=1234)
    assert [p.text for p in src.heldout("dev")] == ["4+7=", "5+6=", "4+0=", "7+8=", "6+5=", "6+2=", "8+2=", "1+0=", "6+4=",
                                                     "5+1=", "9+9=", "2+8=", "7+5=", "0+8=", "2+0=", "2+9="]
    src = Arithmetic(digits=2, operators=["+", "*"], heldout_size=16, seed=7)
    assert [p.text for p in src.heldout("dev")[:6]] == ["11+34=", "82*18=", "66*44=", "34*20=", "80+52=", "85+50="]
    assert src.heldout("dev")[0].prompt_id == "heldout-00000"


def test_deterministic_per_seed_and_iteration():
    # Recorded once: a resumed run (another process, another hash() salt) draws these again.
    a = Arithmetic(digits=3, seed=7)
    assert [p.text for p in a.batch(4, 8)] == ["513+171=", "813+726=", "547+886=", "549+588=", "890+122=", "551+646=",
                                               "367+192=", "411+798="]
    assert [p.text for p in a.batch(4, 8)] != [p.text for p in a.batch(5, 8)]
    assert [p.text for p in a.batch(4, 8)] != [p.text for p in Arithmetic(digits=3, seed=8).batch(4, 8)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(operands=5), "data.operands"),
        (dict(operators=["/"]), "data.operators"),
        (dict(template="Compute:"), "data.template"),
        (dict(min_value=9, max_value=2), "data.min_value"),
        (dict(heldout_size=50), "data.heldout_size: 100 possible expressions cannot give two disjoint held-out splits"),
    ],
)
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Arithmetic(**kwargs)


def test_built_from_a_recipe_section():
    from unirl.stages.sources.arithmetic import ArithmeticData

    src = arithmetic_source(ArithmeticData(digits=2, heldout_size=3, seed=9))
    assert len(src.heldout()) == len(src.heldout("test")) == 3 and src.operands == 2 and src.template == "{expr}="
    assert ArithmeticData(heldout_size=49).heldout_size == 49  # 100 one-digit sums: 2 x 49 held out leave 2 to train on
    with pytest.raises(ValueError, match="data.heldout_size: two held-out splits \\(dev and test\\) of 50 prompts leave none"):
        ArithmeticData(heldout_size=50)
