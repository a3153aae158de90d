"""Model families, one file each (`stages/models/family.py` describes the seam): qwen3 (text),
qwen2_5_vl and qwen3_vl (text about images, sharing stages/models/qwen_vl.py), sd3 (images), with
the helpers they load and save through."""
from unirl.stages.models.family import Family, get_family
from unirl.stages.models.qwen3 import check_model_dir, load_qwen3, save_tiny_qwen3
from unirl.stages.runtime.registry import families
from unirl.stages.runtime.tokenizer import build_char_tokenizer, load_tokenizer

__all__ = ["Family", "build_char_tokenizer", "check_model_dir", "families", "get_family", "load_qwen3", "load_tokenizer",
           "save_tiny_qwen3"]
