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

let current = null; // the job this page follows: {id, controller, canceling}
let objectUrls = [];
// What the next job sends besides the form's fields, as data: URLs. The image: {url, width, height}
// (its natural size). The mask: {url, picture} for a chosen file, {url, rect} for a drawn rectangle.
const inputs = { image: null, mask: null, imageRead: 0, maskRead: 0, pending: new Set() };
let drag = null; // while a rectangle is being drawn: {pointer, start: [x, y]} in the image's pixels

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

// With a start image only the last `strength` of the schedule runs (the service's own rounding).
function stepsRun(request) {
  if (!request.image) return request.steps;
  return Math.min(Math.floor(request.steps * request.strength), request.steps);
}

function showProgress(view) {
  const bar = $("progress");
  const total = view.progress ? view.progress.total : stepsRun(view.request);
  let step = view.progress ? view.progress.step : 0;
  if (view.status === "succeeded") step = total;
  bar.max = total;
  bar.value = step;
  $("progress-text").textContent = `${step} / ${total}`;
}

function inputText(request) {
  const image = request.image;
  if (!image) return "the prompt only";
  const mask = request.mask ? ", with a mask" : "";
  return `a start image of ${image.width} × ${image.height} px, strength ${request.strength}${mask}`;
}

function show(view) {
  $("job").hidden = false;
  $("job-id").textContent = view.id;
  $("status").textContent = view.status;
  $("status").dataset.status = view.status;
  $("position").textContent = positionText(view);
  $("eta").textContent = etaText(view);
  $("input").textContent = inputText(view.request);
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
function track(handler) {
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
  const { naturalWidth: width, naturalHeight: height } = chosen.picture;
  inputs.image = { url: chosen.url, width, height };
  $("image-preview").src = chosen.url;
  $("image-preview").alt = `The start image, ${chosen.name}`;
  $("image-size").textContent = `${width} × ${height} px`;
  const canvas = $("mask-canvas");
  canvas.width = width; // the overlay draws in the image's own pixels, whatever size it shows at
  canvas.height = height;
  clearMask();
  setImageMode(true);
  return true;
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
  body.priority = $("priority").value;
  return body;
}

async function submit(event) {
  event.preventDefault();
  const button = $("submit");
  button.disabled = true;
  clearError();
  try {
    if ((await Promise.all(inputs.pending)).includes(false)) return; // its error shows
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
  $("image").addEventListener("change", track(chooseImage));
  $("image-clear").addEventListener("click", () => {
    clearImage();
    $("image").focus();
  });
  $("mask").addEventListener("change", track(chooseMask));
  $("mask-clear").addEventListener("click", clearMask);
  const canvas = $("mask-canvas");
  canvas.addEventListener("pointerdown", dragStart);
  canvas.addEventListener("pointermove", dragMove);
  canvas.addEventListener("pointerup", dragEnd);
  canvas.addEventListener("pointercancel", dragEnd);
  clearImage(); // a reload may keep a file input's choice without its data: start from none
  resume();
}

init();
