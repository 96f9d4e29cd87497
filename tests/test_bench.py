"""``python -m bench --quick`` runs every benchmark and prints each table with its baseline row.

A smoke run: the figures are not asserted, only that every section ran and printed its rows.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

# Each section's baseline rows, then the rows it measures against them (batching's baseline is its
# "batch 1" column).
ROWS = {
    # Each row is a ratio to its baseline, measured in the same run.
    "Speed at the edges": ["admissions/s, slotq ÷ bare", "admission p99, slotq ÷ bare",
                           "refusals/s, line full", "admissions/s, deep line ÷ short line",
                           "admission p99, deep line ÷ short line", "images/s 64x64, service ÷ least service",
                           "images/s 256x256, service ÷ least service",
                           "images/s batch 8 64x64, service ÷ least service"],
    "GPU duty cycle and dispatch overhead": ["in-process loop (ceiling)", "bare BLMOVE/LREM loop",
                                             "plain RQ SimpleWorker", "slotq worker",
                                             "slotq worker, file store"],
    "Dynamic batching": ["64x64"],
    "Admission": ["bare LPUSH (baseline)", "bare Flask + LPUSH (baseline)", "POST /v1/jobs admitted (202)",
                  "POST /v1/jobs refused (429)", "POST /v1/jobs admitted", "POST /v1/jobs refused"],
    "End to end": ["in-process loop (baseline)", "slotq over HTTP"],
    "Synchronous calls": ["POST, then ?wait (baseline)", "POST with Prefer: wait", "OpenAI images.generate",
                          "A1111 txt2img"],
    "Memory": ["in-process loop (baseline)", "slotq worker", "slotq finishing process", "api process"],
    "Image inputs": ["text only (baseline)", "POST text job (baseline)", "encode output PNG (baseline)",
                     "text-to-image (baseline)", "ready (baseline)", "PNG start image", "JPEG start image",
                     "PNG start image + PNG mask", "POST with PNG start image", "POST with PNG image + mask",
                     "decode PNG start image", "decode JPEG start image", "decode PNG mask", "image-to-image",
                     "inpainting", "after 1st text job", "after 1st image-to-image job",
                     "after 1st inpainting job", "after a 2nd job of each kind"],
    "LoRA adapters": ["bare model (baseline)", "with ink (resident)", "with ink + neon (resident)",
                      "load from disk, then unload", "switch between two resident",
                      "switch adapter <-> bare model", "affinity off (baseline)", "affinity on, max skip 8",
                      "in-process loop (ceiling)", "slotq worker"],
    "Several models": ["sd diffusers folder (baseline)", "sd single file", "sdxl diffusers folder (baseline)",
                       "sdxl single file", "from disk, cache 1 (baseline)", "on the device, cache 2",
                       "affinity off, max skip 0 (baseline)", "affinity on, max skip 8"],
    "ControlNets and hires": ["bare job (baseline)", "with chalk (resident)", "with chalk + ember (resident)",
                              "job with chalk resident (baseline)", "job with chalk loaded first",
                              "load chalk (diffusers folder)", "load chalk-file (single file)",
                              "lookup of resident chalk", "canny preprocessor, 64x64",
                              "plain job 64x64 (baseline)", "plain job 128x128", "hires job 64 -> 128"],
    # gthread's row with its streams open has no figure when every call timed out, as it should.
    "Event streams": ["gthread, POST /v1/jobs, no stream", "gevent, POST /v1/jobs, no stream",
                      "gevent, POST /v1/jobs, 4 streams", "gevent, GET /v1/queue, 4 streams"],
    "Step-level scheduling": ["start-only batching (baseline)", "step-level joining",
                              "without preemption (baseline)", "with preemption"],
    "Step-level scheduling through workers": ["start-only batching (baseline)", "step-level joining",
                                              "without preemption (baseline)", "preempting at the next step"],
}


def has_row(text: str, name: str) -> bool:
    """Whether a table row starts with ``name`` and goes on with a figure."""
    return re.search(rf"^{re.escape(name)}[^\n]*?\s+[-+]?\d+\.\d+", text, re.MULTILINE) is not None


# A guard against a hang, not a speed limit: most of the run is starting workers (each imports torch
# and diffusers), which a 2-core machine busy with other work can make several times slower.
@pytest.mark.timeout(660)
def test_quick_report_has_every_section_with_its_baseline() -> None:
    # A torch with several OpenMP threads slows down by two orders of magnitude when other processes
    # (the API's, the clients', a CI runner's) take its cores; one thread keeps the smoke run short.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "bench", "--quick"], capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.returncode == 0, done.stdout + done.stderr[-5000:]
    header, *parts = re.split(r"^== (.+) ==$", done.stdout, flags=re.MULTILINE)
    sections = dict(zip(parts[::2], parts[1::2], strict=True))
    assert list(sections) == list(ROWS), done.stdout
    assert "CPU:" in header and "torch" in header and "CUDA available:" in header, header
    for title, rows in ROWS.items():
        for name in rows:
            assert has_row(sections[title], name), f"{title}: no row {name!r}\n{sections[title]}"
    assert "batch 1 img/s" in sections["Dynamic batching"]
    assert "202x40" in sections["Admission"] and "429x40" in sections["Admission"]
    assert len(re.findall(r"^api process \(pid \d+\)", sections["Memory"], re.MULTILINE)) == 2
    assert "10 refused (503)" in sections["Event streams"]  # past the bound, under gevent
    # The switch back from host memory is measured where CUDA is, and said to be n/a elsewhere.
    assert re.search(r"^from host memory, cache 1 +(n/a|\d+\.\d+)", sections["Several models"], re.MULTILINE)
    # Each image row says what a service doing only the least (each PNG encoded aside) would reach.
    edges = sections["Speed at the edges"]
    least = re.findall(r"the least a service does: (\d+\.\d+) of the loop at 1 thread", edges)
    assert len(least) == 3 and all(0 < float(ratio) < 3 for ratio in least), edges
    # Each figure is judged against its goal, and the goals are counted at the end; on the CPU the
    # image rows inform, their goal judged on a GPU.
    verdicts = r"met|missed|informative here \(read on a GPU\)"
    judged = re.findall(rf"  goal [^\n]+: ({verdicts})$", edges, re.MULTILINE)
    assert len(judged) == len(ROWS["Speed at the edges"]), edges
    informing = [line for line in edges.splitlines() if line.endswith("informative here (read on a GPU)")]
    assert len(informing) == 3 and all(line.startswith("images/s") for line in informing), edges
    counted = len(judged) - len(informing)
    assert re.search(rf"^goals: {judged.count('met')} of {counted} met.*; 3 informative here", edges,
                     re.MULTILINE), edges


def test_side_work_cpu_is_read_per_process_and_without_its_main_thread() -> None:
    # bench.edges reads the CPU of the service's other work from /proc: a process's in all, and
    # without its main thread (the worker's GPU section). A child burns 0.3 s on a second thread only.
    from bench.edges import cpu_seconds

    burn = ("import threading, time\n"
            "def spin():\n"
            "    until = time.thread_time() + 0.3\n"
            "    while time.thread_time() < until: pass\n"
            "thread = threading.Thread(target=spin); thread.start(); thread.join()\n"
            "print('burnt', flush=True); time.sleep(30)\n")
    with subprocess.Popen([sys.executable, "-c", burn], stdout=subprocess.PIPE, text=True) as child:
        try:
            assert child.stdout is not None and child.stdout.readline() == "burnt\n"
            in_all, main_thread = cpu_seconds(child.pid), cpu_seconds(child.pid, thread=child.pid)
            assert in_all - main_thread >= 0.25, (in_all, main_thread)  # the ended thread's time counts
            assert main_thread < 0.25, main_thread
        finally:
            child.kill()


# A guard against a hang: the run takes about 8 s on 2 cores, most of it importing torch and diffusers and
# building the tiny model and its ControlNets.
@pytest.mark.timeout(120)
def test_control_alone_prints_each_table_with_its_baseline() -> None:
    # bench.control also runs alone with its own options; one round at 64x64 is its smoke run.
    done = subprocess.run([sys.executable, "-m", "bench.control", "--rounds", "1", "--size", "64"],
                          capture_output=True, text=True, timeout=100,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout + done.stderr[-5000:]
    for name in ROWS["ControlNets and hires"]:
        assert has_row(done.stdout, name), f"no row {name!r}\n{done.stdout}"
    # Each table's baseline is its own unit, and the hires pass's cost is said in ms.
    assert len(re.findall(r"\(baseline\) +\d+\.\d+ +1\.0+x$", done.stdout, re.MULTILINE)) == 3, done.stdout
    assert re.search(r"^the second pass adds -?\d+\.\d ms to the job at 64x64", done.stdout, re.MULTILINE)


# A guard against a hang: the run takes about 10 s on 2 cores, most of it importing torch and diffusers.
@pytest.mark.timeout(120)
def test_stepping_alone_prints_both_policies_their_ratios_and_equal_images() -> None:
    # bench.stepping also runs alone with its own options; one round of 8 jobs is its smoke run.
    done = subprocess.run([sys.executable, "-m", "bench.stepping", "--rounds", "1", "--jobs", "8",
                           "--settle", "0"],
                          capture_output=True, text=True, timeout=100,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout + done.stderr[-5000:]
    for name in ROWS["Step-level scheduling"]:
        assert has_row(done.stdout, name), f"no row {name!r}\n{done.stdout}"
    # Each baseline row is its own unit; each part says whether its difference stood above the noise.
    assert len(re.findall(r"^start-only batching \(baseline\) .* 1\.00x$", done.stdout, re.MULTILINE)) == 1
    verdicts = re.findall(r"^noise: .*: the .+ (stood above it from round 1 of 1|did not stand above it in 1 "
                          r"rounds)$", done.stdout, re.MULTILINE)
    assert len(verdicts) == 2, done.stdout
    # The same job's image, whatever the policy or a pause: the loop's batched kernels' bound (1e-5).
    differences = re.findall(r"^images: .* at most (\S+) \(max abs", done.stdout, re.MULTILINE)
    assert len(differences) == 2 and all(float(each) <= 1e-5 for each in differences), done.stdout


# A guard against a hang: the run takes about 10 s on 2 cores, most of it importing torch and diffusers.
@pytest.mark.timeout(120)
def test_checkpoints_alone_prints_the_cost_the_saving_and_the_same_image() -> None:
    # bench.checkpoints is not in `python -m bench`; one round of a short job is its smoke run.
    done = subprocess.run([sys.executable, "-m", "bench.checkpoints", "--rounds", "1", "--size", "64",
                           "--steps", "8"], capture_output=True, text=True, timeout=100,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout + done.stderr[-5000:]
    for name in ("no checkpoints (baseline)", "a checkpoint after every step", "from step 0 (baseline)",
                 "from the checkpoint"):
        assert has_row(done.stdout, name), f"no row {name!r}\n{done.stdout}"
    assert re.search(r"^one save: \d+\.\d+ ms \(\d+ KiB\); at the default interval \(60 s\) \d+\.\d+ % of "
                     r"a job's time: goal <= 2 % (met|missed)$", done.stdout, re.MULTILINE), done.stdout
    assert "A whole pipeline call: a hires job with a LoRA" in done.stdout  # and the loop's job before it
    same = "the resumed image equals the uninterrupted one, byte for byte"
    assert done.stdout.count(same) == 2, done.stdout


@pytest.mark.timeout(180)
def test_video_alone_prints_the_service_against_the_loop_the_checkpoint_cost_and_the_same_clip() -> None:
    # bench.video is not in `python -m bench`; one round of two short clips is its smoke run.
    done = subprocess.run([sys.executable, "-m", "bench.video", "--rounds", "1", "--clips", "2", "--size",
                           "64", "--frames", "9", "--steps", "6"], capture_output=True, text=True,
                          timeout=160, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout + done.stderr[-5000:]
    for name in ("the pipeline in a loop (baseline)", "the loop, each clip encoded as MP4",
                 "through slotq (API, line, worker, store)", "a clip, no checkpoints (baseline)",
                 "a clip, a checkpoint after every step", "from step 0 (baseline)", "from the checkpoint"):
        assert has_row(done.stdout, name), f"no row {name!r}\n{done.stdout}"
    assert re.search(r"^one save: \d+\.\d+ ms \(\d+ KiB\); at the default interval \(60 s\) \d+\.\d+ % of "
                     r"a clip's time: goal <= 2 % (met|missed)$", done.stdout, re.MULTILINE), done.stdout
    assert "the resumed clip equals the uninterrupted one, frame for frame" in done.stdout


FULLSIZE_FAMILIES = {"sd": "SD 1.5", "sdxl": "SDXL", "flux": "Flux.1-dev"}


# A guard against a hang: the run takes about 10 s on 2 cores, most of it importing torch and diffusers.
@pytest.mark.timeout(240)
def test_fullsize_tiny_times_each_family_bare_and_through_the_worker_beside_the_published_figures(
        tmp_path: Path) -> None:
    # bench.fullsize is for GPU hosts and not in `python -m bench`; --tiny is its smoke run on the CPU.
    figures_file = tmp_path / "fullsize.json"
    done = subprocess.run([sys.executable, "-m", "bench.fullsize", "--tiny", "--repeat", "2",
                           "--json", str(figures_file)], capture_output=True, text=True, timeout=220,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout + done.stderr[-5000:]
    _, *parts = re.split(r"^== (.+) ==$", done.stdout, flags=re.MULTILINE)
    sections = dict(zip(parts[::2], parts[1::2], strict=True))
    assert list(sections) == [f"{title} (tiny): 64x64, 2 steps, float32 on cpu"
                              for title in FULLSIZE_FAMILIES.values()], done.stdout
    for (family, title), text in zip(FULLSIZE_FAMILIES.items(), sections.values(), strict=True):
        assert re.search(r"^built in \d+\.\d s on the device: [\d,.]+ M parameters", text, re.MULTILINE), text
        assert has_row(text, "eager"), f"{title}: no eager row\n{text}"
        assert has_row(text, "fast tier"), f"{title}: no fast tier row\n{text}"
        if family == "sd":  # the one family batched by default, in images a second
            assert has_row(text, "batch of 4, eager"), text
        else:
            assert re.search(r"^batch of 4, eager +skipped \(not in --batch-families\)$", text, re.MULTILINE)
        for way in ("compiled, full", "compiled, regional"):  # --tiny compiles nothing unless asked
            assert re.search(rf"^{way} +skipped \(not in --ways\)$", text, re.MULTILINE), text
        assert len(re.findall(r"^published, ", text, re.MULTILINE)) == {"sdxl": 2}.get(family, 1), text
    for source in ("alexeigor/sd-benchmarks", "stabilityai/stable-diffusion-xl-1.0-tensorrt",
                   "huggingface/flux-fast"):
        assert source in done.stdout, done.stdout
    figures = json.loads(figures_file.read_text())
    assert [each["family"] for each in figures["families"]] == list(FULLSIZE_FAMILIES)
    for each in figures["families"]:
        eager = next(row for row in each["rows"] if row["way"] == "eager")
        assert len(eager["bare_s"]) == len(eager["worker_s"]) == 2, eager
        assert min(eager["bare_s"] + eager["worker_s"]) > 0, eager
        assert each["parameters"] > 0 and each["side"] == 64 and each["steps"] == 2


# A guard against a hang: starting the peers side by side (Ray Serve alone takes about 20 s) is most of it.
@pytest.mark.timeout(300)
def test_peers_quick_runs_every_installed_peer_and_judges_the_goals(tmp_path: Path) -> None:
    plot = tmp_path / "peers.png"
    done = subprocess.run([sys.executable, "-m", "bench.peers", "--quick", "--plot", str(plot)],
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr[-5000:]
    peers = ["slotq", "slotq, one job at a time", "Ray Serve", "Celery"]
    for peer in peers:
        for job_class in ("interactive", "standard", "bulk"):
            figure = r"\d\.\d\d " if job_class == "interactive" else r"(\d\.\d\d |-$)"  # none may come
            row = rf"^ 0.9  {re.escape(peer)} +{job_class} +{figure}"
            assert re.search(row, done.stdout, re.MULTILINE), (peer, job_class, done.stdout)
    assert re.search(r"^lost \(admitted, never ended\): slotq 0, slotq, one job at a time 0, Ray Serve \d+, "
                     r"Celery \d+$", done.stdout, re.MULTILINE), done.stdout
    verdicts = re.findall(r"^(met|missed) +(slotq[^:]*): ", done.stdout, re.MULTILINE)
    # Two goals at 0.9 load and the lost jobs, for each slotq.
    assert [name for _, name in verdicts] == ["slotq"] * 3 + ["slotq, one job at a time"] * 3, done.stdout
    assert plot.read_bytes().startswith(b"\x89PNG"), done.stdout
