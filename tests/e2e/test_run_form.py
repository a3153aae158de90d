"""The Run form a person fills in, as Prefect's default UI renders it in headless Chromium, for a
qwen3 deployment and an sd3 deployment (docs/deploy.md section 4): the model section shows the
recipe's own family's fields, each with its description, and no other family's. A real `prefect
server start` with its UI, `prefect deploy` from prefect.yaml, the page read back as its DOM and
saved as a screenshot (to $UNIRL_SCREENSHOTS when set, e.g. docs/images; else the test's temp dir).

Skipped where no Chromium is installed (tests/browser.py): CI's machine has none.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.browser import CHROMIUM, chromium, needs_chromium
from tests.conftest import REPO, isolated_env
from tests.prefect_server import PrefectServer

pytestmark = pytest.mark.slow

# deployment -> (what its model section must show, what only another family's would)
# (and sections titled by their fields, not their classes; no text-only section on a flow model's form)
FORMS = {
    "tiny": (["Width of the residual stream.", "Key/value heads (grouped-query attention).", "Kind is a const",
              "What truncated (overlong) responses get."],
             ["MMDiT blocks of the transformer.", "Transformer blocks.", "RewardConfig", "TrainConfig", "TinyQwen3"]),
    "diffusion-quickstart": (["MMDiT blocks of the transformer.", "Side of generated images in pixels.", "Kind is a const"],
                             ["Width of the residual stream.", "Transformer blocks.", "What truncated (overlong) responses get.",
                              "RewardConfig"]),
}


@pytest.fixture(scope="module")
def ui(tmp_path_factory: pytest.TempPathFactory):
    if CHROMIUM is None:
        pytest.skip("no Chromium")
    tmp = tmp_path_factory.mktemp("prefect-ui")
    server = PrefectServer(tmp, isolated_env(tmp, forked=False), REPO)
    server.env.update({"PREFECT_SERVER_UI_ENABLED": "true", "PREFECT_UI_API_URL": server.url})
    server.serve()
    try:
        server.cli("work-pool", "create", "cpu", "--type", "process")
        server.cli("--no-prompt", "deploy", *[a for name in FORMS for a in ("--name", name)], timeout=300)
        yield server
    finally:
        server.stop_all()


@needs_chromium
@pytest.mark.parametrize("deployment", sorted(FORMS))
def test_the_run_form_shows_the_recipes_own_model_fields(ui: PrefectServer, deployment: str, tmp_path: Path) -> None:
    with ui.client() as c:
        dep = c.read_deployment_by_name(f"rl-train/{deployment}")
    page = f"{ui.url.removesuffix('/api')}/deployments/deployment/{dep.id}/run"
    dom = chromium("--dump-dom", url=page).stdout
    own, others = FORMS[deployment]
    for text in own:
        assert text in dom, f"{deployment}'s Run form lacks {text!r}"
    for text in others:
        assert text not in dom, f"{deployment}'s Run form shows another family's field: {text!r}"
    assert "Overrides" in dom  # the key=value list, beside the recipe
    folder = Path(os.environ.get("UNIRL_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    shot = folder / f"run-form-{deployment}.png"
    chromium(f"--screenshot={shot}", url=page)
    assert shot.stat().st_size > 10_000
    print(f"\n[run form] {deployment}: {shot}")


@needs_chromium
def test_a_run_name_typed_in_the_form_names_the_run(ui: PrefectServer) -> None:
    """Typing a name in the form's "Run Name" box, leaving `run_name` empty, and submitting makes a
    flow run of that name with no `run_name` parameter: its run folder is that name
    (flows/rl.py `chosen_run_name`; tests/e2e/test_deployment.py runs such a flow run to its end
    through a worker, named from the CLI). Driven through the page with Playwright (the `browser`
    extra) on the system's Chromium; skipped without either."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install -e .[browser]")
    with ui.client() as c:
        dep = c.read_deployment_by_name("rl-train/tiny")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1200})
            page.goto(f"{ui.url.removesuffix('/api')}/deployments/deployment/{dep.id}/run", wait_until="networkidle")
            name = page.get_by_label("Run Name") if page.get_by_label("Run Name").count() else page.locator("input").first
            name.fill("lr-sweep-b")
            page.get_by_role("button", name="Submit").click()
            page.wait_for_url("**?tab=Runs", timeout=60_000)  # the UI goes to the deployment's runs once it made one
        finally:
            browser.close()
    with ui.client() as c:
        runs = [r for r in c.read_flow_runs() if r.deployment_id == dep.id]
    assert [r.name for r in runs] == ["lr-sweep-b"], [r.name for r in runs]
    assert not runs[0].parameters.get("run_name")  # the deployment gives none: the run is named as the flow run
