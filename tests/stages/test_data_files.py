import json
import os
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from unirl.stages.sources.data_files import DataFileError, FilePrompts, file_prompt_source, read_records


def write_jsonl(path: Path, rows: list, blank_after: int | None = None) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    if blank_after is not None:
        lines.insert(blank_after, "")
    path.write_text("\n".join(lines) + "\n")
    return path


def rows(n: int) -> list[dict]:
    return [{"prompt": f"{i}+1=", "answer": i + 1, "level": "easy" if i % 2 else "hard"} for i in range(n)]


def test_metadata_carries_answer_and_other_columns_as_strings(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "2+2=", "solution": 4, "tags": ["a", "b"], "w": 0.5}])
    src = FilePrompts(path=path, prompt_column="question", answer_column="solution", seed=0)
    (p,) = src.batch(0, 1)
    assert p.text == "2+2="
    assert p.metadata == {"answer": "4", "tags": '["a", "b"]', "w": "0.5"}


def test_epoch_covers_every_prompt_once_before_repeats(tmp_path):
    src = FilePrompts(path=write_jsonl(tmp_path / "d.jsonl", rows(10)), seed=1)
    # n divides the dataset: two iterations are one epoch.
    assert sorted(p.text for it in (0, 1) for p in src.batch(it, 5)) == sorted(r["prompt"] for r in rows(10))
    assert sorted(p.text for it in (2, 3) for p in src.batch(it, 5)) == sorted(r["prompt"] for r in rows(10))
    # n does not divide it: the stream is still epoch after epoch.
    stream = [p.text for it in range(7) for p in src.batch(it, 3)]
    assert sorted(stream[:10]) == sorted(stream[10:20]) == sorted(r["prompt"] for r in rows(10))
    assert stream[:10] != stream[10:20]  # each epoch has its own order


