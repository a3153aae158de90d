"""`data.name: file`: prompts and reference answers from a local JSONL or Parquet file, with the
prompts' images for vision-language models (stages/sources/data_files.py)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from unirl.stages.models.family import get_family
from unirl.stages.runtime.config_base import Section
from unirl.stages.runtime.registry import sources
from unirl.stages.sources import Source
from unirl.stages.sources.data_files import file_prompt_source


class FileData(Section):
    """Prompts and reference answers from a local JSONL (one JSON object per line) or Parquet file."""

    name: Literal["file"] = "file"
    path: str = Field(description="Local .jsonl / .ndjson / .json (one object per line) or .parquet file.")
    prompt_column: str = Field("prompt", min_length=1, description="Column holding the prompt text.")
    answer_column: str = Field("answer", min_length=1, description="Column holding the reference answer (metadata `answer`).")
    id_column: str | None = Field(None, description="Column of unique row ids, used in prompt ids (empty: line/row number).")
    image_column: str | None = Field(
        None, description="Column of each prompt's image(s) for vision-language models: a path (relative to the file's "
        "folder, or absolute) or image bytes, or a list of them (empty: text prompts).")
    heldout_fraction: float = Field(
        0.0, ge=0, lt=1, description="Fraction of the distinct prompts held out as the dev split (what recipes are tuned "
        "on), fixed by `seed`, drawn among those not in test_path (0: none, or heldout_path).")
    heldout_path: str | None = Field(
        None, description="A separate dev-split file with the same columns (instead of heldout_fraction).")
    test_fraction: float = Field(
        0.0, ge=0, lt=1, description="Fraction of the distinct prompts held out as the test split (reported after RL), "
        "fixed by `seed`, none of them dev's. With neither test_fraction nor test_path the file has no test split: "
        "its test evaluation is skipped.")
    test_path: str | None = Field(
        None, description="A separate test-split file with the same columns (instead of test_fraction); none of its "
        "prompts may be in heldout_path.")
    seed: int = Field(1234, ge=0, description="Seed of the per-epoch shuffles and of the dev and test draws.")

    @model_validator(mode="after")
    def _one_heldout(self) -> FileData:
        if self.heldout_path is not None and self.heldout_fraction > 0:
            raise ValueError("data.heldout_fraction: set either heldout_fraction or heldout_path, not both")
        if self.test_path is not None and self.test_fraction > 0:
            raise ValueError("data.test_fraction: set either test_fraction or test_path, not both")
        return self


@sources.register("file")
class FileSource(Source):
    name = "file"
    config = FileData

    @classmethod
    def build(cls, cfg: FileData) -> Any:
        return file_prompt_source(cfg)

    @classmethod
    def gives_images(cls, cfg: FileData) -> bool:
        return cfg.image_column is not None

    @classmethod
    def check(cls, recipe: Any) -> None:
        if recipe.data.image_column is not None and not get_family(recipe.model.kind).takes_images:
            raise ValueError(f"data.image_column: model.kind {recipe.model.kind!r} cannot see images; use a "
                             "vision-language family (qwen2_5_vl, qwen3_vl) or remove image_column")
