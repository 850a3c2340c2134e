"""The playground page in headless Chromium (Playwright), against a live server over tiny models.

Needs `playwright` (the `browser` extra) and a Chromium binary (`make browser`: Debian's chromium).
`make test` sets SPECDRAFT_REQUIRE_BROWSER=1, so there a missing browser fails the test; elsewhere
it is skipped.
"""

from __future__ import annotations

import os
import shutil

import pytest

REQUIRED = os.environ.get("SPECDRAFT_REQUIRE_BROWSER") == "1"
if REQUIRED:
    import playwright.sync_api as sync_api
else:
    sync_api = pytest.importorskip("playwright.sync_api")

from test_server import Live, make_app  # noqa: E402


def _browser(playwright):
    system = shutil.which("chromium") or shutil.which("chromium-browser")
    try:
        return playwright.chromium.launch(headless=True, executable_path=system)
    except sync_api.Error as error:
        if REQUIRED:
            raise
        pytest.skip(f"no Chromium for Playwright: {error}")


def test_playground_streams_coloured_tokens_and_compares_plain_with_speculative(tiny_model_dirs):
    with Live(make_app(tiny_model_dirs, k="2")) as server, sync_api.sync_playwright() as playwright:
        browser = _browser(playwright)
        try:
            page = browser.new_page()
            page.goto(server.url + "/")
            page.wait_for_selector("#drafter option[value=model]", state="attached")
            page.fill("#prompt", "def add")
            page.fill("#temperature", "0")
            page.fill("#max_tokens", "24")
            page.click("#compare")
            page.wait_for_function("document.getElementById('speedup').textContent.length > 0", timeout=20000)
            assert page.text_content("#error") == ""
            plain = page.text_content("#plain .output")
            spec = page.text_content("#spec .output")
            assert spec and spec == plain  # greedy speculative decoding is lossless
            kinds = page.eval_on_selector_all("#spec .output span", "spans => spans.map(s => s.className)")
            assert kinds and set(kinds) <= {"accepted", "recovered", "bonus", "target"} and "accepted" in kinds
            assert set(page.eval_on_selector_all("#plain .output span", "s => s.map(x => x.className)")) == {"target"}
            stats = page.text_content("#spec .stats")
            assert "α=" in stats and "τ=" in stats and "tok/s" in stats
            assert page.locator("#spec .bars .bar").count() >= 1
        finally:
            browser.close()
