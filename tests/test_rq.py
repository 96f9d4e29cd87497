"""worker/rq.py: the one adapter for RQ's private API still fits the installed RQ."""

from __future__ import annotations

from importlib.metadata import version

from packaging.requirements import Requirement
from packaging.version import Version

from worker.rq import check_rq


def test_the_installed_rq_is_in_the_range_pyproject_names() -> None:
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    (wanted,) = [Requirement(line) for line in project["dependencies"] if line.startswith("rq")]
    installed = Version(version("rq"))
    assert installed in wanted.specifier, f"RQ {installed} is outside pyproject's {wanted}"


def test_rq_still_has_the_private_api_the_worker_uses() -> None:
    # Fails with a message naming what RQ changed (a method gone, its parameters, a key name).
    check_rq()
