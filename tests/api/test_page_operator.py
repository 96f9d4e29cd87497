"""The operator's view of the web page at ``/``: an admin key of its own, every model's line and the live
workers with their buttons, in a real headless Chromium against a real API and real workers (the
browser and its skip as in tests/api/test_page.py)."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.contract.settings import Settings
from tests.api.test_page import Tab, api_get, needs_browser, screenshot
from tests.api.test_page import browser as browser  # the fixtures, for this module too
from tests.api.test_page import tab as tab
from tests.conftest import DEADLINE_S, Process, http_post_job, start_worker, wait_for

if TYPE_CHECKING:
    from playwright.sync_api import Locator, Page

ADMIN = "admin-key"
TENANTS = '{"k": "web"}'
WORKER = "page-operator"
AHEAD = ["next in line", "1 ahead", "2 ahead"]  # a waiting job's place, as the page says it


def admin_post(api: Process, path: str) -> Any:
    """POST to an admin route with the admin key; its JSON answer."""
    request = urllib.request.Request(f"{api.url}/v1/admin{path}", method="POST",
                                     headers={"Authorization": f"Bearer {ADMIN}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def admin_get(api: Process, path: str) -> Any:
    return json.loads(api_get(api, f"/v1/admin{path}", ADMIN))


def line_of(api: Process, route: str, model: str) -> dict[str, Any]:
    """A model's entry in GET /v1/admin/lines or /v1/admin/jobs."""
    (line,) = [line for line in admin_get(api, route)["lines"] if line["model"] == model]
    return dict(line)


def worker_view(api: Process, name: str) -> dict[str, Any] | None:
    """The live worker of this name as GET /v1/admin/workers shows it; None while none lives."""
    return next((view for view in admin_get(api, "/workers")["workers"] if view["name"] == name), None)


def open_operator(page: Page, key: str) -> None:
    """Open the operator's section and enter an admin key (the field reads it when left)."""
    if page.locator("#operator").get_attribute("open") is None:
        page.click("#operator summary")
    page.fill("#admin_key", key)
    page.locator("#admin_key").blur()


def submit(api: Process, prompt: str, width: int) -> str:
    status, view, _ = http_post_job(api.url, {"prompt": prompt, "width": width, "height": 64, "steps": 2},
                                    key="k")
    assert status == 202, view
    return str(view["id"])


def succeeded(api: Process, job_id: str) -> dict[str, Any]:
    """The tenant's view of a job once it has succeeded."""
    def done() -> dict[str, Any] | None:
        view = dict(json.loads(api_get(api, f"/v1/jobs/{job_id}", "k")))
        return view if view["status"] == "succeeded" else None

    return dict(wait_for(done, what=f"job {job_id} to succeed"))


def rows(line: Locator) -> Locator:
    return line.locator("li.op-job")


