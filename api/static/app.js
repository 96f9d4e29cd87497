// The slotq page: submit jobs to /v1/jobs and watch them wait, run and finish. Plain DOM, no build
// step. Every job on the page follows its event stream (GET /v1/jobs/<id>/events, read with fetch
// so that it can send the API key), never a timer; the list comes from GET /v1/jobs.
// Nothing from the server is parsed as HTML: every value goes in through textContent or attributes.
"use strict";

const ACTIVE = new Set(["queued", "running"]);
const KEY_STORAGE = "slotq.apiKey";
const RETRY_S = 1; // before reconnecting a stream, doubled after each failure up to MAX_RETRY_S
const MAX_RETRY_S = 10;
const TRANSIENT = new Set([0, 429, 502, 503, 504]);
// A browser opens at most six connections to one origin (HTTP/1.1): the page keeps four streams open,
// for the running jobs and the ones next in line, and two for everything else. A job beyond them
// shows what the list said of it until a stream frees up.
const LIVE_STREAMS = 4;
const LISTED = 50; // the newest jobs the page shows
const IMAGE_TYPES = new Set(["image/png", "image/jpeg", "image/webp"]);
// The page's own bound on a chosen file, for a friendly message before sending: the service's default
// SLOTQ_MAX_IMAGE_BYTES (where a service allows more, larger files go through the API or `slotq submit`).
const MAX_FILE_BYTES = 4 * 1024 * 1024;

const $ = (id) => document.getElementById(id);

class APIError extends Error {
  constructor(status, code, message, details = [], retryAfter = null) {
    super(message);
    Object.assign(this, { status, code, details, retryAfter });
  }
}

// Every job the page shows, by id: {id, view, card, lastId, following, controller, canceling,
// preview, blobs: its images once fetched, urls: their blob: URLs}. `generation` counts the lists loaded: a
// change of API key starts a new one, and what the old one still had in flight is dropped.
const jobs = new Map();
let selected = null; // the id of the job the detail panel shows
let generation = 0;
// What the next job sends besides the form's fields, as data: URLs. The image: {url, width, height}
// (its natural size). The mask: {url, picture} for a chosen file, {url, rect} for a drawn rectangle.
// The control image: {url, name}.
const inputs = {
  image: null, mask: null, control: null, imageRead: 0, maskRead: 0, controlRead: 0, pending: new Set(),
};
// The service's largest side (the width's maximum in /openapi.json); null until known.
let maxSide = null;
let drag = null; // while a rectangle is being drawn: {pointer, start: [x, y]} in the image's pixels

// --- HTTP -----------------------------------------------------------------------------------------

function apiKey() {
  return $("api_key").value.trim();
}

// `key`: the tenant's API key unless the caller names another (the operator's view sends its admin key).
function headersFor(extra = {}, key = apiKey()) {
  const headers = { ...extra };
  if (key) headers.Authorization = `Bearer ${key}`;
  return headers;
}

async function call(method, path, { body, signal, key = apiKey() } = {}) {
  const headers = headersFor(body === undefined ? {} : { "Content-Type": "application/json" }, key);
  let response;
  try {
    response = await fetch(path, {
      method, signal, headers, cache: "no-store",
      body: body === undefined ? undefined : JSON.stringify(body),
    });
  } catch (error) {
    if (error.name === "AbortError") throw error;
    throw new APIError(0, "unreachable", "The service did not answer.");
  }
  if (!response.ok) throw await errorOf(response);
  return response;
}

async function errorOf(response) {
  let error = {};
  try {
    error = (await response.json()).error || {};
  } catch {
    // Not slotq's envelope (a proxy's error page, say): fall back on the HTTP status.
  }
  const retryAfter = Number.parseInt(response.headers.get("Retry-After") || "", 10);
  return new APIError(response.status, error.code || `http_${response.status}`,
    error.message || response.statusText || "Request failed.", error.details || [],
    Number.isNaN(retryAfter) ? null : retryAfter);
}

const jobPath = (id) => `/v1/jobs/${encodeURIComponent(id)}`;

function pause(seconds, signal) {
  return new Promise((resolve, reject) => {
    const abort = () => {
      clearTimeout(timer);
      reject(new DOMException("aborted", "AbortError"));
    };
    const timer = setTimeout(() => {
      signal.removeEventListener("abort", abort);
      resolve();
    }, seconds * 1000);
    signal.addEventListener("abort", abort, { once: true });
  });
}

// --- Showing things -------------------------------------------------------------------------------

function showError(error) {
  const status = error.status ? `${error.status} ` : "";
  $("error-code").textContent = `${status}${error.code}:`;
  let message = error.message;
  if (error.retryAfter !== null && error.retryAfter !== undefined) {
    message += ` Retry in ${error.retryAfter} s.`;
  }
  if (error.status === 401) message += " Enter a valid API key above.";
  $("error-message").textContent = message;
  $("error-details").replaceChildren(...(error.details || []).map((detail) => {
    const item = document.createElement("li");
    item.textContent = `${(detail.loc || []).join(".")}: ${detail.msg}`;
    return item;
  }));
  $("error").hidden = false;
}

function clearError() {
  $("error").hidden = true;
}

function duration(seconds) {
  const whole = Math.max(0, Math.ceil(seconds));
  return whole < 60 ? `${whole} s` : `${Math.floor(whole / 60)} min ${whole % 60} s`;
}

function etaText(view) {
  if (!ACTIVE.has(view.status)) return "–";
  if (!view.eta_s) return "not known yet";
  const done = `done in ~${duration(view.eta_s.finish)}`;
  return view.status === "queued" ? `starts in ~${duration(view.eta_s.start)}, ${done}` : done;
}

function positionText(view) {
  if (view.position === null || view.position === undefined) return "–";
  return view.position === 0 ? "next in line" : `${view.position} ahead`;
}

