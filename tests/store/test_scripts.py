"""shared/store/scripts.py: every Lua script assembles with its libraries and Redis compiles it."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

from redis import Redis

from shared.store import scripts

ROOT = Path(__file__).parents[2]
SCRIPTS = sorted(path.stem for path in scripts.LUA.glob("*.lua"))


def test_every_script_compiles_in_redis_with_its_libraries(redis: Redis) -> None:
    assert "admit" in SCRIPTS and "claim" in SCRIPTS
    for name in SCRIPTS:
        source = scripts.source(name)
        assert not re.search(r"@[A-Z_]+@", source), f"{name}.lua keeps a constant unfilled"
        assert redis.script_load(source), name  # a syntax error raises here


def test_a_library_comes_once_and_before_what_uses_it() -> None:
    admit = scripts.source("admit")
    assert admit.count("local function line_insert(") == 1  # admit uses line directly and via expiry
    assert admit.index("local function line_remove(") < admit.index("local function expire_due(")


def test_the_lua_files_ship_with_the_package() -> None:
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = package_data["shared"]
    for path in scripts.LUA.rglob("*.lua"):
        relative = path.relative_to(ROOT / "shared").as_posix()
        assert any(fnmatch.fnmatch(relative, pattern) for pattern in shipped), f"{relative} is not shipped"
