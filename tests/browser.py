"""Headless Chromium for the tests that look at a page as a person would (the Prefect Run form,
MLflow's run pages): its DOM after the page's scripts ran, and screenshots. Those tests are
skipped where no Chromium is installed (Debian: `apt-get install chromium`); CI's machine has none."""
from __future__ import annotations

import shutil
import subprocess

import pytest

CHROMIUM = next((path for name in ("chromium", "chromium-browser", "google-chrome") if (path := shutil.which(name))), None)
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine (apt-get install chromium): "
                                    "the page is only seen in a browser")


def chromium(*args: str, url: str, height: int = 2400) -> subprocess.CompletedProcess:
    """Chromium headless on `url`, 20 s of the page's virtual time for its scripts: `--dump-dom` prints the DOM."""
    assert CHROMIUM is not None
    return subprocess.run([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           f"--window-size=1400,{height}", "--virtual-time-budget=20000", *args, url],
                          capture_output=True, text=True, timeout=180, check=True)