// With a start image only the last `strength` of the schedule runs (the service's own rounding); a
// hires pass adds its `denoise` share of its own schedule. The progress's total, before the first step.
function stepsRun(request) {
  const part = (steps, share) => Math.min(Math.floor(steps * share), steps);
  const first = request.image ? part(request.steps, request.strength) : request.steps;
  const hires = request.hires ? part(request.hires.steps ?? request.steps, request.hires.denoise) : 0;
  return first + hires;
}

// The step a job is at and the steps it runs, for a progress bar.
function stepsOf(view) {
  const total = view.progress ? view.progress.total : stepsRun(view.request);
  const step = view.status === "succeeded" ? total : (view.progress ? view.progress.step : 0);
  return [step, total];
}

function showProgress(view) {
  const bar = $("progress");
  const [step, total] = stepsOf(view);
  bar.max = total;
  bar.value = step;
  $("progress-text").textContent = `${step} / ${total}`;
}

function inputText(request) {
  const image = request.image;
  const mask = request.mask ? ", with a mask" : "";
  const parts = [image ? `a start image of ${image.width} × ${image.height} px, strength ${request.strength}${mask}`
    : "the prompt only"];
  for (const control of request.controlnets ?? []) {
    const canny = control.preprocess === "canny" ? ", canny edges" : "";
    parts.push(`ControlNet ${control.name} at scale ${control.scale}${canny}`);
  }
  if (request.hires) parts.push(`a hires pass × ${request.hires.scale} (${request.hires.upscaler})`);
  return parts.join("; ");
}

// --- Event streams --------------------------------------------------------------------------------

function parseEvent(block) {
  const event = { id: null, event: "message", data: "" };
  for (const line of block.split("\n")) {
    if (line.startsWith(":")) continue; // a keep-alive comment
    const colon = line.indexOf(":");
    const name = colon < 0 ? line : line.slice(0, colon);
    const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
    if (name === "id") event.id = value;
    else if (name === "event") event.event = value;
    else if (name === "data") event.data += value;
  }
  return event.data ? { ...event, data: JSON.parse(event.data) } : null;
}

