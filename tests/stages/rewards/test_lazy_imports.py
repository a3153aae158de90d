import subprocess
import sys

MODULES = ["clip", "pickscore", "hps", "aesthetic", "ocr", "vlm_judge", "video", "simple", "remote",
           "wire"]


def test_scorer_modules_load_torch_transformers_and_httpx_only_when_built():
    code = (
        "import importlib, sys\n"
        f"for m in {MODULES!r}: importlib.import_module('unirl.stages.rewards.' + m)\n"
        "print(sorted(m for m in ('torch', 'transformers', 'httpx', 'fastapi') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
