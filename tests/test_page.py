"""The web page at ``/``, end to end in a real headless Chromium against a real API and worker.

The browser is Debian's ``chromium`` driven by Playwright (``executable_path``; nothing is
downloaded). Without it these tests skip, unless ``SLOTQ_REQUIRE_BROWSER=1`` (CI) makes that a failure.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from flask.testing import FlaskClient

from shared.contract.settings import Settings
from tests.conftest import DEADLINE_S, Process, wait_for

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOTS = Path(__file__).parent / "output"  # ignored by git
DEADLINE_MS = DEADLINE_S * 1000
KEYS = '{"k": "web"}'


@dataclass
class Tab:
    """A page in a fresh browser context, with the errors its console reported."""

    page: Page
    errors: list[str] = field(default_factory=list)


def browser_missing() -> str | None:
    """Why the browser tests cannot run here, or None."""
    if not CHROMIUM.exists():
        return f"{CHROMIUM} is missing (apt-get install chromium)"
    if importlib.util.find_spec("playwright") is None:
        return "the playwright package is missing (pip install playwright; no browser download needed)"
    return None


MISSING = browser_missing()
# Decided before any fixture runs, so a skip does not first start the session's worker.
needs_browser = pytest.mark.skipif(MISSING is not None and os.environ.get("SLOTQ_REQUIRE_BROWSER") != "1",
                                   reason=f"no browser: {MISSING}")


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """One headless Chromium for the module."""
    if MISSING:  # only with SLOTQ_REQUIRE_BROWSER=1: the tests are skipped otherwise
        pytest.fail(f"SLOTQ_REQUIRE_BROWSER=1 but {MISSING}")
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=DEADLINE_MS)  # its own default is 5 s, short on a loaded machine
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        yield chromium
        chromium.close()


@pytest.fixture
def tab(browser: Browser) -> Iterator[Tab]:
    """A page of its own (fresh storage), failing its waits at the suite's deadline."""
    context = browser.new_context(viewport={"width": 900, "height": 1000})
    context.set_default_timeout(DEADLINE_MS)
    tab = Tab(context.new_page())
    # A CSP violation or a script error shows here.
    tab.page.on("console", lambda line: tab.errors.append(line.text) if line.type == "error" else None)
    tab.page.on("pageerror", lambda error: tab.errors.append(str(error)))
    yield tab
    context.close()


def fill_form(page: Page, prompt: str, **fields: Any) -> None:
    """Type the prompt and set the other fields by their ids."""
    page.locator("#prompt").press_sequentially(prompt)
    for name, value in fields.items():
        page.fill(f"#{name}", str(value))


def job_of(api: Process, page: Page, key: str | None = None) -> dict[str, Any]:
    """The job the page follows (its id is in the URL's fragment), as the API reports it."""
    job_id = page.text_content("#job-id")
    assert job_id and page.url.endswith(f"#job={job_id}")
    request = urllib.request.Request(f"{api.url}/v1/jobs/{job_id}",
                                     headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def wait_for_image(page: Page, size: int) -> None:
    """Until the first image has loaded, then check its size."""
    page.wait_for_function("() => document.querySelector('#images img')?.complete"
                           " && document.querySelector('#images img').naturalWidth > 0")
    natural = page.eval_on_selector("#images img", "img => [img.naturalWidth, img.naturalHeight]")
    assert natural == [size, size]


def screenshot(page: Page, name: str) -> Path:
    """Keep what the page looks like now as tests/output/NAME, a CI artifact."""
    SCREENSHOTS.mkdir(exist_ok=True)
    path = SCREENSHOTS / name
    page.screenshot(path=path, full_page=True)
    print(f"screenshot: {path}")  # shown with -s or -rP
    return path


# --- The page as served (no browser) --------------------------------------------------------------

def test_page_is_served_with_a_strict_policy(client: FlaskClient) -> None:
    with client.get("/") as response:  # a file answer: closed, or it leaks the open file
        assert response.status_code == 200
        assert response.content_type == "text/html; charset=utf-8"
        policy = response.headers["Content-Security-Policy"]
        assert "default-src 'self'" in policy and "img-src 'self' blob: data:" in policy
        assert response.headers["X-Content-Type-Options"] == "nosniff"
        html = response.get_data(as_text=True)
    # Nothing from another origin, no inline script or style for the policy to block.
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html)
    assert not re.search(r"<script>|<style|style=", html)
    for path, mimetype in [("/ui/app.js", "text/javascript"), ("/ui/style.css", "text/css")]:
        with client.get(path) as asset:
            assert (asset.status_code, asset.mimetype) == (200, mimetype), path
            assert asset.headers["X-Content-Type-Options"] == "nosniff"


# --- In the browser ---------------------------------------------------------------------------------