// A job's events as they come, from after `lastId`. Ends when the server ends the stream (after the
// final event, or when the API process drains); throws APIError for a refusal or a lost connection.
async function* streamOf(id, { signal, lastId }) {
  const headers = headersFor({ Accept: "text/event-stream" });
  if (lastId) headers["Last-Event-ID"] = lastId;
  let response;
  try {
    response = await fetch(`${jobPath(id)}/events`, { headers, signal, cache: "no-store" });
  } catch (error) {
    if (error.name === "AbortError") throw error;
    throw new APIError(0, "unreachable", "The service did not answer.");
  }
  if (response.status === 204) return; // it had the final event already
  if (!response.ok) throw await errorOf(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      let chunk;
      try {
        chunk = await reader.read();
      } catch (error) {
        if (error.name === "AbortError") throw error;
        throw new APIError(0, "unreachable", "The connection to the service was lost.");
      }
      if (chunk.done) return;
      buffer += chunk.value.replace(/\r\n?/g, "\n");
      for (let end = buffer.indexOf("\n\n"); end >= 0; end = buffer.indexOf("\n\n")) {
        const event = parseEvent(buffer.slice(0, end));
        buffer = buffer.slice(end + 2);
        if (event) yield event;
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

// Follow one job's stream until its final event, reconnecting with Last-Event-ID after a dropped
// connection or an API restart, so that nothing is missed and nothing comes twice.
async function follow(entry) {
  const { signal } = entry.controller;
  let wait = RETRY_S;
  while (!signal.aborted && ACTIVE.has(entry.view.status)) {
    try {
      for await (const event of streamOf(entry.id, { signal, lastId: entry.lastId })) {
        if (event.id) entry.lastId = event.id;
        apply(entry, event);
        wait = RETRY_S;
      }
      if (ACTIVE.has(entry.view.status) && entry.lastId?.endsWith("/end")) {
        // Told the end before, yet not in this view: read the job once instead.
        apply(entry, { event: "view", data: await (await call("GET", jobPath(entry.id), { signal })).json() });
      }
      entry.error = null;
    } catch (error) {
      if (error.name === "AbortError") return;
      entry.error = error;
      render(entry);
      if (!TRANSIENT.has(error.status)) return; // 401, 404, 410: asking again will not help
      wait = error.retryAfter ?? Math.min(wait * 2, MAX_RETRY_S);
    }
    if (ACTIVE.has(entry.view.status)) await pause(wait, signal).catch(() => {});
  }
}

// One event into the job's state. `queued`, `started` and the final ones carry the whole view.
function apply(entry, { event, data }) {
  if (event === "progress") {
    // A step, with the job's ETA at the step time shown so far, where the worker knows it.
    const { eta_s: eta, ...progress } = data;
    entry.view = { ...entry.view, progress, ...(eta ? { eta_s: eta } : {}) };
  } else if (event === "preview") {
    entry.preview = data;
  } else {
    entry.view = data;
    entry.error = null;
  }
  render(entry);
  if (!ACTIVE.has(entry.view.status)) ended(entry);
}

// Streams for the jobs next to run, as many as LIVE_STREAMS allows.
function schedule() {
  const entries = [...jobs.values()];
  let free = LIVE_STREAMS - entries.filter((entry) => entry.following).length;
  for (const entry of entries.filter((each) => !each.following && !each.stopped && ACTIVE.has(each.view.status))
    .sort(inLine)) {
    if (free-- <= 0) break;
    entry.following = true;
    entry.controller = new AbortController();
    const started = generation;
    follow(entry).catch((error) => {
      if (error.name !== "AbortError") entry.error = error;
    }).finally(() => {
      entry.following = false;
      entry.stopped = entry.stopped || ACTIVE.has(entry.view.status); // refused: no retry loop
      if (started === generation) schedule();
    });
  }
}

// Running jobs first, then waiting ones by their place in the line, then the older first.
function inLine(a, b) {
  const rank = (view) => (view.status === "running" ? -1 : view.position ?? Number.MAX_SAFE_INTEGER);
  return rank(a.view) - rank(b.view) || String(a.view.created_at).localeCompare(String(b.view.created_at));
}

// --- The queue panel, the gallery and the detail ----------------------------------------------------

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function button(label, className, onClick) {
  const node = element("button", `secondary ${className}`, label);
  node.type = "button";
  node.addEventListener("click", onClick);
  return node;
}

// A job's card, made once; render() keeps it up to date and puts it in the queue or the gallery.
function cardOf(entry) {
  const card = element("li", "card");
  card.dataset.id = entry.id;
  const picture = element("img", "thumb");
  picture.hidden = true;
  const open = button("", "open", () => select(entry.id));
  open.setAttribute("aria-label", `Open job ${entry.id}`);
  open.append(picture, element("span", "prompt"));
  const status = element("p", "line");
  status.setAttribute("role", "status");
  const bar = element("progress");
  bar.max = 1;
  bar.value = 0;
  const actions = element("div", "actions");
  actions.append(
    button("Cancel", "cancel", () => cancel(entry)),
    button("Retry", "retry", () => retry(entry)),
    button("Use as start image", "use", () => useAsStart(entry)),
  );
  card.append(open, status, bar, actions);
  return card;
}

function lineText(entry) {
  const view = entry.view;
  const parts = [view.status];
  if (view.status === "queued") parts.push(positionText(view), etaText(view));
  if (view.status === "running") parts.push(etaText(view));
  if (view.error && !ACTIVE.has(view.status)) parts.push(view.error.code);
  if (entry.error) parts.push(`(${entry.error.code}: reconnecting)`);
  return parts.filter((part) => part && part !== "–").join(" · ");
}

function render(entry) {
  entry.card ??= cardOf(entry);
  const { card, view } = entry;
  card.dataset.status = view.status;
  if (view.status === "queued") card.dataset.position = String(view.position ?? "");
  else delete card.dataset.position;
  card.querySelector(".prompt").textContent = view.request.prompt;
  card.querySelector(".line").textContent = lineText(entry);
  const bar = card.querySelector("progress");
  const [step, total] = stepsOf(view);
  bar.max = total;
  bar.value = step;
  bar.hidden = view.status !== "running";
  const picture = card.querySelector(".thumb");
  if (view.status === "running" && entry.preview) {
    picture.src = entry.preview.image; // a data: URL the server made
    picture.alt = `A preview at step ${entry.preview.step} of: ${view.request.prompt}`;
    card.dataset.preview = String(entry.preview.step);
    picture.hidden = false;
  } else if (entry.urls?.length) {
    picture.src = entry.urls[0];
    picture.alt = `The image of: ${view.request.prompt}`;
    picture.hidden = false;
  }
  card.querySelector(".cancel").hidden = !ACTIVE.has(view.status);
  card.querySelector(".cancel").disabled = Boolean(entry.canceling);
  card.querySelector(".retry").hidden = ACTIVE.has(view.status);
  card.querySelector(".use").hidden = view.status !== "succeeded";
  place(entry);
  if (entry.id === selected) show(entry);
}

// Waiting and running jobs in the queue panel, in line order; ended ones in the gallery, newest first.
function place(entry) {
  const list = ACTIVE.has(entry.view.status) ? $("queue-list") : $("gallery");
  const others = [...jobs.values()].filter((other) => other !== entry && other.card?.parentNode === list);
  const order = ACTIVE.has(entry.view.status) ? inLine
    : (a, b) => String(b.view.created_at).localeCompare(String(a.view.created_at));
  const before = others.filter((other) => order(other, entry) > 0)
    .sort(order)[0];
  if (entry.card.parentNode !== list || entry.card.nextSibling !== (before?.card ?? null)) {
    list.insertBefore(entry.card, before?.card ?? null);
  }
  $("queue-note").hidden = $("queue-list").children.length > 0;
  $("gallery-note").hidden = $("gallery").children.length > 0;
}

async function ended(entry) {
  entry.controller?.abort();
  if (entry.view.status !== "succeeded" || entry.urls) return;
  entry.urls = [];
  entry.blobs = [];
  const started = generation;
  try {
    for (const path of entry.view.images) {
      const blob = await (await call("GET", path)).blob();
      if (started !== generation) return;
      // A blob: URL, because an <img src> could not send the Authorization header.
      entry.blobs.push(blob);
      entry.urls.push(URL.createObjectURL(blob));
    }
    if (entry.view.video) {  // a clip: its MP4 whole, as a blob: URL for the same reason
      const clip = await (await call("GET", entry.view.video)).blob();
      if (started !== generation) return;
      entry.video = URL.createObjectURL(clip);
    }
  } catch (error) {
    entry.error = error;
  }
  render(entry);
}

// The detail panel: the selected job, with its full images once it has them.
function show(entry) {
  const view = entry.view;
  $("job").hidden = false;
  $("job-id").textContent = view.id;
  $("status").textContent = view.status;
  $("status").dataset.status = view.status;
  $("position").textContent = positionText(view);
  $("eta").textContent = etaText(view);
  $("input").textContent = inputText(view.request);
  showProgress(view);
  $("cancel").disabled = !ACTIVE.has(view.status) || Boolean(entry.canceling);
  const preview = $("job-preview");
  preview.hidden = !(view.status === "running" && entry.preview);
  if (!preview.hidden) preview.src = entry.preview.image;
  if (view.status === "failed" || view.status === "expired") {
    const error = view.error || { code: view.status, message: "The job's deadline passed before it started." };
    showError(new APIError(null, error.code, error.message));
  }
  showImages(entry);
}

function showImages(entry) {
  const shown = $("images");
  if (entry.video) return showVideo(entry, shown);
  if (shown.dataset.id === entry.id && shown.children.length === (entry.urls?.length ?? 0)) return;
  shown.dataset.id = entry.id;
  shown.replaceChildren(...(entry.urls ?? []).map((url, index) => {
    const link = element("a");
    link.href = url;
    link.download = `${entry.id}-${index}.png`;
    const image = element("img");
    image.src = url;
    image.alt = `Image ${index + 1} of ${entry.urls.length} for: ${entry.view.request.prompt}`;
    link.append(image);
    return link;
  }));
}

// A finished clip: a player with its poster (the first frame), and the MP4 to download.
function showVideo(entry, shown) {
  if (shown.dataset.id === entry.id && shown.querySelector("video")) return;
  shown.dataset.id = entry.id;
  const player = element("video");
  Object.assign(player, { src: entry.video, controls: true, loop: true, muted: true, playsInline: true });
  if (entry.urls?.length) player.poster = entry.urls[0];
  player.setAttribute("aria-label", `Video for: ${entry.view.request.prompt}`);
  const link = element("a", "download", "Download the MP4");
  link.href = entry.video;
  link.download = `${entry.id}.mp4`;
  shown.replaceChildren(player, link);
}

function select(id) {
  if (selected !== id) clearError();
  selected = id;
  history.replaceState(null, "", `#job=${encodeURIComponent(id)}`);
  const entry = jobs.get(id);
  if (entry) show(entry);
}

// A job the page has not shown yet (just submitted, or named in the URL), from its view.
function track(view) {
  let entry = jobs.get(view.id);
  if (!entry) {
    entry = { id: view.id, view, lastId: null, following: false };
    jobs.set(view.id, entry);
  }
  render(entry);
  if (ACTIVE.has(view.status)) schedule();
  else ended(entry);
  return entry;
}

function forgetAll() {
  generation += 1;
  for (const entry of jobs.values()) {
    entry.controller?.abort();
    for (const url of entry.urls ?? []) URL.revokeObjectURL(url);
  }
  jobs.clear();
  selected = null;
  $("job").hidden = true;
  $("queue-list").replaceChildren();
  $("gallery").replaceChildren();
  $("images").replaceChildren();
  delete $("images").dataset.id;
  $("queue-note").hidden = false;
  $("queue-note").textContent = "No job is waiting or running.";
  $("gallery-note").hidden = false;
}

// The caller's newest jobs (the API key's tenant), then the job in the URL if the list lacks it.
async function load() {
  forgetAll();
  const started = generation;
  loadModel(started);
  const wanted = new URLSearchParams(location.hash.slice(1)).get("job");
  try {
    const page = await (await call("GET", `/v1/jobs?limit=${LISTED}`)).json();
    if (started !== generation) return;
    page.jobs.forEach(track);
  } catch (error) {
    if (started !== generation) return;
    // Without a valid key the list is refused: say so where the list would be, not as an error.
    if (error.status === 401) $("queue-note").textContent = "Enter your API key above to see your jobs.";
    else showError(error);
  }
  if (!wanted) return;
  try {
    if (!jobs.has(wanted)) track(await (await call("GET", jobPath(wanted))).json());
    if (started === generation) select(wanted);
  } catch (error) {
    if (started !== generation) return;
    // Not this key's job (or long gone): the URL stops naming it.
    if (error.status === 404) history.replaceState(null, "", location.pathname);
    else showError(error);
  }
}

// --- Start image and mask ------------------------------------------------------------------------

const inputError = (message) => new APIError(null, "invalid_image", message);

function fileProblem(file, what) {
  if (file.size > MAX_FILE_BYTES) {
    const mib = (file.size / 1024 / 1024).toFixed(1);
    return `${what} is ${mib} MiB; this page sends files of at most ${MAX_FILE_BYTES / 1024 / 1024} MiB.`;
  }
  if (!IMAGE_TYPES.has(file.type)) {
    return `${what} must be a PNG, JPEG or WebP file; ${file.name} is ${file.type || "of an unknown type"}.`;
  }
  return null;
}

// The file as a data: URL, sent as it is (the service checks it), and as a decoded picture.
async function readPicture(file) {
  const url = await new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.addEventListener("load", () => resolve(reader.result));
    reader.addEventListener("error", () => reject(reader.error));
    reader.readAsDataURL(file);
  });
  const picture = new Image();
  picture.src = url;
  await picture.decode();
  return { url, picture };
}

// Submitting waits for a file still being read, so a quick click does not send the old inputs; a
// handler answers false when the file was refused, and then nothing is sent.
function pending(handler) {
  return () => {
    const settled = handler().catch((error) => {
      showError(error);
      return false;
    });
    inputs.pending.add(settled);
    settled.then(() => inputs.pending.delete(settled));
  };
}

// A read that another choice overtook must not land: each read takes a number and checks it.
async function chosenPicture(input, what, counter) {
  const file = input.files[0];
  const read = ++inputs[counter];
  clearError();
  if (!file) return null;
  const problem = fileProblem(file, what);
  if (problem) throw inputError(problem);
  let result;
  try {
    result = await readPicture(file);
  } catch {
    if (read !== inputs[counter]) return undefined;
    throw inputError(`${what} (${file.name}) could not be read as an image.`);
  }
  return read === inputs[counter] ? { ...result, name: file.name } : undefined;
}

function setImageMode(withImage) {
  for (const id of ["width", "height"]) {
    $(id).disabled = withImage;
    $(`${id}-field`).hidden = withImage;
  }
  $("size-field").hidden = !withImage;
  $("strength-field").hidden = !withImage;
  $("strength").disabled = !withImage;
  $("image-panel").hidden = !withImage;
  setHiresMode();
}

function clearImage() {
  inputs.image = null;
  inputs.imageRead += 1;
  $("image").value = "";
  $("image-preview").removeAttribute("src");
  $("image-size").textContent = "";
  clearMask();
  setImageMode(false);
}

async function chooseImage() {
  let chosen;
  try {
    chosen = await chosenPicture($("image"), "The start image", "imageRead");
  } catch (error) {
    clearImage();
    showError(error);
    return false;
  }
  if (chosen === undefined) return true; // another image was chosen meanwhile
  if (chosen === null) {
    clearImage();
    return true;
  }
  setStartImage(chosen);
  return true;
}

// The start image the next job sends: {url, picture, name}, from a chosen file or a finished job.
function setStartImage({ url, picture, name }) {
  const { naturalWidth: width, naturalHeight: height } = picture;
  inputs.image = { url, width, height };
  $("image-preview").src = url;
  $("image-preview").alt = `The start image, ${name}`;
  $("image-size").textContent = `${width} × ${height} px`;
  const canvas = $("mask-canvas");
  canvas.width = width; // the overlay draws in the image's own pixels, whatever size it shows at
  canvas.height = height;
  clearMask();
  setImageMode(true);
}

function setMask(mask, status) {
  inputs.mask = mask;
  $("mask-clear").disabled = mask === null;
  $("mask-status").textContent = status;
  drawOverlay(mask);
}

function clearMask() {
  inputs.maskRead += 1;
  $("mask").value = "";
  drag = null;
  setMask(null, "No mask: the whole image is reworked. Drag over the image to draw the area to repaint, "
    + "or choose a mask file.");
}

async function chooseMask() {
  let chosen;
  try {
    chosen = await chosenPicture($("mask"), "The mask", "maskRead");
  } catch (error) {
    clearMask();
    showError(error);
    return false;
  }
  if (chosen === undefined || !inputs.image) return true;
  if (chosen === null) {
    clearMask();
    return true;
  }
  const { naturalWidth: width, naturalHeight: height } = chosen.picture;
  const image = inputs.image;
  const fits = width === image.width && height === image.height ? ""
    : ` It is not the image's size (${image.width} × ${image.height} px), so the service will refuse it.`;
  setMask({ url: chosen.url, picture: chosen.picture }, `Mask: ${chosen.name}, ${width} × ${height} px.${fits}`);
  return true;
}

// The overlay shows the mask as it will be sent, half transparent: the kept part darker.
function drawOverlay(mask) {
  const canvas = $("mask-canvas");
  const context = canvas.getContext("2d");
  context.clearRect(0, 0, canvas.width, canvas.height);
  if (!mask) return;
  context.globalAlpha = 0.5;
  if (mask.picture) {
    context.drawImage(mask.picture, 0, 0, canvas.width, canvas.height);
  } else {
    const { x, y, width, height } = mask.rect;
    context.fillStyle = "#000";
    context.fillRect(0, 0, canvas.width, canvas.height);
    context.clearRect(x, y, width, height);
    context.fillStyle = "#fff";
    context.fillRect(x, y, width, height);
    context.globalAlpha = 1;
    // A line of about 2 px as shown, whatever the scale from the image's pixels to the screen.
    const scale = canvas.width / Math.max(1, canvas.getBoundingClientRect().width);
    context.lineWidth = 2 * scale;
    context.setLineDash([4 * scale, 3 * scale]);
    context.strokeStyle = "#2563eb";
    context.strokeRect(x, y, width, height);
  }
  context.globalAlpha = 1;
}

// Where the pointer is, in the image's own pixels (the canvas's), kept inside the image.
function pointOf(event) {
  const canvas = $("mask-canvas");
  const box = canvas.getBoundingClientRect();
  const along = (offset, extent, pixels) =>
    Math.min(pixels, Math.max(0, Math.round((offset / Math.max(1, extent)) * pixels)));
  return [along(event.clientX - box.left, box.width, canvas.width),
    along(event.clientY - box.top, box.height, canvas.height)];
}

function rectOf([x0, y0], [x1, y1]) {
  return { x: Math.min(x0, x1), y: Math.min(y0, y1), width: Math.abs(x1 - x0), height: Math.abs(y1 - y0) };
}

// The mask the service gets: the image's natural size, the rectangle white on black.
function maskUrl(rect) {
  const canvas = document.createElement("canvas");
  canvas.width = inputs.image.width;
  canvas.height = inputs.image.height;
  const context = canvas.getContext("2d");
  context.fillStyle = "#000";
  context.fillRect(0, 0, canvas.width, canvas.height);
  context.fillStyle = "#fff";
  context.fillRect(rect.x, rect.y, rect.width, rect.height);
  return canvas.toDataURL("image/png");
}

function dragStart(event) {
  if (!inputs.image || event.button !== 0) return;
  event.preventDefault();
  $("mask-canvas").setPointerCapture(event.pointerId);
  drag = { pointer: event.pointerId, start: pointOf(event) };
  drawOverlay({ rect: rectOf(drag.start, drag.start) });
}

function dragMove(event) {
  if (drag === null || event.pointerId !== drag.pointer) return;
  drawOverlay({ rect: rectOf(drag.start, pointOf(event)) });
}

function dragEnd(event) {
  if (drag === null || event.pointerId !== drag.pointer) return;
  const rect = rectOf(drag.start, pointOf(event));
  drag = null;
  if (event.type === "pointercancel" || rect.width < 1 || rect.height < 1) {
    drawOverlay(inputs.mask); // a click, not a drag: the mask stays as it was
    return;
  }
  inputs.maskRead += 1; // a mask file still being read loses to the drawn rectangle
  $("mask").value = "";
  setMask({ url: maskUrl(rect), rect }, `Mask: a rectangle of ${rect.width} × ${rect.height} px at `
    + `(${rect.x}, ${rect.y}), drawn on the image.`);
}

// --- ControlNet and hires pass ---------------------------------------------------------------------

// The ControlNets (its own and the folder's) of the model a job runs on when it names none, which
// GET /v1/models lists first: the group shows only where it has some.
async function loadModel(started) {
  let model = null;
  try {
    model = (await (await call("GET", "/v1/models")).json()).models[0] ?? null;
  } catch {
    // Refused (no key yet: the list says so) or unreachable: no ControlNet group until it answers.
  }
  if (started !== generation) return;
  showControlNets(model?.controlnets ?? []);

  $("control").dataset.model = model?.name ?? ""; // which model's ControlNets the group offers
}

function showControlNets(names) {
  const select = $("controlnet");
  const chosen = select.value;
  select.replaceChildren(...names.map((name) => {
    const option = element("option", null, name);
    option.value = name;
    return option;
  }));
  if (names.includes(chosen)) select.value = chosen;
  $("control").hidden = names.length === 0;
  $("control").disabled = names.length === 0; // nor sent, nor checked by the form, while hidden
}

function clearControl() {
  inputs.control = null;
  inputs.controlRead += 1;
  $("control_image").value = "";
  $("control-preview").removeAttribute("src");
  $("control-panel").hidden = true;
  $("control-status").textContent = "No control image: the job runs without a ControlNet.";
}

async function chooseControl() {
  let chosen;
  try {
    chosen = await chosenPicture($("control_image"), "The control image", "controlRead");
  } catch (error) {
    clearControl();
    showError(error);
    return false;
  }
  if (chosen === undefined) return true; // another one was chosen meanwhile
  if (chosen === null) {
    clearControl();
    return true;
  }
  const { naturalWidth: width, naturalHeight: height } = chosen.picture;
  inputs.control = { url: chosen.url, name: chosen.name };
  $("control-preview").src = chosen.url;
  $("control-preview").alt = `The control image, ${chosen.name}`;
  $("control-panel").hidden = false;
  $("control-status").textContent = `Control image: ${chosen.name}, ${width} × ${height} px.`;
  return true;
}

// The one control the page offers, as the job sends it; none without a control image.
function controlsOf() {
  if ($("control").disabled || !inputs.control || !$("controlnet").value) return [];
  return [{
    name: $("controlnet").value, image: inputs.control.url, scale: Number($("control_scale").value),
    start: Number($("control_start").value), end: Number($("control_end").value),
    preprocess: $("control_canny").checked ? "canny" : "none",
  }];
}

const HIRES_FIELDS = ["hires_scale", "hires_denoise", "hires_upscaler", "hires_steps"];

// The hires pass is for text-to-image: with a start image (the job's size is the image's) it goes.
function setHiresMode() {
  const group = $("hires-group");
  group.hidden = Boolean(inputs.image);
  group.disabled = group.hidden;
  const on = $("hires").checked;
  $("hires-fields").hidden = !on;
  for (const id of HIRES_FIELDS) $(id).disabled = !on;
  boundHiresScale();
}

// The scale at which the larger side still fits the service's largest side, where the page knows it;
// the service checks the rounding to the model's multiple and says why it refuses.
function boundHiresScale() {
  const scale = $("hires_scale");
  const side = Math.max(Number($("width").value) || 0, Number($("height").value) || 0);
  if (!maxSide || side <= 0) {
    scale.max = "4";
    $("hires-bound").textContent = "(up to 4)";
    return;
  }
  const bound = Math.min(4, Math.floor((maxSide / side) * 100) / 100);
  scale.max = String(Math.max(Number(scale.min), bound));
  $("hires-bound").textContent = bound < Number(scale.min)
    ? `(none fits: the service's sides are at most ${maxSide} px)`
    : `(up to ${bound}: sides of at most ${maxSide} px)`;
}

function hiresOf() {
  if ($("hires-group").disabled || !$("hires").checked) return null;
  const steps = $("hires_steps").value.trim();
  return {
    scale: Number($("hires_scale").value), denoise: Number($("hires_denoise").value),
    upscaler: $("hires_upscaler").value, steps: steps === "" ? null : Number(steps),
  };
}

// The service's largest side, from its OpenAPI document (open to all, the key aside).
async function loadLimits() {
  try {
    const spec = await (await call("GET", "/openapi.json")).json();
    maxSide = spec.components.schemas.JobRequest.properties.width.maximum ?? null;
  } catch {
    maxSide = null; // the service refuses a size over it, and the page shows its message
  }
  boundHiresScale();
}

// --- The operator's view ----------------------------------------------------------------------------
// For the service's operators, behind an admin key of its own (SLOTQ_ADMIN_KEYS), stored apart from
// the tenant's key: every model's line with its first jobs, and the live workers, with the buttons of
// /v1/admin. Lines and workers have no event stream, so the view reads them again on a timer, and only
// while its section is open with a key.

const ADMIN_KEY_STORAGE = "slotq.adminKey";
const OPERATOR_REFRESH_S = 2;
const OPERATOR_JOBS = 10; // the first waiting jobs shown a line
const PLACES = { on_device: "on its device", in_host: "in host memory", released: "released" };
// `read` counts the reads, so that one a later read overtook does not land; `actionFailed`: the error
// shown is an action's, kept until the next action rather than cleared by the next read; `draining`:
// the workers asked to drain, until they leave the list.
const operator = { timer: null, read: 0, actionFailed: false, draining: new Set() };

function adminKey() {
  return $("admin_key").value.trim();
}

async function adminCall(method, path, body) {
  return (await call(method, `/v1/admin${path}`, { body, key: adminKey() })).json();
}

function showOperatorError(error) {
  const status = error.status ? `${error.status} ` : "";
  $("operator-error-code").textContent = `${status}${error.code}:`;
  const hint = error.status === 401 ? " Enter a valid admin key above." : "";
  $("operator-error-message").textContent = `${error.message}${hint}`;
  $("operator-error").hidden = false;
}

// Read the lines, their jobs and the workers and show them; again in OPERATOR_REFRESH_S.
async function refreshOperator() {
  clearTimeout(operator.timer);
  operator.timer = null;
  const read = ++operator.read;
  if (!$("operator").open || !adminKey()) {
    $("operator-view").hidden = true;
    $("operator-error").hidden = true;
    return;
  }
  try {
    const [lines, listed, workers] = await Promise.all([adminCall("GET", "/lines"),
      adminCall("GET", `/jobs?limit=${OPERATOR_JOBS}`), adminCall("GET", "/workers")]);
    if (read !== operator.read) return;
    showLines(lines.lines, listed.lines);
    showWorkers(workers.workers);
    $("op-updated").textContent = `Read at ${new Date().toLocaleTimeString()}.`;
    $("operator-view").hidden = false;
    if (!operator.actionFailed) $("operator-error").hidden = true;
  } catch (error) {
    if (read !== operator.read) return;
    operator.actionFailed = false;
    showOperatorError(error);
    // A refused key sees nothing, and asking again will not help; a lost connection keeps the last
    // view and tries again.
    if (!TRANSIENT.has(error.status)) {
      $("operator-view").hidden = true;
      return;
    }
  }
  operator.timer = setTimeout(refreshOperator, OPERATOR_REFRESH_S * 1000);
}

// One action from a button: the button waits for the answer, a refusal shows, and the view is read
// again at once. `done` takes the answer.
async function operate(control, path, body, done = () => {}) {
  control.disabled = true;
  operator.actionFailed = false;
  $("operator-error").hidden = true;
  try {
    done(await adminCall("POST", path, body));
  } catch (error) {
    showOperatorError(error);
    operator.actionFailed = true;
  } finally {
    control.disabled = false; // the read that follows sets what stays disabled
  }
  await refreshOperator();
}

// LIST's children one per item, keyed by data-ATTRIBUTE: a child is made once and updated in place
// (so a half-typed hold time and the focus outlive a refresh), put in the items' order, and those no
// longer listed go.
function keyed(list, items, attribute, make, update) {
  const old = new Map([...list.children].map((child) => [child.dataset[attribute], child]));
  items.forEach((item, index) => {
    const key = String(item[attribute]);
    let child = old.get(key);
    if (!child) {
      child = make(item);
      child.dataset[attribute] = key;
    }
    old.delete(key);
    update(child, item);
    if (list.children[index] !== child) list.insertBefore(child, list.children[index] ?? null);
  });
  for (const child of old.values()) child.remove();
}

function heading(name, ...rest) {
  const head = element("div", "op-head");
  head.append(element("strong", "op-name", name), element("span", "op-state"), ...rest);
  return head;
}

const timeOf = (iso) => new Date(iso).toLocaleTimeString();

// Each model's line: paused or not, its counts by class, its running and first waiting jobs.
function showLines(lines, listed) {
  const jobsOf = new Map(listed.map((line) => [line.model, line]));
  keyed($("op-lines"), lines, "model", lineCard,
    (card, line) => updateLine(card, line, jobsOf.get(line.model) ?? { running: [], waiting: [] }));
}

function lineCard(line) {
  const card = element("li", "card op-line");
  const path = `/lines/${encodeURIComponent(line.model)}`;
  const toggle = button("Pause", "toggle",
    () => operate(toggle, `${path}/${card.dataset.paused === "true" ? "resume" : "pause"}`));
  card.append(heading(line.model, toggle), element("p", "op-counts"), element("ul", "op-jobs"),
    element("p", "op-more"));
  return card;
}

function updateLine(card, line, listed) {
  card.dataset.paused = String(line.paused);
  card.querySelector(".op-state").textContent = line.paused ? "paused: its workers start nothing" : "taking jobs";
  card.querySelector("button.toggle").textContent = line.paused ? "Resume" : "Pause";
  const counts = Object.entries(line.waiting).map(([name, count]) => `${name} ${count}`).join(", ");
  card.querySelector(".op-counts").textContent = `Waiting: ${counts}. Running: ${listed.running.length}.`;
  keyed(card.querySelector(".op-jobs"), [...listed.running, ...listed.waiting], "id", jobRow, updateJob);
  const more = (listed.waiting_count ?? 0) - listed.waiting.length;
  card.querySelector(".op-more").textContent = more > 0 ? `and ${more} more waiting` : "";
}

function jobRow(view) {
  const row = element("li", "op-job");
  row.title = `Job ${view.id}`;
  const front = button("To front", "front",
    () => operate(front, `/jobs/${encodeURIComponent(view.id)}/front`));
  front.setAttribute("aria-label", `Move job ${view.id} to the front of its class`);
  row.append(element("span", "op-what"), element("span", "prompt"), front);
  return row;
}

function updateJob(row, view) {
  const waiting = view.status === "queued";
  row.dataset.status = view.status;
  row.querySelector(".op-what").textContent = [waiting ? positionText(view) : view.status,
    view.tenant ?? "no tenant", view.request.priority].join(" · ");
  row.querySelector(".prompt").textContent = view.request.prompt;
  const front = row.querySelector("button.front");
  front.hidden = !waiting;
  front.disabled = view.position === 0; // first already
}

// The live workers: state, device, where each of their models is, and the buttons.
function showWorkers(workers) {
  const live = new Set(workers.map((worker) => worker.name));
  for (const name of operator.draining) if (!live.has(name)) operator.draining.delete(name);
  $("op-workers-note").textContent = workers.length ? "" : "No worker is live.";
  keyed($("op-workers"), workers, "name", workerCard, updateWorker);
}

function workerCard(worker) {
  const card = element("li", "card op-worker");
  const path = `/workers/${encodeURIComponent(worker.name)}`;
  const hold = element("input", "hold");
  Object.assign(hold, { type: "number", min: "1", step: "1", placeholder: "no limit" });
  const holdLabel = element("label", "op-hold", "Hold for (s)");
  holdLabel.append(hold);
  // Released: it claims nothing and lets go of its device memory, for HOLD seconds or until resumed.
  const release = button("Release", "release", () => {
    const seconds = hold.value.trim();
    return operate(release, `${path}/release`, seconds === "" ? {} : { hold_s: Number(seconds) });
  });
  const resume = button("Resume", "resume", () => operate(resume, `${path}/resume`));
  const drain = button("Drain", "drain",
    () => operate(drain, `${path}/drain`, undefined, () => operator.draining.add(worker.name)));
  const actions = element("div", "actions");
  actions.append(holdLabel, release, resume, drain);
  card.append(heading(worker.name, element("span", "op-device")), element("p", "op-places"),
    element("p", "op-current"), actions);
  return card;
}

function updateWorker(card, worker) {
  const held = worker.state === "held";
  const draining = operator.draining.has(worker.name);
  card.dataset.state = worker.state;
  let state = held ? heldText(worker.held_until) : worker.state;
  if (draining) state += ", draining";
  card.querySelector(".op-state").textContent = state;
  card.querySelector(".op-device").textContent = worker.device;
  card.querySelector(".op-places").textContent = placesText(worker);
  const current = worker.current_jobs ?? [];
  card.querySelector(".op-current").textContent = current.length ? `Holds ${current.join(", ")}.` : "";
  card.querySelector("button.resume").disabled = !held;
  card.querySelector("button.drain").disabled = draining;
}

function heldText(until) {
  return until ? `held until ${timeOf(until)}` : "held until resumed";
}

function placesText(worker) {
  const places = worker.model_places ?? [];
  if (!places.length) return `Serves ${(worker.models?.length ? worker.models : [worker.model]).join(", ")}.`;
  return places.map(({ model, place, since }) => `${model}: ${PLACES[place] ?? place} since ${timeOf(since)}`)
    .join(" · ");
}

function initOperator() {
  try {
    $("admin_key").value = localStorage.getItem(ADMIN_KEY_STORAGE) || "";
  } catch {
    // No storage, no remembered key.
  }
  $("admin_key").addEventListener("change", () => {
    remember(ADMIN_KEY_STORAGE, adminKey());
    operator.draining.clear();
    refreshOperator();
  });
  $("operator").addEventListener("toggle", refreshOperator); // opened: read now; closed: stop
  // A remembered key opens the view as the operator left it (the toggle reads it).
  $("operator").open = adminKey() !== "";
}

// --- Form and buttons -----------------------------------------------------------------------------

function requestBody() {
  const value = (id) => $(id).value.trim();
  const body = { prompt: $("prompt").value };
  if (value("negative_prompt")) body.negative_prompt = $("negative_prompt").value;
  // With a start image, width and height are disabled: the image's size is the job's.
  for (const id of ["width", "height", "steps", "guidance_scale", "seed", "num_images", "strength"]) {
    if (!$(id).disabled && value(id) !== "") body[id] = Number(value(id));
  }
  if (inputs.image) body.image = inputs.image.url;
  if (inputs.image && inputs.mask) body.mask = inputs.mask.url;
  const controls = controlsOf();
  if (controls.length) body.controlnets = controls;
  const hires = hiresOf();
  if (hires) body.hires = hires;
  body.priority = $("priority").value;
  if ($("previews").checked) body.previews = true;
  return body;
}

async function send(body) {
  const view = await (await call("POST", "/v1/jobs", { body })).json();
  track(view);
  select(view.id);
}

async function submit(event) {
  event.preventDefault();
  const button = $("submit");
  button.disabled = true;
  clearError();
  try {
    if ((await Promise.all(inputs.pending)).includes(false)) return; // its error shows
    await send(requestBody());
  } catch (error) {
    showError(error);
  } finally {
    button.disabled = false;
  }
}

async function cancel(entry) {
  if (!entry || !ACTIVE.has(entry.view.status)) return;
  entry.canceling = true;
  render(entry);
  try {
    // 200: canceled; 202: the running job stops at its next step, and its stream tells when.
    const view = await (await call("DELETE", jobPath(entry.id))).json();
    if (jobs.get(entry.id) === entry) apply(entry, { event: "view", data: view });
  } catch (error) {
    entry.canceling = false;
    render(entry);
    showError(error);
  }
}

async function asDataUrl(blob) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.addEventListener("load", () => resolve(reader.result));
    reader.addEventListener("error", () => reject(reader.error));
    reader.readAsDataURL(blob);
  });
}