def test_deterministic_per_seed_and_iteration(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", rows(30))
    # Recorded once: a resumed run (another process, another hash() salt) draws these again.
    a = FilePrompts(path=path, seed=4)
    assert [p.text for p in a.batch(3, 8)] == ["23+1=", "13+1=", "20+1=", "1+1=", "18+1=", "12+1=", "27+1=", "24+1="]
    assert [p.prompt_id for p in a.batch(3, 8)][:2] == ["it000003-00000-line24", "it000003-00001-line14"]
    assert [p.text for p in a.batch(3, 8)] != [p.text for p in FilePrompts(path=path, seed=5).batch(3, 8)]


def test_prompt_ids_unique_when_a_batch_wraps_an_epoch(tmp_path):
    src = FilePrompts(path=write_jsonl(tmp_path / "d.jsonl", rows(3)), seed=0)
    batch = src.batch(2, 5)
    assert len({p.prompt_id for p in batch}) == 5
    assert all(p.prompt_id.startswith("it000002-") for p in batch)
    assert all("/" not in p.prompt_id for p in batch)


def test_id_column_names_prompts(tmp_path):
    data = [{"uid": f"q/{i}", "prompt": f"p{i}", "answer": "x"} for i in range(3)]
    src = FilePrompts(path=write_jsonl(tmp_path / "d.jsonl", data), id_column="uid", heldout_fraction=0.34, seed=0)
    ids = {p.prompt_id.rsplit("-", 1)[1] for p in src.heldout() + src.batch(0, 2)}
    assert ids == {"q_0", "q_1", "q_2"}


def test_heldout_fraction_fixed_and_disjoint_from_training(tmp_path):
    data = rows(20) + [rows(20)[i] for i in range(5)]  # duplicates of five prompts
    path = write_jsonl(tmp_path / "d.jsonl", data)
    src = FilePrompts(path=path, heldout_fraction=0.25, seed=2)
    held = [p.text for p in src.heldout()]
    assert len(held) == len(set(held)) == 5  # 25% of the 20 distinct prompts
    assert held == [p.text for p in FilePrompts(path=path, heldout_fraction=0.25, seed=2).heldout()]
    trained = {p.text for it in range(10) for p in src.batch(it, src.train_size)}
    assert not trained & set(held)
    assert trained | set(held) == {r["prompt"] for r in rows(20)}
    assert all(p.prompt_id.startswith("heldout-") and "answer" in p.metadata for p in src.heldout())


def test_dev_is_the_former_heldout_split_and_test_fraction_draws_among_the_rest(tmp_path):
    data = rows(20) + [rows(20)[i] for i in range(5)]
    path = write_jsonl(tmp_path / "d.jsonl", data)
    # Drawn before the test split existed: a recipe tuned on the held-out split was tuned on dev.
    assert [p.text for p in FilePrompts(path=path, heldout_fraction=0.25, seed=2).heldout("dev")] == [
        "0+1=", "2+1=", "7+1=", "12+1=", "13+1="]
    a, b = (FilePrompts(path=path, heldout_fraction=0.25, test_fraction=0.2, seed=2) for _ in range(2))
    dev, test = [p.text for p in a.heldout("dev")], [p.text for p in a.heldout("test")]
    assert dev == ["0+1=", "2+1=", "7+1=", "12+1=", "13+1="] and a.heldout() == a.heldout("dev")
    assert len(test) == len(set(test)) == 4 and not set(dev) & set(test)  # 20% of the 20 distinct prompts
    assert test == [p.text for p in b.heldout("test")]
    assert all(p.prompt_id.startswith("test-") and "answer" in p.metadata for p in a.heldout("test"))
    trained = {p.text for it in range(10) for p in a.batch(it, a.train_size)}
    assert not trained & set(dev + test) and len(trained) == 11
    with pytest.raises(ValueError, match="unknown held-out split 'train'"):
        a.heldout("train")
    with pytest.raises(DataFileError, match="test_fraction 0.75 of 20 distinct prompts leaves none for training"):
        FilePrompts(path=path, heldout_fraction=0.25, test_fraction=0.75)


def test_without_a_test_fraction_or_path_the_test_split_is_empty(tmp_path):
    src = FilePrompts(path=write_jsonl(tmp_path / "d.jsonl", rows(10)), heldout_fraction=0.2, seed=0)
    assert src.heldout("test") == [] and len(src.heldout("dev")) == 2 and src.train_size == 8


def test_test_path_is_never_trained_on_nor_in_dev(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", rows(10))
    test = write_jsonl(tmp_path / "test.jsonl", [{"prompt": "3+1=", "answer": 4}, {"prompt": "50+1=", "answer": 51}])
    src = FilePrompts(path=train, heldout_fraction=0.3, test_path=test, seed=1)
    dev = {p.text for p in src.heldout("dev")}
    assert [p.text for p in src.heldout("test")] == ["3+1=", "50+1="]
    assert len(dev) == 3 and "3+1=" not in dev  # dev is drawn among the prompts test_path does not hold
    assert not {p.text for p in src.batch(0, src.train_size)} & (dev | {"3+1="}) and src.train_size == 6
    dev_file = write_jsonl(tmp_path / "dev.jsonl", [{"prompt": "7+1=", "answer": 8}, {"prompt": "50+1=", "answer": 51}])
    with pytest.raises(DataFileError, match=r"test.jsonl: line 2 is also in the dev split \(.*dev.jsonl\)"):
        FilePrompts(path=train, heldout_path=dev_file, test_path=test)
    with pytest.raises(ValueError, match="either test_fraction or test_path"):
        FilePrompts(path=train, test_path=test, test_fraction=0.1)
    from unirl.stages.sources.file import FileData

    with pytest.raises(ValueError, match="data.test_fraction: set either test_fraction or test_path"):
        FileData(path=str(train), test_path=str(test), test_fraction=0.1)


def test_heldout_path(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", rows(6))
    held = write_jsonl(tmp_path / "test.jsonl", [{"prompt": "0+1=", "answer": 1}, {"prompt": "99+1=", "answer": 100}])
    src = FilePrompts(path=train, heldout_path=held, seed=0)
    assert [p.text for p in src.heldout()] == ["0+1=", "99+1="]
    assert src.train_size == 5  # "0+1=" is held out, so it is not trained on
    with pytest.raises(ValueError, match="either heldout_fraction or heldout_path"):
        FilePrompts(path=train, heldout_path=held, heldout_fraction=0.1)


def test_parquet_round_trip_matches_jsonl(tmp_path):
    data = rows(12)
    pq.write_table(pa.Table.from_pylist(data), tmp_path / "d.parquet")
    a = FilePrompts(path=tmp_path / "d.parquet", heldout_fraction=0.25, seed=3)
    b = FilePrompts(path=write_jsonl(tmp_path / "d.jsonl", data), heldout_fraction=0.25, seed=3)
    assert [(p.text, p.metadata) for p in a.heldout()] == [(p.text, p.metadata) for p in b.heldout()]
    assert [(p.text, p.metadata) for p in a.batch(1, 4)] == [(p.text, p.metadata) for p in b.batch(1, 4)]
    assert a.batch(0, 1)[0].metadata["answer"].isdigit()


@pytest.mark.parametrize(
    ("content", "kwargs", "message"),
    [
        ('{"prompt": "a", "answer": 1}\n{"prompt": "b", "answer": \n', {}, r"line 2 is not valid JSON"),
        ('{"prompt": "a", "answer": 1}\n\n[1, 2]\n', {}, r"line 3 is a JSON list"),
        ('{"prompt": "a", "answer": 1}\n{"prompt": "  ", "answer": 2}\n', {}, r"line 2 has an empty prompt"),
        ('{"prompt": "a", "answer": 1}\n{"answer": 2}\n', {}, r"line 2 has an empty prompt"),
        ('{"prompt": "a", "answer": 1}\n{"prompt": "b", "answer": null}\n', {}, r"line 2 has no answer"),
        ('{"prompt": "a", "answer": 1}\n{"prompt": 7, "answer": 2}\n', {}, r"line 2 has a int prompt"),
        ('{"prompt": "a", "solution": 1}\n', {}, r"no answer column 'answer' \(columns: 'prompt', 'solution'\)"),
        ('{"q": "a", "answer": 1}\n', {}, r"no prompt column 'prompt' \(columns: 'q', 'answer'\)"),
        ('{"prompt": "a", "answer": 1}\n', {"id_column": "uid"}, r"no id column 'uid'"),
        ('{"prompt": "a", "answer": 1, "id": 3}\n{"prompt": "b", "answer": 1, "id": 3}\n', {"id_column": "id"},
         r"line 2 repeats id '3' of line 1"),
        ("\n\n", {}, r"the dataset is empty"),
    ],
)
def test_jsonl_errors_name_the_file_and_line(tmp_path, content, kwargs, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(DataFileError, match=message) as info:
        FilePrompts(path=path, **kwargs)
    assert str(path) in str(info.value)


def test_parquet_errors_name_the_row(tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "answer": "1"}, {"prompt": "", "answer": "2"}]), path)
    with pytest.raises(DataFileError, match=r"bad.parquet: row 2 has an empty prompt"):
        read_records(path)
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), empty)
    with pytest.raises(DataFileError, match="empty.parquet: the dataset is empty"):
        read_records(empty)
    junk = tmp_path / "junk.parquet"
    junk.write_text("not parquet")
    with pytest.raises(DataFileError, match="junk.parquet: cannot read as Parquet"):
        read_records(junk)


