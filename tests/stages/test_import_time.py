"""Reading a recipe loads no model library: `import unirl.stages.recipe` and the validation of
every shipped recipe (every registry loaded: families, policies, algorithms, engines, sources,
composed shapes, scorers) leave torch, transformers and diffusers unimported, so `unirl validate`,
the Prefect form and the deploy writer start in about a second (stages/runtime/registry.py says
how entry modules keep them out)."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO

PROBE = """
import json, sys
from pathlib import Path
from unirl.stages.recipe import load_recipe
import unirl.stages.recipe
checked = []
for path in sorted(Path("recipes").glob("*/*.yaml")):
    load_recipe(path, local_files=False)
    checked.append(path.as_posix())
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "diffusers"))
print(json.dumps({"checked": checked, "heavy": heavy[:20]}))
"""


def test_validating_every_shipped_recipe_imports_no_model_library():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(seen["checked"]) >= 20 and "recipes/ar/quickstart.yaml" in seen["checked"]
    assert seen["heavy"] == [], f"reading recipes imported {seen['heavy']}"