// The same settings again, seed included; a start image, mask and control images are fetched back
// from the job.
async function retry(entry) {
  clearError();
  const input = async (name) => asDataUrl(await (await call("GET", `${jobPath(entry.id)}/inputs/${name}`)).blob());
  try {
    const body = { ...entry.view.request };
    for (const name of ["image", "mask"]) {
      if (body[name]) body[name] = await input(name);
    }
    const controls = body.controlnets ?? [];
    body.controlnets = await Promise.all(controls.map(async (control, index) => ({
      ...control, image: await input(`control${index}`),
    })));
    await send(body);
  } catch (error) {
    showError(error);
  }
}

// A finished image as the next job's start image, as if its file had been chosen.
async function useAsStart(entry) {
  clearError();
  try {
    if (!entry.blobs?.length) throw new APIError(null, "not_ready", "The image is still loading.");
    inputs.imageRead += 1; // a file still being read loses to this image
    $("image").value = "";
    const url = await asDataUrl(entry.blobs[0]);
    const picture = new Image();
    picture.src = url;
    await picture.decode();
    setStartImage({ url, picture, name: `the image of job ${entry.id}` });
    $("prompt").focus();
  } catch (error) {
    showError(error);
  }
}

function remember(name, key) {
  try {
    if (key) localStorage.setItem(name, key);
    else localStorage.removeItem(name);
  } catch {
    // Storage may be off (a private window): the key still works for this page's life.
  }
}

