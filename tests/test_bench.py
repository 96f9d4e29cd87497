"""The benchmarks run and print their tables (a smoke run: their figures are not asserted)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def run_bench(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_admission_bench_prints_both_views_against_their_baselines() -> None:
    out = run_bench("bench.admission", "--jobs", "40", "--clients", "4")
    for line in ("bare LPUSH (baseline)", "POST /v1/jobs refused (429)", "bare Flask + LPUSH (baseline)",
                 "POST /v1/jobs refused"):
        assert line in out, out
    assert "202x40" in out and "429x40" in out


def test_job_time_bench_runs_the_service_against_the_loop() -> None:
    out = run_bench("bench.job_time", "--jobs", "4", "--size", "64", "--steps", "1")
    assert "loop" in out.lower() and "service" in out.lower(), out
