"""What a compatibility surface's synchronous call costs over slotq's own ways to wait.

    python -m bench.compat [--rounds 15] [--size 64] [--steps 4]

Starts its own ``redis-server``, one ``slotq api`` and one ``slotq worker``. In each round one client
makes the same job (the round's seed) each way in turn, on an idle line, and times the request sent
to the PNG's bytes in hand:

- ``POST /v1/jobs``, then ``GET /v1/jobs/<id>?wait=30`` until it ends, then ``GET .../images/0``
  (the baseline: slotq's client does this);
- ``POST /v1/jobs`` with ``Prefer: wait=60``, then the image;
- ``POST /v1/images/generations`` (OpenAI Images, ``b64_json``), the PNG decoded from the answer;
- ``POST /sdapi/v1/txt2img`` (AUTOMATIC1111), the PNG decoded from the answer.

The figure is each way's median time less the baseline's in the same round (paired rounds: a drift
of the machine's speed lands on both sides).
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.end_to_end import PNG, call, serving, wait_end
from bench.stats import median
from slotq.harness import Service

Way = Callable[[int, dict[str, Any]], bytes]  # (port, the job) -> the first image's PNG


def post(port: int, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
         ) -> tuple[int, Any]:
    """One JSON POST on a fresh connection: its status and parsed answer."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        connection.request("POST", path, body=json.dumps(body),
                           headers={"Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def image(port: int, job_id: str) -> bytes:
    """A finished job's first image."""
    status, png = call(port, "GET", f"/v1/jobs/{job_id}/images/0")
    if status != 200:
        raise RuntimeError(f"image of job {job_id}: {status} {png[:200]!r}")
    return png


def native_poll(port: int, job: dict[str, Any]) -> bytes:
    status, view = post(port, "/v1/jobs", job)
    if status != 202:
        raise RuntimeError(f"POST /v1/jobs answered {status}: {view}")
    return image(port, wait_end(port, view, time.monotonic() + 120)["id"])


def native_prefer(port: int, job: dict[str, Any]) -> bytes:
    status, view = post(port, "/v1/jobs", job, {"Prefer": "wait=60"})
    if status != 200 or view["status"] != "succeeded":
        raise RuntimeError(f"POST /v1/jobs with Prefer: wait answered {status}: {view}")
    return image(port, view["id"])


def openai_images(port: int, job: dict[str, Any]) -> bytes:
    body = {"prompt": job["prompt"], "size": f"{job['width']}x{job['height']}", "seed": job["seed"],
            "steps": job["steps"]}
    status, answer = post(port, "/v1/images/generations", body)
    if status != 200:
        raise RuntimeError(f"POST /v1/images/generations answered {status}: {answer}")
    return base64.b64decode(answer["data"][0]["b64_json"])


def a1111_txt2img(port: int, job: dict[str, Any]) -> bytes:
    body = {"prompt": job["prompt"], "width": job["width"], "height": job["height"], "seed": job["seed"],
            "steps": job["steps"]}
    status, answer = post(port, "/sdapi/v1/txt2img", body)
    if status != 200:
        raise RuntimeError(f"POST /sdapi/v1/txt2img answered {status}: {answer}")
    return base64.b64decode(answer["images"][0])


WAYS: dict[str, Way] = {"POST, then ?wait (baseline)": native_poll, "POST with Prefer: wait": native_prefer,
                        "OpenAI images.generate": openai_images, "A1111 txt2img": a1111_txt2img}


def timed_rounds(service: Service, rounds: int, size: int, steps: int) -> dict[str, list[float]]:
    """Each way's seconds, round by round, the same job in a round (its first round untimed)."""
    times: dict[str, list[float]] = {name: [] for name in WAYS}
    for round_ in range(rounds + 1):
        job = {"prompt": "a lighthouse", "width": size, "height": size, "steps": steps, "seed": round_}
        for name, way in WAYS.items():
            began = time.perf_counter()
            png = way(service.port, job)
            took = time.perf_counter() - began
            if not png.startswith(PNG):
                raise RuntimeError(f"{name}: not a PNG: {png[:20]!r}")
            if round_:  # the first round warms every path
                times[name].append(took)
    return times


def report(rounds: int = 15, size: int = 64, steps: int = 4, shared: Service | None = None) -> list[str]:
    """The table: each way's median time to the PNG, and its cost over the baseline in paired rounds."""
    with tempfile.TemporaryDirectory(prefix="slotq-bench-") as scratch:
        with serving(shared, Path(scratch), 2) as service:
            times = timed_rounds(service, rounds, size, steps)
    baseline = next(iter(times.values()))
    lines = [f"One job at a time, {size}x{size}, {steps} steps, tiny model, {rounds} paired rounds; "
             "time from the request sent to the PNG in hand",
             f"{'':32}{'median ms':>10}{'over baseline ms':>18}"]
    for name, seconds in times.items():
        over = median([mine - base for mine, base in zip(seconds, baseline, strict=True)])
        lines.append(f"{name:32}{1000 * median(seconds):>10.1f}{1000 * over:>+18.1f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    print("\n".join(report(args.rounds, args.size, args.steps)))


if __name__ == "__main__":
    main()
