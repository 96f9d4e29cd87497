"""Folders of named weights (models, LoRA adapters, ControlNets, IP-Adapters): one reader of their
entries by name, read again only when a folder changes, and one cache of what was parsed of a file.

Each kind of weights gives its own reader of one entry of its folder: what counts as one of its kind,
under which name. The entries come from outside: one refused (UnusableModelError, or whatever reading a
hostile file raises) takes nothing but itself off the list, with one line in the log per version of
its folder, never an error of the listing.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Generic, TypeVar, cast

from pydantic import ValidationError

T = TypeVar("T")
EntryReader = Callable[[Path], tuple[str, T] | None]  # an entry's name and value; None: no entry of this kind

# What reading one hostile file can raise (UnicodeDecodeError is a ValueError; a seek past 2**63 an
# OverflowError): each makes that file not offered, never an error of the listing.
FILE_ERRORS = (OSError, ValueError, TypeError, OverflowError, RecursionError, MemoryError, struct.error)


class UnusableModelError(ValueError):
    """A file or folder of a folder of weights that is not offered, and why."""


def shown(value: object) -> str:
    """A value from a file, as a log line shows it: a name may be megabytes long."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:80] + "..."


def folder_version(folder: Path, also: Sequence[str] = ()) -> tuple[int, ...] | None:
    """The folder's version: its mtime and those of the named paths in it (0 for one absent); None
    where the folder cannot be read."""
    try:
        version = [os.stat(folder).st_mtime_ns]  # an entry added or removed changes the folder's mtime
    except OSError:
        return None
    for name in also:
        try:
            version.append(os.stat(folder / name).st_mtime_ns)
        except OSError:
            version.append(0)
    return tuple(version)


class NamedWeights(Generic[T]):
    """The entries of one kind of folder by name, in the order of their paths, each folder read again
    only when its version changes; what is refused logged under the folder's setting."""

    def __init__(self, setting: str, entry_of: EntryReader[T], log: logging.Logger,
                 also: Sequence[str] = ()) -> None:
        # also: paths in the folder whose files may change after it (an image encoder's subfolder)
        self.setting, self.entry_of, self.log, self.also = setting, entry_of, log, tuple(also)
        self._listed: dict[Path, tuple[tuple[int, ...], dict[str, T]]] = {}

    def entries(self, folder: Path | None) -> dict[str, T]:
        """The folder's entries by name; none for no folder or one that cannot be read."""
        if folder is None:
            return {}
        version = folder_version(folder, self.also)
        if version is None:
            return {}
        cached = self._listed.get(folder)
        if cached is None or cached[0] != version:
            cached = self._listed[folder] = (version, self._read(folder))
        return cached[1]

    def forget(self) -> None:
        """Read every folder again at its next use: a change within one tick of the file system's clock
        leaves a folder's mtime as it was."""
        self._listed.clear()

    def _read(self, folder: Path) -> dict[str, T]:
        """Every entry of the folder by name; the first of two of one name kept."""
        found: dict[str, tuple[Path, T]] = {}
        for path in sorted(folder.iterdir()):
            entry = self._entry(path)
            if entry is None:
                continue
            name, value = entry
            if name in found:
                self.log.warning("%s: not offered: %s: %s is offered under that name already",
                                 self.setting, path, found[name][0])
                continue
            found[name] = (path, value)
        return {name: value for name, (_, value) in found.items()}

    def _entry(self, path: Path) -> tuple[str, T] | None:
        """The entry's name and value; None for no entry of this kind and for one refused, logged."""
        try:
            return self.entry_of(path)
        except UnusableModelError as exc:
            self.log.warning("%s: not offered: %s", self.setting, exc)
        except (ValidationError, *FILE_ERRORS) as exc:
            # One file from outside, whatever it holds, takes nothing but itself off the list.
            reason = shown(str(exc) or type(exc).__name__)
            self.log.warning("%s: not offered: %s: %s", self.setting, path, reason)
        return None


# What was read of a file, by what read it and with what else, for the file's version: its mtime, size
# and inode. A header of 100 MB takes seconds to parse: once, not at each change of its folder.
_parsed: dict[tuple[object, ...], tuple[tuple[int, int, int], object]] = {}


def parsed_once(path: Path, read: Callable[..., T], *also: object) -> T:
    """``read(path, *also)``, a refusal (UnusableModelError) included, once per version of the file."""
    status = os.stat(path)
    version = (status.st_mtime_ns, status.st_size, status.st_ino)
    key = (read.__name__, path, *also)
    cached = _parsed.get(key)
    if cached is None or cached[0] != version:
        try:
            value: object = read(path, *also)
        except UnusableModelError as exc:
            value = exc
        cached = _parsed[key] = (version, value)
    if isinstance(cached[1], UnusableModelError):
        raise UnusableModelError(str(cached[1]))
    return cast(T, cached[1])


def forget_parsed() -> None:
    """Parse every file again at its next use: a version may come back within one tick of the clock."""
    _parsed.clear()