@needs_browser
@pytest.mark.usefixtures("worker")
def test_prompt_to_image(tab: Tab, start_api: Callable[..., Process], worker_settings: Settings) -> None:
    from playwright.sync_api import expect

    api = start_api(worker_settings)
    page = tab.page
    page.goto(api.url + "/")
    expect(page.locator("#job")).to_be_hidden()
    fill_form(page, "a lighthouse at dusk", width=64, height=64, steps=2, seed=7)
    page.click("#submit")

    wait_for_image(page, 64)
    expect(page.locator("#status")).to_have_text("succeeded")
    expect(page.locator("#progress")).to_have_js_property("value", 2)
    expect(page.locator("#progress-text")).to_have_text("2 / 2")
    expect(page.locator("#cancel")).to_be_disabled()
    expect(page.locator("#error")).to_be_hidden()
    expect(page.locator("#images img")).to_have_count(1)
    expect(page.locator("#images img")).to_have_attribute("alt", re.compile("a lighthouse at dusk"))
    screenshot(page, "page-succeeded.png")

    job = job_of(api, page)
    assert job["status"] == "succeeded"
    assert {name: job["request"][name] for name in ("prompt", "width", "height", "steps", "seed")} == {
        "prompt": "a lighthouse at dusk", "width": 64, "height": 64, "steps": 2, "seed": 7}
    assert tab.errors == []


@needs_browser
def test_cancel_a_running_job(tab: Tab, start_api: Callable[..., Process], worker: Process,
                              worker_settings: Settings) -> None:
    from playwright.sync_api import expect

    api = start_api(worker_settings)
    page = tab.page
    page.goto(api.url + "/")
    fill_form(page, "a long one", width=1024, height=1024, steps=60)  # the session worker's most
    page.click("#submit")
    expect(page.locator("#job-id")).not_to_be_empty()
    job_id = page.text_content("#job-id")

    # However fast this machine runs the job, the page must get to see it running: once it has
    # taken a step, the worker is held still until the cancel has been asked for.
    wait_for(lambda: (job_of(api, page)["progress"] or {}).get("step"), what="the job's first step")
    worker.popen.send_signal(signal.SIGSTOP)
    try:
        assert job_of(api, page)["status"] == "running", "the job ended before the worker was held"
        expect(page.locator("#status")).to_have_text("running")
        expect(page.locator("#cancel")).to_be_enabled()
        with page.expect_response(lambda response: response.request.method == "DELETE") as answer:
            page.click("#cancel")
        assert answer.value.status == 202  # asked of the running job; it stops at its next step
        expect(page.locator("#cancel")).to_be_disabled()
    finally:
        worker.popen.send_signal(signal.SIGCONT)

    expect(page.locator("#status")).to_have_text("canceled")
    expect(page.locator("#cancel")).to_be_disabled()
    expect(page.locator("#position")).to_have_text("–")
    expect(page.locator("#images img")).to_have_count(0)
    screenshot(page, "page-canceled.png")

    job = job_of(api, page)
    assert job["id"] == job_id and job["status"] == "canceled" and job["started_at"] is not None
    assert job["progress"]["step"] < 60
    assert tab.errors == []


@needs_browser
@pytest.mark.usefixtures("worker")
def test_api_key_errors_and_resume(tab: Tab, start_api: Callable[..., Process],
                                   worker_settings: Settings) -> None:
    from playwright.sync_api import expect

    api = start_api(worker_settings, api_keys=KEYS)
    page = tab.page
    page.goto(api.url + "/")
    fill_form(page, "a red fox", width=64, height=64, steps=2)
    page.click("#submit")
    expect(page.locator("#error")).to_be_visible()
    expect(page.locator("#error-code")).to_have_text("401 unauthorized:")
    expect(page.locator("#error-message")).to_contain_text("Enter a valid API key above.")
    expect(page.locator("#job")).to_be_hidden()

    page.fill("#api_key", "k")
    page.fill("#width", "2048")  # a multiple of 8, so only the server refuses it
    page.click("#submit")
    expect(page.locator("#error-code")).to_have_text("422 invalid_request:")
    expect(page.locator("#error-details li")).to_have_text(re.compile(r"^width: .*between 64 and 1024"))

    page.fill("#width", "64")
    page.click("#submit")
    wait_for_image(page, 64)  # fetched with the key, as a blob: URL
    expect(page.locator("#error")).to_be_hidden()
    job_id = job_of(api, page, key="k")["id"]

    page.reload()  # the key is remembered and the job in the URL is followed again
    expect(page.locator("#api_key")).to_have_value("k")
    expect(page.locator("#job-id")).to_have_text(job_id)
    expect(page.locator("#status")).to_have_text("succeeded")
    wait_for_image(page, 64)
    # The browser logs each refused request; anything else is a fault of the page.
    assert [error for error in tab.errors if not re.search("status of (401|422)", error)] == []