@needs_browser
def test_an_operator_pauses_a_line_moves_a_job_to_the_front_and_resumes(
        tab: Tab, start_api: Callable[..., Process], worker: Process, worker_settings: Settings) -> None:
    from playwright.sync_api import expect

    api = start_api(worker_settings, api_keys=TENANTS, admin_keys=[ADMIN])
    model = worker_settings.default_model
    page = tab.page
    page.goto(api.url + "/")
    # Collapsed: the tenant's page as it was, the key's field out of sight.
    expect(page.locator("#admin_key")).to_be_hidden()
    # A tenant's key is no admin key: the API's refusal shows, and nothing of the service.
    open_operator(page, "k")
    expect(page.locator("#operator-error-code")).to_have_text("403 not_admin:")
    expect(page.locator("#operator-error-message")).to_have_text(
        "This route needs an admin key (SLOTQ_ADMIN_KEYS).")
    expect(page.locator("#operator-view")).to_be_hidden()

    open_operator(page, ADMIN)
    line = page.locator(f'#op-lines li[data-model="{model}"]')
    expect(line).to_have_attribute("data-paused", "false")
    expect(page.locator("#operator-error")).to_be_hidden()
    line.get_by_role("button", name="Pause").click()
    expect(line).to_have_attribute("data-paused", "true")
    try:
        assert line_of(api, "/lines", model)["paused"] is True
        # Of three widths: none batches or joins another, so each start is a claim of its own.
        ids = [submit(api, f"waiting {n}", 64 + 8 * n) for n in range(3)]
        for place, job_id in enumerate(ids):  # the refresh shows them, in the order workers take them
            expect(rows(line).nth(place)).to_have_attribute("data-id", job_id)
            expect(rows(line).nth(place).locator(".op-what")).to_have_text(f"{AHEAD[place]} · web · normal")
            expect(rows(line).nth(place).locator(".prompt")).to_have_text(f"waiting {place}")
        expect(line.locator(".op-counts")).to_have_text("Waiting: high 0, normal 3, low 0. Running: 0.")
        expect(rows(line).nth(0).locator("button.front")).to_be_disabled()  # first already

        rows(line).nth(2).locator("button.front").click()
        expect(rows(line).nth(0)).to_have_attribute("data-id", ids[2])
        expect(rows(line).nth(0).locator(".op-what")).to_have_text("next in line · web · normal")
        expect(rows(line).nth(0).locator(".prompt")).to_have_text("waiting 2")
        assert [view["id"] for view in line_of(api, "/jobs", model)["waiting"]] == [ids[2], *ids[:2]]
        screenshot(page, "page-operator-lines.png")

        line.get_by_role("button", name="Resume").click()
        expect(line).to_have_attribute("data-paused", "false")
    finally:
        admin_post(api, f"/lines/{model}/resume")  # the session's worker serves the other tests' jobs

    views = [succeeded(api, job_id) for job_id in ids]
    assert [each["id"] for each in sorted(views, key=lambda each: each["started_at"])] == [ids[2], *ids[:2]]
    expect(rows(line)).to_have_count(0)
    expect(line.locator(".op-counts")).to_have_text("Waiting: high 0, normal 0, low 0. Running: 0.")
    # The browser logs each refused request: the tenant's list, asked with no tenant key (401), and the
    # admin routes, with the tenant's key (403). Anything else is a fault of the page.
    assert [error for error in tab.errors if not re.search("status of (401|403)", error)] == []


@needs_browser
def test_an_operator_releases_resumes_and_drains_a_worker(tab: Tab, start_api: Callable[..., Process],
                                                          settings: Settings, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    # A worker of this test's own: drained, it exits.
    worker = start_worker(settings, tmp_path / "worker.log", worker_name=WORKER, worker_metrics_port=0)
    try:
        api = start_api(settings, admin_keys=[ADMIN])
        page = tab.page
        page.goto(api.url + "/")
        open_operator(page, ADMIN)
        expect(page.locator("#operator-view")).to_be_visible()
        page.reload()  # the admin key is remembered apart from the tenant's, and the view opens with it
        expect(page.locator("#admin_key")).to_have_value(ADMIN)
        expect(page.locator("#api_key")).to_have_value("")
        assert page.evaluate("localStorage.getItem('slotq.apiKey')") is None
        card = page.locator(f'#op-workers li[data-name="{WORKER}"]')
        expect(card).to_have_attribute("data-state", "idle")
        expect(card.locator(".op-places")).to_contain_text(f"{settings.default_model}: on its device since")
        expect(card.locator("button.resume")).to_be_disabled()

        card.locator("input.hold").fill("60")
        asked = time.time()
        card.get_by_role("button", name="Release").click()
        expect(card).to_have_attribute("data-state", "held")
        expect(card.locator(".op-state")).to_contain_text("held until")
        # It let go of its device: the model is off it (on this CPU, released outright).
        expect(card.locator(".op-places")).to_contain_text(
            re.compile(f"{settings.default_model}: (released|in host memory) since"))
        held = worker_view(api, WORKER)
        assert held and held["state"] == "held" and held["held_until"] is not None
        assert 50 < datetime.fromisoformat(held["held_until"]).timestamp() - asked < 70
        screenshot(page, "page-operator-workers.png")

        card.get_by_role("button", name="Resume").click()
        expect(card).to_have_attribute("data-state", "idle")
        expect(card.locator("button.resume")).to_be_disabled()
        resumed = worker_view(api, WORKER)
        assert resumed and resumed["state"] == "idle" and resumed["held_until"] is None

        card.get_by_role("button", name="Drain").click()
        expect(card.locator(".op-state")).to_contain_text("draining")
        assert worker.popen.wait(DEADLINE_S) == 0
        assert "drain requested by an operator" in worker.output()
        expect(card).to_have_count(0)  # gone from the list with its heartbeat
        expect(page.locator("#op-workers-note")).to_have_text("No worker is live.")
        assert worker_view(api, WORKER) is None
        assert tab.errors == []
    finally:
        worker.stop()