function init() {
  try {
    $("api_key").value = localStorage.getItem(KEY_STORAGE) || "";
  } catch {
    // As above: no storage, no remembered key.
  }
  $("api_key").addEventListener("change", () => {
    remember(KEY_STORAGE, apiKey());
    load(); // another key may be another tenant: its own jobs
  });
  $("job-form").addEventListener("submit", submit);
  $("cancel").addEventListener("click", () => cancel(jobs.get(selected)));
  $("image").addEventListener("change", pending(chooseImage));
  $("image-clear").addEventListener("click", () => {
    clearImage();
    $("image").focus();
  });
  $("mask").addEventListener("change", pending(chooseMask));
  $("mask-clear").addEventListener("click", clearMask);
  $("control_image").addEventListener("change", pending(chooseControl));
  $("control-clear").addEventListener("click", () => {
    clearControl();
    $("control_image").focus();
  });
  $("hires").addEventListener("change", setHiresMode);
  for (const id of ["width", "height"]) $(id).addEventListener("input", boundHiresScale);
  const canvas = $("mask-canvas");
  canvas.addEventListener("pointerdown", dragStart);
  canvas.addEventListener("pointermove", dragMove);
  canvas.addEventListener("pointerup", dragEnd);
  canvas.addEventListener("pointercancel", dragEnd);
  clearImage(); // a reload may keep a file input's choice without its data: start from none
  clearControl();
  showControlNets([]);
  loadLimits();
  load();
  initOperator();
}

init();
