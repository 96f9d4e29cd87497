"""The web page at ``/``, end to end in a real headless Chromium against a real API and worker.

The browser is Debian's ``chromium`` driven by Playwright (``executable_path``; nothing is
downloaded). Without it these tests skip, unless ``SLOTQ_REQUIRE_BROWSER=1`` (CI) makes that a failure.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import io
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
from PIL import Image

from shared.contract.settings import Settings
from slotq import harness
from tests.conftest import DEADLINE_S, Process, wait_for

if TYPE_CHECKING:
    from playwright.sync_api import Browser, FilePayload, Page

CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOTS = Path(__file__).parents[1] / "output"  # ignored by git
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


def api_get(api: Process, path: str, key: str | None = None) -> bytes:
    """The body of a GET to the API."""
    request = urllib.request.Request(f"{api.url}{path}",
                                     headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.read()


def job_of(api: Process, page: Page, key: str | None = None) -> dict[str, Any]:
    """The job the page follows (its id is in the URL's fragment), as the API reports it."""
    job_id = page.text_content("#job-id")
    assert job_id and page.url.endswith(f"#job={job_id}")
    return json.loads(api_get(api, f"/v1/jobs/{job_id}", key))


def start_image(path: Path, size: int) -> Path:
    """A square PNG of SIZE with a gradient in it, to start a job from."""
    image = Image.new("RGB", (size, size))
    image.putdata([(x * 255 // size, y * 255 // size, 128) for y in range(size) for x in range(size)])
    image.save(path, format="PNG")
    return path


def png_payload(name: str, data: bytes) -> FilePayload:
    """A file that says it is a PNG, for a file input, written nowhere."""
    return {"name": name, "mimeType": "image/png", "buffer": data}


def choose_image(page: Page, path: Path) -> None:
    """Choose the start image, then wait until the page shows it in place of width and height."""
    from playwright.sync_api import expect

    page.set_input_files("#image", path)
    expect(page.locator("#image-preview")).to_be_visible()
    expect(page.locator("#mask-canvas")).to_be_visible()


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
    for path in ("/healthz", "/no-such-page"):  # JSON answers too, an error's included: never a page
        answer = client.get(path)
        assert answer.headers["Content-Security-Policy"] == policy, path
        assert answer.headers["X-Content-Type-Options"] == "nosniff", path


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


@needs_browser
@pytest.mark.usefixtures("worker")
def test_image_to_image(tab: Tab, start_api: Callable[..., Process], worker_settings: Settings,
                        tmp_path: Path) -> None:
    from playwright.sync_api import expect

    api = start_api(worker_settings)
    page = tab.page
    page.goto(api.url + "/")
    expect(page.locator("#image-panel")).to_be_hidden()
    expect(page.locator("#strength")).to_be_hidden()
    start = start_image(tmp_path / "start.png", 128)
    choose_image(page, start)
    # The image's size is the job's: width and height give way to it.
    expect(page.locator("#image-size")).to_have_text("128 × 128 px")
    for side in ("width", "height"):
        expect(page.locator(f"#{side}")).to_be_hidden()
        expect(page.locator(f"#{side}")).to_be_disabled()
    expect(page.locator("#strength")).to_be_visible()
    expect(page.locator("#strength")).to_have_value("0.8")
    expect(page.locator("#mask-clear")).to_be_disabled()
    fill_form(page, "the same, in watercolour", steps=2, seed=3, strength=0.5)
    page.click("#submit")

    wait_for_image(page, 128)
    expect(page.locator("#status")).to_have_text("succeeded")
    expect(page.locator("#input")).to_have_text("a start image of 128 × 128 px, strength 0.5")
    expect(page.locator("#error")).to_be_hidden()
    screenshot(page, "page-img2img.png")

    job = job_of(api, page)
    data = start.read_bytes()
    assert job["request"]["image"] == {"media_type": "image/png", "width": 128, "height": 128,
                                       "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert job["request"]["mask"] is None
    assert job["request"]["strength"] == 0.5
    assert api_get(api, f"/v1/jobs/{job['id']}/inputs/image") == data

    page.click("#image-clear")  # back to text-to-image
    expect(page.locator("#image-panel")).to_be_hidden()
    expect(page.locator("#strength")).to_be_hidden()
    for side in ("width", "height"):
        expect(page.locator(f"#{side}")).to_be_visible()
        expect(page.locator(f"#{side}")).to_be_enabled()
    assert tab.errors == []


@needs_browser
@pytest.mark.usefixtures("worker")
def test_inpainting_with_a_drawn_rectangle(tab: Tab, start_api: Callable[..., Process],
                                           worker_settings: Settings, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    api = start_api(worker_settings)
    page = tab.page
    page.goto(api.url + "/")
    choose_image(page, start_image(tmp_path / "start.png", 128))
    box = page.locator("#mask-canvas").bounding_box()
    assert box and box["width"] > 128  # shown larger than its pixels: the drag is scaled down
    # From a quarter to three quarters of the shown image: pixels 32 to 96 of the image's 128.
    page.mouse.move(box["x"] + box["width"] / 4, box["y"] + box["height"] / 4)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 3 / 4, box["y"] + box["height"] * 3 / 4, steps=5)
    page.mouse.up()
    expect(page.locator("#mask-clear")).to_be_enabled()
    expect(page.locator("#mask-status")).to_contain_text("rectangle of 64 × 64 px at (32, 32)")
    # The overlay shows the mask half transparent: white over the rectangle, black around it.
    overlay = page.eval_on_selector("#mask-canvas", """canvas => [[64, 64], [4, 4]].map(([x, y]) =>
        Array.from(canvas.getContext("2d").getImageData(x, y, 1, 1).data))""")
    assert overlay[0][:3] == [255, 255, 255] and 0 < overlay[0][3] < 255, overlay
    assert overlay[1][:3] == [0, 0, 0] and 0 < overlay[1][3] < 255, overlay
    screenshot(page, "page-inpaint-mask.png")
    fill_form(page, "a door in the wall", steps=2, seed=5)
    page.click("#submit")

    wait_for_image(page, 128)
    expect(page.locator("#status")).to_have_text("succeeded")
    expect(page.locator("#input")).to_have_text("a start image of 128 × 128 px, strength 0.8, with a mask")
    screenshot(page, "page-inpaint.png")

    job = job_of(api, page)
    assert job["request"]["mask"]["media_type"] == "image/png"
    assert (job["request"]["mask"]["width"], job["request"]["mask"]["height"]) == (128, 128)
    data = api_get(api, f"/v1/jobs/{job['id']}/inputs/mask")
    assert job["request"]["mask"]["sha256"] == hashlib.sha256(data).hexdigest()
    with Image.open(io.BytesIO(data)) as mask:
        assert mask.size == (128, 128)
        gray = mask.convert("L")
        assert [gray.getpixel(point) for point in [(64, 64), (33, 33), (95, 95)]] == [255, 255, 255]
        assert [gray.getpixel(point) for point in [(0, 0), (127, 127), (20, 64), (110, 64)]] == [0, 0, 0, 0]
    assert tab.errors == []


@needs_browser
@pytest.mark.usefixtures("worker")
def test_inpainting_with_a_mask_file(tab: Tab, start_api: Callable[..., Process], worker_settings: Settings,
                                     tmp_path: Path) -> None:
    from playwright.sync_api import expect

    api = start_api(worker_settings)
    page = tab.page
    page.goto(api.url + "/")
    choose_image(page, start_image(tmp_path / "start.png", 128))
    box = page.locator("#mask-canvas").bounding_box()
    assert box
    page.mouse.move(box["x"] + 10, box["y"] + 10)
    page.mouse.down()
    page.mouse.move(box["x"] + 60, box["y"] + 60, steps=3)
    page.mouse.up()
    expect(page.locator("#mask-clear")).to_be_enabled()
    page.click("#mask-clear")  # the drawn mask goes
    expect(page.locator("#mask-clear")).to_be_disabled()
    expect(page.locator("#mask-status")).to_contain_text("No mask")

    mask = Image.new("L", (128, 128))
    mask.paste(255, (0, 0, 64, 128))  # repaint the left half
    mask.save(tmp_path / "mask.png", format="PNG")
    page.set_input_files("#mask", tmp_path / "mask.png")
    expect(page.locator("#mask-status")).to_have_text("Mask: mask.png, 128 × 128 px.")
    expect(page.locator("#mask-clear")).to_be_enabled()
    fill_form(page, "half of it again", steps=2, seed=9)
    page.click("#submit")

    wait_for_image(page, 128)
    job = job_of(api, page)
    data = (tmp_path / "mask.png").read_bytes()  # sent as it was chosen
    assert job["request"]["mask"]["sha256"] == hashlib.sha256(data).hexdigest()
    assert api_get(api, f"/v1/jobs/{job['id']}/inputs/mask") == data
    assert tab.errors == []


@needs_browser
@pytest.mark.usefixtures("worker")
def test_refused_images(tab: Tab, start_api: Callable[..., Process], worker_settings: Settings,
                        tmp_path: Path) -> None:
    from playwright.sync_api import expect

    api = start_api(worker_settings)
    page = tab.page
    page.goto(api.url + "/")
    # Over the page's own bound: refused before anything is sent.
    page.set_input_files("#image", png_payload("big.png", bytes(5 * 2**20)))
    expect(page.locator("#error-code")).to_have_text("invalid_image:")
    expect(page.locator("#error-message")).to_contain_text("at most 4 MiB")
    expect(page.locator("#image-panel")).to_be_hidden()
    expect(page.locator("#width")).to_be_enabled()
    # Not an image at all, whatever its name says: refused by the browser's own decoding.
    page.set_input_files("#image", png_payload("fake.png", b"not a png"))
    expect(page.locator("#error-message")).to_have_text(
        "The start image (fake.png) could not be read as an image.")
    expect(page.locator("#image-panel")).to_be_hidden()

    # 100 is no multiple of 8: the page sends it, and shows why the service refuses it.
    choose_image(page, start_image(tmp_path / "odd.png", 100))
    expect(page.locator("#error")).to_be_hidden()
    expect(page.locator("#image-size")).to_have_text("100 × 100 px")
    fill_form(page, "an odd size", steps=2)
    with page.expect_response(lambda response: response.request.method == "POST") as answer:
        page.click("#submit")
    assert answer.value.status == 422
    message = answer.value.json()["error"]["message"]
    assert "100" in message
    expect(page.locator("#error-code")).to_have_text("422 invalid_image:")
    expect(page.locator("#error-message")).to_have_text(message)
    expect(page.locator("#job")).to_be_hidden()
    assert "#job=" not in page.url
    assert [error for error in tab.errors if not re.search("status of 422", error)] == []


# --- The queue panel, live previews and the gallery ---------------------------------------------------

# Installed before the page's own script: what the page showed, in order, as it happened. Each card's
# places in the line (attribute changes, old values included, so none is lost to batching), and each
# picture put in a card: a preview (a data: URL) or an image (a blob: URL).
RECORDER = """
window.seen = {places: {}, pictures: []};
new MutationObserver((changes) => {
  for (const change of changes) {
    const target = change.target;
    if (change.attributeName === "data-position") {
      const places = (window.seen.places[target.dataset.id] ??= []);
      if (change.oldValue !== null) places.push(change.oldValue);
      if (target.dataset.position !== undefined) places.push(target.dataset.position);
    } else if (change.attributeName === "src" && target.classList.contains("thumb")) {
      const kind = target.src.startsWith("data:") ? "preview" : "image";
      window.seen.pictures.push([target.closest("li.card").dataset.id, kind, target.src]);
    }
  }
}).observe(document, {subtree: true, attributes: true, attributeOldValue: true,
                      attributeFilter: ["data-position", "src"]});
"""


def card(page: Page, job_id: str) -> Any:
    return page.locator(f'li.card[data-id="{job_id}"]')


def submit_from_page(page: Page, prompt: str, **fields: Any) -> str:
    """Fill the form, submit it, and return the new job's id (the page selects it)."""
    from playwright.sync_api import expect

    page.fill("#prompt", "")
    fill_form(page, prompt, **fields)
    before = page.text_content("#job-id") if page.locator("#job").is_visible() else None
    page.click("#submit")
    expect(page.locator("#job-id")).not_to_have_text(before or "")
    job_id = page.text_content("#job-id")
    assert job_id
    return job_id


def distinct(values: list[str]) -> list[int]:
    """A sequence with repeats of the same value in a row folded into one."""
    folded: list[int] = []
    for value in values:
        if value != "" and (not folded or folded[-1] != int(value)):
            folded.append(int(value))
    return folded


@needs_browser
@pytest.mark.usefixtures("worker")
def test_a_live_preview_shows_before_the_image(tab: Tab, start_api: Callable[..., Process],
                                               worker_settings: Settings) -> None:
    from playwright.sync_api import expect

    api = start_api(worker_settings)
    page = tab.page
    page.add_init_script(RECORDER)
    page.goto(api.url + "/")
    expect(page.locator("#previews")).to_be_checked()  # on unless unticked
    job_id = submit_from_page(page, "a harbour at night", width=256, height=256, steps=20)
    expect(card(page, job_id)).to_have_attribute("data-status", "succeeded")
    expect(page.locator(f'#gallery li.card[data-id="{job_id}"] .thumb')).to_be_visible()
    wait_for_image(page, 256)
    # The list shows the other tests' jobs too (no API keys): this job's pictures only.
    pictures = [(kind, src) for shown, kind, src in page.evaluate("window.seen.pictures") if shown == job_id]
    kinds = [kind for kind, _ in pictures]
    assert "preview" in kinds and "image" in kinds and kinds.index("preview") < kinds.index("image"), kinds
    url = next(src for kind, src in pictures if kind == "preview")
    head, _, payload = url.partition(",")
    assert head == "data:image/jpeg;base64"
    preview = Image.open(io.BytesIO(base64.b64decode(payload)))
    assert preview.format == "JPEG" and preview.size == (256, 256)
    assert job_of(api, page)["request"]["previews"] is True
    assert tab.errors == []


@needs_browser
def test_the_queue_panel_counts_places_down_and_cancels_from_the_list(
        tab: Tab, start_api: Callable[..., Process], worker: Process, worker_settings: Settings) -> None:
    from playwright.sync_api import expect

    api = start_api(worker_settings)
    page = tab.page
    page.add_init_script(RECORDER)
    page.goto(api.url + "/")
    page.uncheck("#previews")
    blocker = submit_from_page(page, "the one in the way", width=256, height=256, steps=30)
    expect(card(page, blocker)).to_have_attribute("data-status", "running")
    worker.popen.send_signal(signal.SIGSTOP)  # the line stands still until all four are in it
    try:
        # Each long enough (a few tenths of a second here) for the page to be told each place in
        # turn: at 2 steps a job ran in about 30 ms, and a busy machine's page once missed a place.
        # Each of its own width: none batches or joins with another, so each leaves the line alone.
        queued = [submit_from_page(page, f"waiting {n}", width=64 + 8 * n, height=64, steps=24)
                  for n in range(3)]
        doomed = submit_from_page(page, "canceled while it waits", width=64, height=64, steps=2)
        for place, job_id in enumerate([*queued, doomed]):
            expect(card(page, job_id)).to_have_attribute("data-position", str(place))
        expect(card(page, doomed).locator(".line")).to_contain_text("3 ahead")
        # Cancel the last from its card: it leaves the line for the gallery, as canceled.
        with page.expect_response(lambda response: response.request.method == "DELETE") as answer:
            card(page, doomed).locator("button.cancel").click()
        assert answer.value.status == 200
        expect(card(page, doomed)).to_have_attribute("data-status", "canceled")
        expect(page.locator(f'#gallery li.card[data-id="{doomed}"]')).to_be_visible()
        assert json.loads(api_get(api, f"/v1/jobs/{doomed}"))["status"] == "canceled"
    finally:
        worker.popen.send_signal(signal.SIGCONT)

    for job_id in [blocker, *queued]:
        expect(card(page, job_id)).to_have_attribute("data-status", "succeeded")
    places = page.evaluate("window.seen.places")
    # The third waited behind two: it was told 2, then 1, then 0 as the ones ahead were taken.
    assert distinct(places[queued[2]]) == [2, 1, 0], places[queued[2]]
    assert distinct(places[queued[1]]) == [1, 0], places[queued[1]]
    screenshot(page, "page-gallery.png")
    assert [error for error in tab.errors if not re.search("status of 4", error)] == []


@needs_browser
@pytest.mark.usefixtures("worker")
def test_the_gallery_after_a_reload_and_a_change_of_key_with_retry_and_start_image(
        tab: Tab, start_api: Callable[..., Process], worker_settings: Settings) -> None:
    from playwright.sync_api import expect

    api = start_api(worker_settings, api_keys='{"k": "web", "m": "other"}')
    page = tab.page
    page.goto(api.url + "/")
    expect(page.locator("#queue-note")).to_contain_text("Enter your API key")
    page.fill("#api_key", "k")
    page.locator("#api_key").blur()
    job_id = submit_from_page(page, "a gallery piece", width=64, height=64, steps=2, seed=11)
    expect(card(page, job_id)).to_have_attribute("data-status", "succeeded")

    page.reload()  # the list comes back from GET /v1/jobs, the images fetched with the key
    gallery_card = page.locator(f'#gallery li.card[data-id="{job_id}"]')
    expect(gallery_card).to_be_visible()
    page.wait_for_function(f"""() => {{
        const img = document.querySelector('#gallery li.card[data-id="{job_id}"] .thumb');
        return img && img.complete && img.naturalWidth === 64;
    }}""")

    # Another key is another tenant: none of these jobs; back to the first, they return.
    page.fill("#api_key", "m")
    page.locator("#api_key").blur()
    expect(page.locator("#gallery li.card")).to_have_count(0)
    page.fill("#api_key", "k")
    page.locator("#api_key").blur()
    expect(gallery_card).to_be_visible()

    # Retry with the same settings: a new job with the same request, seed included.
    with page.expect_response(lambda response: response.request.method == "POST") as answer:
        gallery_card.locator("button.retry").click()
    again = answer.value.json()
    assert answer.value.status == 202 and again["id"] != job_id
    first = json.loads(api_get(api, f"/v1/jobs/{job_id}", "k"))["request"]
    assert again["request"] == first
    expect(card(page, again["id"])).to_have_attribute("data-status", "succeeded")

    # Its image as the next start image: the form switches to image-to-image at its size.
    gallery_card.locator("button.use").click()
    expect(page.locator("#image-preview")).to_be_visible()
    expect(page.locator("#image-size")).to_have_text("64 × 64 px")
    expect(page.locator("#width")).to_be_disabled()
    # 401: the list before the key was entered; 404: the first key's job in the URL, asked with the second.
    assert [error for error in tab.errors if not re.search("status of (401|404)", error)] == []


@needs_browser
def test_a_followed_job_survives_a_restart_of_the_api(tab: Tab, start_api: Callable[..., Process],
                                                       worker: Process, worker_settings: Settings) -> None:
    from playwright.sync_api import expect

    api = start_api(worker_settings)
    page = tab.page
    page.goto(api.url + "/")
    # Long enough, on a fast machine too, to be seen running and still run after the restart.
    job_id = submit_from_page(page, "through a restart", width=512, height=512, steps=50)
    expect(card(page, job_id)).to_have_attribute("data-status", "running")
    worker.popen.send_signal(signal.SIGSTOP)  # it is still running when the API comes back
    try:
        port = int(api.url.rsplit(":", 1)[1])
        assert api.stop() == 0
        start_api(worker_settings, port=port)
    finally:
        worker.popen.send_signal(signal.SIGCONT)
    # The stream reconnects to the new process with Last-Event-ID and sees the job to its end.
    expect(card(page, job_id)).to_have_attribute("data-status", "succeeded")
    expect(page.locator("#status")).to_have_text("succeeded")
    wait_for_image(page, 512)
    # While the API was down the page's requests failed; nothing else went wrong.
    lost = "ERR_CONNECTION_REFUSED|ERR_EMPTY_RESPONSE|ERR_INCOMPLETE_CHUNKED_ENCODING|network"
    assert [error for error in tab.errors if not re.search(lost, error)] == []


# --- ControlNet and the hires pass -------------------------------------------------------------------

@pytest.fixture(scope="module")
def controlnet_dir(model_cache: Path) -> Path:
    """The tiny model's ControlNets (chalk, ember, chalk-file), offered to every model of a service."""
    from worker.tiny.controlnets import ensure_tiny_controlnets

    return ensure_tiny_controlnets(model_cache, "tiny") / "tiny"


def open_page(page: Page, api: Process) -> dict[str, Any]:
    """Load the page and wait until it has read the default model (GET /v1/models); return that model."""
    from playwright.sync_api import expect

    page.goto(api.url + "/")
    default = json.loads(api_get(api, "/v1/models"))["models"][0]
    expect(page.locator("#control")).to_have_attribute("data-model", default["name"])
    return dict(default)


@needs_browser
def test_a_control_image_and_a_hires_pass(tab: Tab, start_api: Callable[..., Process], settings: Settings,
                                          controlnet_dir: Path, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    api = start_api(settings, controlnet_dir=str(controlnet_dir))  # no worker: the job stays queued
    page = tab.page
    names = open_page(page, api)["controlnets"]
    assert names == ["chalk", "chalk-file", "ember"]
    expect(page.locator("#control")).to_be_visible()
    expect(page.locator("#controlnet option")).to_have_text(names)
    page.select_option("#controlnet", "ember")
    control = start_image(tmp_path / "control.png", 64)
    page.set_input_files("#control_image", control)
    expect(page.locator("#control-status")).to_have_text("Control image: control.png, 64 × 64 px.")
    expect(page.locator("#control-preview")).to_be_visible()
    page.check("#control_canny")
    page.fill("#control_scale", "0.6")

    expect(page.locator("#hires-fields")).to_be_hidden()
    page.check("#hires")
    expect(page.locator("#hires_scale")).to_have_value("2")
    # At 512 px the service's largest side (1024) bounds the scale at 2; at 64 px, the API's 4.
    page.fill("#width", "512")
    expect(page.locator("#hires_scale")).to_have_attribute("max", "2")
    fill_form(page, "a lighthouse, traced", width=64, height=64, steps=4, seed=1, hires_scale=1.5)
    expect(page.locator("#hires_scale")).to_have_attribute("max", "4")
    page.select_option("#hires_upscaler", "lanczos")
    page.click("#submit")

    expect(page.locator("#status")).to_have_text("queued")
    job = job_of(api, page)
    data = control.read_bytes()
    assert job["request"]["controlnets"] == [
        {"name": "ember", "scale": 0.6, "start": 0.0, "end": 1.0, "preprocess": "canny", "low": 100,
         "high": 200, "image": {"media_type": "image/png", "width": 64, "height": 64, "bytes": len(data),
                   "sha256": hashlib.sha256(data).hexdigest()}}]
    assert job["request"]["hires"] == {"scale": 1.5, "steps": None, "denoise": 0.5, "upscaler": "lanczos"}
    assert api_get(api, f"/v1/jobs/{job['id']}/inputs/control0") == data
    # Both passes count: 4 steps, then half of the hires pass's 4.
    expect(page.locator("#progress-text")).to_have_text("0 / 6")
    expect(page.locator("#input")).to_have_text(
        "the prompt only; ControlNet ember at scale 0.6, canny edges; a hires pass × 1.5 (lanczos)")
    screenshot(page, "page-controlnet-hires.png")

    # Canceled, then retried from the gallery: the control image is fetched back and sent again.
    page.click("#cancel")
    expect(card(page, job["id"])).to_have_attribute("data-status", "canceled")
    with page.expect_response(lambda response: response.request.method == "POST") as answer:
        card(page, job["id"]).locator("button.retry").click()
    assert answer.value.status == 202
    assert answer.value.json()["request"] == job["request"]

    # A start image has its size: no hires pass with it, and back with text-to-image.
    choose_image(page, start_image(tmp_path / "start.png", 64))
    expect(page.locator("#hires-group")).to_be_hidden()
    expect(page.locator("#control")).to_be_visible()  # a control works with a start image too
    page.click("#image-clear")
    expect(page.locator("#hires-group")).to_be_visible()
    expect(page.locator("#hires_scale")).to_be_visible()
    assert tab.errors == []
    page.close()  # its stream of the queued job ends before the API stops


@needs_browser
def test_no_controlnet_group_without_controlnets(tab: Tab, start_api: Callable[..., Process],
                                                  settings: Settings) -> None:
    from playwright.sync_api import expect

    api = start_api(settings)
    page = tab.page
    assert open_page(page, api)["controlnets"] == []
    expect(page.locator("#control")).to_be_attached()
    expect(page.locator("#control")).to_be_hidden()
    expect(page.locator("#hires-group")).to_be_visible()
    page.check("#hires")  # its defaults
    fill_form(page, "a castle", width=64, height=64, steps=2)
    page.click("#submit")

    expect(page.locator("#status")).to_have_text("queued")
    request = job_of(api, page)["request"]
    assert request["hires"] == {"scale": 2.0, "steps": None, "denoise": 0.5, "upscaler": "latent"}
    assert request["controlnets"] == []
    assert tab.errors == []
    page.close()  # its stream of the queued job ends before the API stops


@needs_browser
def test_a_finished_clip_plays_with_its_poster_and_downloads_as_mp4(
        tab: Tab, start_api: Callable[..., Process], redis_url: str, model_cache: Path,
        tmp_path: Path) -> None:
    from playwright.sync_api import expect

    from tests.conftest import own_database
    from worker.video import read_mp4

    # A worker of the tiny Wan model on a queue of its own (database 20: the others', 0 to 19, apart).
    settings = Settings(redis_url=own_database(redis_url, 20), queue_name="page-video", cache_dir=model_cache,
                        model="tiny-wan", drain_s=0, max_frames=17)
    worker = harness.start_worker(settings, tmp_path / "worker.log")
    try:
        api = start_api(settings)
        page = tab.page
        page.goto(api.url + "/")
        fill_form(page, "a fox running through snow", width=64, height=64, steps=2, seed=3)
        page.click("#submit")
        player = page.locator("#images video")
        expect(player).to_have_count(1)
        page.wait_for_function("() => document.querySelector('#images video').readyState >= 1")
        size = page.eval_on_selector("#images video", "video => [video.videoWidth, video.videoHeight]")
        assert size == [64, 64]
        expect(player).to_have_attribute("poster", re.compile("^blob:"))
        expect(page.locator("#images a")).to_have_attribute("download", re.compile(r"\.mp4$"))
        job = job_of(api, page)
        assert job["request"]["frames"] == 17 and job["video"] == f"/v1/jobs/{job['id']}/video.mp4"
        frames, _ = read_mp4(api_get(api, job["video"]))
        assert frames.shape == (17, 64, 64, 3)
        assert tab.errors == []
    finally:
        assert worker.stop() == 0, worker.output()
