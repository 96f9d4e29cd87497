// The slotq page: submit a job to /v1/jobs and follow it until it ends. Plain DOM, no build step.
// Nothing from the server is parsed as HTML: every value goes in through textContent or attributes.
"use strict";

const ACTIVE = new Set(["queued", "running"]);
const KEY_STORAGE = "slotq.apiKey";
// ?wait=N answers at once when the status changes, so a short wait still sees a start or an end at
// once, and meanwhile refreshes the position (queued) or the step progress (running).
const WAIT_S = { queued: 3, running: 1 };
const RETRY_S = 2; // after a transient failure that named no Retry-After
const TRANSIENT = new Set([0, 429, 502, 503, 504]);

const $ = (id) => document.getElementById(id);

class APIError extends Error {
  constructor(status, code, message, details = [], retryAfter = null) {
    super(message);
    Object.assign(this, { status, code, details, retryAfter });
  }
}

let current = null; // the job this page follows: {id, controller, canceling}
let objectUrls = [];

// --- HTTP -----------------------------------------------------------------------------------------

function apiKey() {
  return $("api_key").value.trim();
}

async function call(method, path, { body, signal } = {}) {
  const headers = {};
  if (apiKey()) headers.Authorization = `Bearer ${apiKey()}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
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

function showProgress(view) {
  const bar = $("progress");
  const total = view.progress ? view.progress.total : view.request.steps;
  let step = view.progress ? view.progress.step : 0;
  if (view.status === "succeeded") step = total;
  bar.max = total;
  bar.value = step;
  $("progress-text").textContent = `${step} / ${total}`;
}

function show(view) {
  $("job").hidden = false;
  $("job-id").textContent = view.id;
  $("status").textContent = view.status;
  $("status").dataset.status = view.status;
  $("position").textContent = positionText(view);
  $("eta").textContent = etaText(view);
  showProgress(view);
  $("cancel").disabled = !ACTIVE.has(view.status) || current === null || current.canceling;
  if (view.status === "failed" || view.status === "expired") {
    const error = view.error || { code: view.status, message: "The job's deadline passed before it started." };
    showError(new APIError(null, error.code, error.message));
  }
}

async function showImages(view, signal) {
  for (const [index, path] of view.images.entries()) {
    const blob = await (await call("GET", path, { signal })).blob();
    // A blob: URL, because an <img src> could not send the Authorization header.
    const url = URL.createObjectURL(blob);
    objectUrls.push(url);
    const link = document.createElement("a");
    link.href = url;
    link.download = `${view.id}-${index}.png`;
    const image = document.createElement("img");
    image.src = url;
    image.alt = `Image ${index + 1} of ${view.images.length} for: ${view.request.prompt}`;
    link.append(image);
    $("images").append(link);
  }
}

function resetJob() {
  current?.controller.abort();
  current = null;
  objectUrls.forEach((url) => URL.revokeObjectURL(url));
  objectUrls = [];
  $("images").replaceChildren();
  clearError();
}

// --- Following a job ------------------------------------------------------------------------------

async function poll(view, signal) {
  const wait = WAIT_S[view.status];
  const asked = performance.now();
  const next = await (await call("GET", `${jobPath(view.id)}?wait=${wait}`, { signal })).json();
  // A busy API answers ?wait at once; pause rather than turn that into a busy loop.
  if (next.status === view.status && performance.now() - asked < (wait * 1000) / 2) {
    await pause(1, signal);
  }
  return next;
}

async function follow(view, job) {
  const { signal } = job.controller;
  show(view);
  while (ACTIVE.has(view.status)) {
    try {
      view = await poll(view, signal);
      clearError();
    } catch (error) {
      if (error.name === "AbortError") return;
      showError(error);
      if (!TRANSIENT.has(error.status)) return; // 401, 404, 410: asking again will not help
      await pause(error.retryAfter ?? RETRY_S, signal).catch(() => {});
      if (signal.aborted) return;
      continue;
    }
    show(view);
  }
  if (view.status === "succeeded") await showImages(view, signal);
}

function start(view) {
  resetJob();
  const job = { id: view.id, controller: new AbortController(), canceling: false };
  current = job;
  history.replaceState(null, "", `#job=${encodeURIComponent(view.id)}`);
  follow(view, job).catch((error) => {
    if (error.name !== "AbortError") showError(error);
  });
}

// --- Form and buttons -----------------------------------------------------------------------------

function requestBody() {
  const value = (id) => $(id).value.trim();
  const body = { prompt: $("prompt").value };
  if (value("negative_prompt")) body.negative_prompt = $("negative_prompt").value;
  for (const id of ["width", "height", "steps", "guidance_scale", "seed", "num_images"]) {
    if (value(id) !== "") body[id] = Number(value(id));
  }
  body.priority = $("priority").value;
  return body;
}

async function submit(event) {
  event.preventDefault();
  const button = $("submit");
  button.disabled = true;
  clearError();
  try {
    const response = await call("POST", "/v1/jobs", { body: requestBody() });
    start(await response.json());
  } catch (error) {
    showError(error);
  } finally {
    button.disabled = false;
  }
}

async function cancel() {
  const job = current;
  if (job === null) return;
  job.canceling = true;
  $("cancel").disabled = true;
  try {
    // 200: canceled; 202: the running job stops at its next step, and following it shows that.
    const view = await (await call("DELETE", jobPath(job.id))).json();
    if (current === job) show(view);
  } catch (error) {
    job.canceling = false;
    showError(error);
  }
}

async function resume() {
  const id = new URLSearchParams(location.hash.slice(1)).get("job");
  if (!id) return;
  try {
    start(await (await call("GET", jobPath(id))).json());
  } catch (error) {
    showError(error);
  }
}

function rememberKey() {
  try {
    if (apiKey()) localStorage.setItem(KEY_STORAGE, apiKey());
    else localStorage.removeItem(KEY_STORAGE);
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
  $("api_key").addEventListener("change", rememberKey);
  $("job-form").addEventListener("submit", submit);
  $("cancel").addEventListener("click", cancel);
  resume();
}

init();