def test_missing_file_suffix_and_fraction_errors(tmp_path):
    with pytest.raises(DataFileError, match=r"nope.jsonl: no such file"):
        FilePrompts(path=tmp_path / "nope.jsonl")
    (tmp_path / "d.csv").write_text("prompt,answer\n")
    with pytest.raises(DataFileError, match=r"d.csv: unknown file type '.csv'"):
        FilePrompts(path=tmp_path / "d.csv")
    path = write_jsonl(tmp_path / "two.jsonl", rows(2))
    with pytest.raises(DataFileError, match="leaves none for training"):
        FilePrompts(path=path, heldout_fraction=0.9)


def test_built_from_config_and_reread_when_the_file_changes(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", rows(4))
    test = write_jsonl(tmp_path / "test.jsonl", [{"prompt": "99+1=", "answer": 100}])
    config = SimpleNamespace(name="file", path=str(path), prompt_column="prompt", answer_column="answer",
                             id_column=None, image_column=None, heldout_fraction=0.25, heldout_path=None,
                             test_fraction=0.0, test_path=str(test), seed=0)
    first = file_prompt_source(config)
    assert file_prompt_source(config) is first  # every iteration builds the source: parse once
    write_jsonl(path, rows(8))
    os.utime(path, ns=(1, 1))
    assert file_prompt_source(config).train_size == 6
    write_jsonl(test, [{"prompt": "7+1=", "answer": 8}])
    os.utime(test, ns=(2, 2))
    assert [p.text for p in file_prompt_source(config).heldout("test")] == ["7+1="]
    assert file_prompt_source(config).train_size == 5
