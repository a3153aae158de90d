"""Prompts (with reference answers) from a local JSONL or Parquet file.

Every row becomes a `Prompt` whose metadata holds the answer as `answer` and every other
column (except the prompt) as a string, so scorers such as `exact_match` and `math_verify`
read it. The file is read and checked whole when the source is built, so a bad file fails
before training with the file, the line or row and what to do.

Training order: epoch e is a permutation of the training rows seeded by (seed, e); the stream
is epoch 0, then epoch 1, ... and iteration k takes stream positions [k*n, (k+1)*n). With a
constant batch size every training row is seen once per epoch before any repeats, and the
prompts of an iteration depend only on (seed, iteration, n): a resumed run sees the same ones.

Held-out splits: `dev` is either `heldout_path` (a second file with the same columns) or a fixed
`heldout_fraction` of the distinct prompt texts drawn from the seed (among those not in
`test_path`); `test` likewise is `test_path` or a `test_fraction` drawn among the prompts dev did
not take, and empty when neither is given (callers then skip the test evaluation). Training never
yields a prompt of either split (duplicates of a held-out prompt are dropped too), and no prompt
is in both. With images, a prompt is its text and its images: the same question about two images
is two prompts.

Images (vision-language models, `image_column`): each row names one image or a list of them, as
file paths (relative to the data file's folder, or absolute) or image bytes (Parquet binary, or
the Hugging Face `{"bytes": ...}` struct). Every image is read, decoded and encoded as PNG when
the source is built, so a missing or undecodable one fails before training, naming the line or
row and the file.
"""
from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unirl.stages.runtime.data import Prompt, check_split
from unirl.stages.runtime.images import ImageError, load_image_value

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")


class DataFileError(ValueError):
    """A prompt file that cannot be used; the message names the file and, where known, the line or row."""


@dataclass(frozen=True)
class Record:
    """One usable row: `where` is `line 12` (JSONL) or `row 12` (Parquet), 1-based."""

    where: str
    key: str
    text: str
    metadata: dict[str, str]
    images: tuple[bytes, ...] = ()

    @property
    def identity(self) -> tuple[str, tuple[bytes, ...]]:
        """What makes two rows the same prompt (the held-out split keeps them apart)."""
        return (self.text, self.images)


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))  # Parquet/JSON often store integer answers as 12.0
    if isinstance(value, (bool, int, float, list, dict)):
        return json.dumps(value, sort_keys=True)
    return str(value)


def _read_jsonl(path: Path) -> tuple[list[tuple[str, dict[str, Any]]], list[str]]:
    rows: list[tuple[str, dict[str, Any]]] = []
    columns: dict[str, None] = {}
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataFileError(
                        f"{path}: line {lineno} is not valid JSON ({exc.msg} at column {exc.colno}); "
                        "the file must hold one JSON object per line"
                    ) from None
                if not isinstance(obj, dict):
                    raise DataFileError(
                        f"{path}: line {lineno} is a JSON {type(obj).__name__}, not an object; "
                        "the file must hold one JSON object per line"
                    )
                columns.update(dict.fromkeys(obj))
                rows.append((f"line {lineno}", obj))
    except UnicodeDecodeError as exc:
        raise DataFileError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return rows, list(columns)


def _read_parquet(path: Path) -> tuple[list[tuple[str, dict[str, Any]]], list[str]]:
    import pyarrow.parquet as pq  # start-up time: pyarrow loads on first use, not when a recipe is read

    try:
        table = pq.read_table(path)
    except Exception as exc:  # noqa: BLE001 - any pyarrow failure means the same thing to the user
        raise DataFileError(f"{path}: cannot read as Parquet ({type(exc).__name__}: {exc})") from None
    return [(f"row {i}", row) for i, row in enumerate(table.to_pylist(), 1)], list(table.column_names)


def _safe_key(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:64]


