"""The one reader of a folder of named weights (shared/contract/folders.py): entries by name, read again
only when the folder's version changes, what is refused logged once; and the per-file parse cache.
The readers of each kind are tested in test_models_dir.py, test_adapters.py and test_untrusted_files.py."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from shared.contract.folders import NamedWeights, UnusableModelError, forget_parsed, parsed_once

log = logging.getLogger("tests.folders")


class Counted:
    """An entry reader: a ``*.w`` file is an entry named by its stem, ``bad*`` refused, ``odd*`` raises
    what a hostile file may; each call recorded."""

    def __init__(self) -> None:
        self.read: list[str] = []

    def __call__(self, path: Path) -> tuple[str, int] | None:
        self.read.append(path.name)
        if path.name.startswith("bad"):
            raise UnusableModelError(f"{path}: refused for a reason")
        if path.name.startswith("odd"):
            raise OSError("the disk said no")
        if path.suffix != ".w":
            return None
        return path.stem.split("@")[0], len(self.read)


def bump(path: Path) -> None:
    """A new mtime for the path, as a change would give it (a change within one tick of the clock may not)."""
    status = os.stat(path)
    os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns + 1_000_000))


@pytest.fixture
def reader() -> Counted:
    return Counted()


def test_the_entries_are_read_by_name_in_the_order_of_their_paths(tmp_path: Path, reader: Counted) -> None:
    for name in ("b.w", "a.w", "notes.txt"):
        (tmp_path / name).write_text("")
    listing = NamedWeights("SLOTQ_TEST_DIR", reader, log)
    assert listing.entries(tmp_path) == {"a": 1, "b": 2}
    assert reader.read == ["a.w", "b.w", "notes.txt"]
    assert listing.entries(None) == {} and listing.entries(tmp_path / "absent") == {}


def test_a_folder_is_read_again_only_when_its_version_changes(tmp_path: Path, reader: Counted) -> None:
    (tmp_path / "a.w").write_text("")
    listing = NamedWeights("SLOTQ_TEST_DIR", reader, log)
    first = listing.entries(tmp_path)
    assert listing.entries(tmp_path) is first and reader.read == ["a.w"]  # unchanged: not read again
    (tmp_path / "a.w").write_text("new weights")  # the file's own change is not the folder's
    assert listing.entries(tmp_path) is first and reader.read == ["a.w"]
    (tmp_path / "c.w").write_text("")
    bump(tmp_path)
    assert list(listing.entries(tmp_path)) == ["a", "c"] and reader.read == ["a.w", "a.w", "c.w"]
    listing.forget()
    assert list(listing.entries(tmp_path)) == ["a", "c"] and len(reader.read) == 5


def test_a_path_named_also_counts_in_the_version(tmp_path: Path, reader: Counted) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.w").write_text("")
    watching, blind = NamedWeights("SLOTQ_TEST_DIR", reader, log, also=("sub",)), Counted()
    plain = NamedWeights("SLOTQ_TEST_DIR", blind, log)
    watching.entries(tmp_path), plain.entries(tmp_path)
    bump(tmp_path / "sub")  # a file written into it later: the folder's own mtime stays
    watching.entries(tmp_path), plain.entries(tmp_path)
    assert reader.read.count("a.w") == 2 and blind.read.count("a.w") == 1


def test_what_is_refused_is_logged_once_per_version_and_takes_nothing_else_off(
        tmp_path: Path, reader: Counted, caplog: pytest.LogCaptureFixture) -> None:
    for name in ("a.w", "bad.w", "odd.w", "z.w", "z@again.w"):
        (tmp_path / name).write_text("")
    listing = NamedWeights("SLOTQ_TEST_DIR", reader, log)
    with caplog.at_level(logging.WARNING, log.name):
        assert list(listing.entries(tmp_path)) == ["a", "z"]
        assert list(listing.entries(tmp_path)) == ["a", "z"]
    assert [record.name for record in caplog.records] == [log.name] * 3  # the caller's logger
    assert [record.getMessage() for record in caplog.records] == [
        f"SLOTQ_TEST_DIR: not offered: {tmp_path / 'bad.w'}: refused for a reason",
        f"SLOTQ_TEST_DIR: not offered: {tmp_path / 'odd.w'}: the disk said no",
        f"SLOTQ_TEST_DIR: not offered: {tmp_path / 'z@again.w'}: {tmp_path / 'z.w'} is offered under that "
        f"name already",
    ]
    caplog.clear()
    bump(tmp_path)
    with caplog.at_level(logging.WARNING, log.name):
        listing.entries(tmp_path)
    assert len(caplog.records) == 3  # a new version: said again


def test_a_file_is_parsed_once_per_version_its_refusal_included(tmp_path: Path) -> None:
    forget_parsed()
    calls: list[str] = []

    def parse(path: Path, suffix: str) -> str:
        calls.append(path.name)
        text = path.read_text()
        if text == "bad":
            raise UnusableModelError(f"{path}: bad")
        return text + suffix

    good, bad = tmp_path / "good", tmp_path / "bad"
    good.write_text("one")
    bad.write_text("bad")
    assert parsed_once(good, parse, "!") == parsed_once(good, parse, "!") == "one!"
    assert parsed_once(good, parse, "?") == "one?"  # with something else: another reading
    for _ in range(2):
        with pytest.raises(UnusableModelError, match="bad: bad"):
            parsed_once(bad, parse, "!")
    assert calls == ["good", "good", "bad"]
    good.write_text("two")  # another version: another size
    assert parsed_once(good, parse, "!") == "two!" and calls[-1] == "good" and len(calls) == 4
    forget_parsed()
    assert parsed_once(good, parse, "!") == "two!" and len(calls) == 5
