"""The docs: the MkDocs site builds with no broken link, and the README stays a short front door."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 210  # the front door; the reference lives in docs/


def test_docs_build_strict(tmp_path: Path) -> None:
    # --strict turns every warning (a broken link or anchor, a page missing from nav) into a failure.
    # NO_MKDOCS_2_WARNING: Material's end-of-life banner is noise in a test's output.
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=110,
    )
    assert built.returncode == 0, built.stderr


def test_readme_is_short_and_links_to_docs() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= README_MAX_LINES
    assert "](docs/" in readme


def test_every_setting_is_documented_and_in_the_example_env() -> None:
    from shared.contract.settings import Settings

    reference = (ROOT / "docs" / "settings.md").read_text()
    example = (ROOT / ".env.example").read_text()
    names = [f"SLOTQ_{name.upper()}" for name in Settings.model_fields]
    assert [name for name in names if f"`{name}`" not in reference] == []
    assert [name for name in names if not re.search(rf"^#? ?{name}=", example, re.M)] == []


def test_every_page_is_linked_from_the_index_and_the_readme() -> None:
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    pages = sorted(path.name for path in (ROOT / "docs").glob("*.md") if path.name != "index.md")
    assert [page for page in pages if f"]({page}" not in index] == []
    assert [page for page in pages if f"](docs/{page}" not in readme] == []


def code_map_sections() -> dict[str, str]:
    """The README's code map, by the folder each part heads (``worker/``, ``shared/contract/``)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = readme.split("## Code map", 1)[1].split("```", 2)[1]
    sections: dict[str, str] = {}
    header = ""
    for line in block.splitlines():
        if line and not line[0].isspace():
            header = line.split()[0]
            sections[header] = line[len(header):]
        elif header:
            sections[header] += "\n" + line
    return sections


def test_the_code_map_names_every_module() -> None:
    sections = code_map_sections()
    missing = []
    for path in sorted(ROOT.glob("*/**/*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative.split("/")[0] not in ("api", "worker", "shared", "slotq") or path.name == "__init__.py":
            continue
        header = max((name for name in sections if relative.startswith(name)), key=len, default=None)
        if header is None:
            missing.append(relative)
            continue
        rest = relative.removeprefix(header)
        named = rest.split("/")[0] + "/" if "/" in rest else rest
        if named not in sections[header]:
            missing.append(relative)
    assert missing == []