def read_records(
    path: str | os.PathLike[str],
    *,
    prompt_column: str = "prompt",
    answer_column: str = "answer",
    id_column: str | None = None,
    image_column: str | None = None,
) -> list[Record]:
    """Read and check every row of a .jsonl/.parquet file. Raises `DataFileError` naming the file
    for: a missing file, an unknown suffix, unreadable JSON (with its line), no rows, a missing
    prompt/answer/id column (listing the columns there are), an empty prompt or answer (with its
    line or row), a duplicate id, a row without images or with one that is missing or does not
    decode (with `image_column`)."""
    p = Path(path)
    if not p.is_file():
        raise DataFileError(f"{p}: no such file (data.path, data.heldout_path and data.test_path are local paths)")
    suffix = p.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        rows, columns = _read_jsonl(p)
    elif suffix in PARQUET_SUFFIXES:
        rows, columns = _read_parquet(p)
    else:
        raise DataFileError(
            f"{p}: unknown file type {suffix or '(no suffix)'!r} "
            f"(allowed: {', '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)})"
        )
    if not rows:
        raise DataFileError(f"{p}: the dataset is empty (no rows)")
    for role, column in (("prompt", prompt_column), ("answer", answer_column), ("id", id_column), ("image", image_column)):
        if column is not None and column not in columns:
            raise DataFileError(
                f"{p}: no {role} column {column!r} (columns: {', '.join(map(repr, columns))}); "
                f"set data.{role}_column to one of them"
            )
    records: list[Record] = []
    first_seen: dict[str, str] = {}
    for where, row in rows:
        text = row.get(prompt_column)
        if text is None or (isinstance(text, str) and not text.strip()):
            raise DataFileError(f"{p}: {where} has an empty prompt (column {prompt_column!r})")
        if not isinstance(text, str):
            raise DataFileError(
                f"{p}: {where} has a {type(text).__name__} prompt in column {prompt_column!r}; prompts must be text"
            )
        answer = row.get(answer_column)
        if answer is None or _as_text(answer).strip() == "":
            raise DataFileError(f"{p}: {where} has no answer (column {answer_column!r})")
        key = where.replace(" ", "")
        if id_column is not None:
            ident = row.get(id_column)
            if ident is None or _as_text(ident).strip() == "":
                raise DataFileError(f"{p}: {where} has an empty id (column {id_column!r})")
            ident = _as_text(ident)
            if ident in first_seen:
                raise DataFileError(f"{p}: {where} repeats id {ident!r} of {first_seen[ident]}; ids must be unique")
            first_seen[ident] = where
            key = _safe_key(ident)
        skip = (prompt_column, answer_column, image_column)
        metadata = {k: _as_text(v) for k, v in row.items() if k not in skip and v is not None}
        metadata["answer"] = _as_text(answer)
        images = _row_images(row.get(image_column), p, where, image_column) if image_column else ()
        records.append(Record(where, key, text, metadata, images))
    return records


def _row_images(value: Any, path: Path, where: str, column: str) -> tuple[bytes, ...]:
    """A row's images (one, or a list) as PNG bytes; none, a missing file or bad bytes fail."""
    values = list(value) if isinstance(value, (list, tuple)) else [] if value is None else [value]
    if not values:
        raise DataFileError(f"{path}: {where} has no image (column {column!r}); every prompt needs one or more")
    try:
        return tuple(load_image_value(v, path.parent, f"{path}: {where}: column {column!r}" + (f" item {k}" if len(values) > 1 else ""))
                     for k, v in enumerate(values))
    except ImageError as exc:
        raise DataFileError(str(exc)) from None


class FilePrompts:
    """A prompt source over a local file; `batch` and `heldout(split)` as `unirl.stages.toys.arithmetic.Arithmetic`."""

    def __init__(
        self,
        *,
        path: str | os.PathLike[str],
        prompt_column: str = "prompt",
        answer_column: str = "answer",
        id_column: str | None = None,
        image_column: str | None = None,
        heldout_fraction: float = 0.0,
        heldout_path: str | os.PathLike[str] | None = None,
        test_fraction: float = 0.0,
        test_path: str | os.PathLike[str] | None = None,
        seed: int = 0,
    ):
        for name, fraction in (("heldout_fraction", heldout_fraction), ("test_fraction", test_fraction)):
            if not 0.0 <= fraction < 1.0:
                raise ValueError(f"data.{name}: must be in [0, 1), got {fraction}")
        if heldout_path is not None and heldout_fraction > 0:
            raise ValueError("data.heldout_fraction: set either heldout_fraction or heldout_path, not both")
        if test_path is not None and test_fraction > 0:
            raise ValueError("data.test_fraction: set either test_fraction or test_path, not both")
        self.path, self.seed = Path(path), seed
        columns: dict[str, Any] = dict(prompt_column=prompt_column, answer_column=answer_column, id_column=id_column,
                                       image_column=image_column)
        records = read_records(path, **columns)
        texts = list(dict.fromkeys(r.identity for r in records))
        test = read_records(test_path, **columns) if test_path is not None else []
        if heldout_path is not None:
            dev = read_records(heldout_path, **columns)
            in_dev = {r.identity for r in dev}
            clash = next((r for r in test if r.identity in in_dev), None)
            if clash is not None:
                raise DataFileError(f"{test_path}: {clash.where} is also in the dev split ({heldout_path}); a prompt "
                                    "belongs to one held-out split at most")
        else:
            dev = self._draw(records, texts, heldout_fraction, {r.identity for r in test}, f"heldout-{seed}",
                             "lower data.heldout_fraction")
        if test_path is None:
            test = self._draw(records, texts, test_fraction, {r.identity for r in dev}, f"test-{seed}",
                              f"beside the {len(dev)} of the dev split; lower data.test_fraction or data.heldout_fraction")
        held = {r.identity for r in dev} | {r.identity for r in test}
        self._train = [r for r in records if r.identity not in held]
        if not self._train:
            raise DataFileError(f"{self.path}: every prompt is also in the dev or test split ({heldout_path or test_path}); "
                                "no training prompts left")
        self._splits = {name: [Prompt(f"{prefix}-{i:05d}-{r.key}", r.text, dict(r.metadata), r.images) for i, r in enumerate(rs)]
                        for name, prefix, rs in (("dev", "heldout", dev), ("test", "test", test))}
        self._perms: dict[int, list[int]] = {}

    def _draw(self, records: list[Record], texts: list[tuple[str, tuple[bytes, ...]]], fraction: float,
              taken: set[tuple[str, tuple[bytes, ...]]], rng_name: str, fix: str) -> list[Record]:
        """`fraction` of the file's distinct prompts (at least one), drawn by `rng_name` among those not
        `taken`: the first record of each, in file order; [] for fraction 0."""
        if fraction <= 0:
            return []
        pool = [t for t in texts if t not in taken]
        k = max(1, round(fraction * len(texts)))
        if k >= len(pool):
            field = "heldout_fraction" if rng_name.startswith("heldout") else "test_fraction"
            raise DataFileError(f"{self.path}: {field} {fraction} of {len(texts)} distinct prompts leaves none for "
                                f"training ({fix})")
        order = list(range(len(pool)))
        random.Random(rng_name).shuffle(order)
        chosen = {pool[i] for i in order[:k]}
        first: dict[tuple[str, tuple[bytes, ...]], Record] = {}
        for r in records:
            if r.identity in chosen:
                first.setdefault(r.identity, r)
        return [first[t] for t in texts if t in chosen]

    @property
    def train_size(self) -> int:
        return len(self._train)

    def _permutation(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            if len(self._perms) > 4:
                self._perms.clear()
            order = list(range(len(self._train)))
            random.Random(f"train-{self.seed}-epoch-{epoch}").shuffle(order)
            self._perms[epoch] = order
        return self._perms[epoch]

    def heldout(self, split: str = "dev") -> list[Prompt]:
        """The `dev` or `test` split (`test` is [] without test_fraction or test_path)."""
        return [Prompt(p.prompt_id, p.text, dict(p.metadata), p.images) for p in self._splits[check_split(split)]]

    def batch(self, iteration: int, n: int) -> list[Prompt]:
        """The `n` training prompts of `iteration`: stream positions [iteration*n, (iteration+1)*n)."""
        if iteration < 0 or n < 0:
            raise ValueError(f"batch(iteration={iteration}, n={n}): both must be >= 0")
        size = len(self._train)
        out = []
        for j in range(n):
            epoch, index = divmod(iteration * n + j, size)
            r = self._train[self._permutation(epoch)[index]]
            out.append(Prompt(f"it{iteration:06d}-{j:05d}-{r.key}", r.text, dict(r.metadata), r.images))
        return out


_CACHE: dict[tuple[Any, ...], FilePrompts] = {}


def _stamp(path: str | None) -> tuple[Any, ...]:
    if path is None:
        return (None,)
    try:
        st = os.stat(path)
    except OSError:
        return (os.path.abspath(path), None)
    return (os.path.abspath(path), st.st_mtime_ns, st.st_size)


def file_prompt_source(config: Any) -> FilePrompts:
    """Build from a recipe's `data` section (`name: file`). The parsed file is reused while its
    path, size and modification time are unchanged, since every iteration asks for the source."""
    params = dict(
        path=config.path, prompt_column=config.prompt_column, answer_column=config.answer_column,
        id_column=config.id_column, image_column=config.image_column, heldout_fraction=config.heldout_fraction,
        heldout_path=config.heldout_path, test_fraction=config.test_fraction, test_path=config.test_path, seed=config.seed,
    )
    key = (_stamp(config.path), _stamp(config.heldout_path), _stamp(config.test_path),
           tuple(sorted((k, str(v)) for k, v in params.items())))
    if key not in _CACHE:
        if len(_CACHE) > 8:
            _CACHE.clear()
        _CACHE[key] = FilePrompts(**params)
    return _CACHE[key]
