"""The store's Lua, read from ``lua/`` once: every change to the line is one of these scripts.

A script's first line may name the libraries it builds on (``-- uses: line estimates``), files of
``lua/lib/``; the loader puts each before the script once, after the libraries it uses itself.
Names both sides of Redis must agree on (key prefixes, the doorbell's size) are filled in from
``shared/contract/keys.py`` where the Lua writes ``@NAME@``. The scripts derive keys from those
prefixes, which suits one Redis (with replicas or Sentinel) but not Redis Cluster.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

from redis import Redis
from redis.client import Pipeline
from redis.commands.core import Script
from redis.exceptions import NoScriptError, ResponseError

from shared.contract import keys

LUA = Path(__file__).with_name("lua")
USES = re.compile(r"^-- uses:(.*)$", re.M)
CONSTANTS = {
    "LINE_PREFIX": keys.line_key(""),
    "INPUTS_PREFIX": keys.inputs_key(""),
    "LOG_PREFIX": keys.log_key(""),
    "CHECKPOINT_PREFIX": keys.checkpoint_key(""),
    "FENCE_PREFIX": keys.fence_key(""),
    "DRAIN_PREFIX": keys.drain_key(""),
    "HOLD_PREFIX": keys.hold_key(""),
    "CLAIMS_PREFIX": keys.claims_key(""),
    "LOG_LENGTH": str(keys.LOG_LENGTH),
    "SEP": keys.QUEUE_SEPARATOR,
    "RQ_QUEUE_PREFIX": keys.RQ_QUEUE_PREFIX,
    "RQ_QUEUES_KEY": keys.RQ_QUEUES_KEY,
    "DOORBELL_TOKENS": str(keys.DOORBELL_TOKENS),
    "LINES_SUFFIX": keys.LINES_SUFFIX,
    "END_COMMAND": "SLOTQ.END",  # a job's end inside fenced.lua, where EVALSHA cannot run
}


def _uses(path: Path) -> list[str]:
    found = USES.match(path.read_text())
    return found.group(1).split() if found else []


def _libraries(path: Path, into: list[str]) -> list[str]:
    """The libraries a file needs, each after its own, once."""
    for name in _uses(path):
        if name not in into:
            _libraries(LUA / "lib" / f"{name}.lua", into)
            into.append(name)
    return into


@cache
def source(name: str) -> str:
    """The whole text of one script, its libraries first, its constants filled in."""
    path = LUA / f"{name}.lua"
    parts = [(LUA / "lib" / f"{lib}.lua").read_text() for lib in _libraries(path, [])]
    text = "\n".join([*parts, path.read_text()])
    text = re.sub(r"@([A-Z_]+)@", lambda match: CONSTANTS[match.group(1)], text)
    return text


@cache
def sha(name: str) -> str:
    """The SHA1 that EVALSHA names the script by."""
    return hashlib.sha1(source(name).encode()).hexdigest()


_SCRIPTS: dict[str, Script] = {}


def run(client: Redis | Pipeline, name: str, keys: Sequence[str] = (), args: Sequence[Any] = ()) -> Any:
    """Run one script with EVALSHA (in a pipeline: queued, loaded first if Redis lacks it)."""
    # One Script per name, for every client: it only hashes each script's text once.
    # redis-py's Script sends through the client it is called with and loads itself on NOSCRIPT.
    script = _SCRIPTS.get(name)
    if script is None:
        script = _SCRIPTS[name] = client.register_script(source(name))
    return script(keys=list(keys), args=list(args), client=client)


class Sent:
    """A script call sent now and answered later: Redis runs it while this thread goes on with other
    work, and :meth:`reply` reads its answer (the worker's claim sent at an execution's last step,
    read after the decode). The call holds a connection of the pool of its own until then."""

    def __init__(self, client: Redis, name: str, keys: Sequence[str] = (), args: Sequence[Any] = ()) -> None:
        self._client, self._call = client, (name, list(keys), list(args))
        self._pool = client.connection_pool
        self._connection = self._pool.get_connection()
        try:
            self._connection.send_command("EVALSHA", sha(name), len(keys), *keys, *args)
        except BaseException:
            self._let_go(broken=True)
            raise

    def reply(self) -> Any:
        """The script's answer; a call Redis did not know the script for runs again, loading it."""
        try:
            answer = self._connection.read_response()
        except ResponseError as exc:  # an answer all the same: the connection is sound
            self._let_go(broken=False)
            if isinstance(exc, NoScriptError):  # nothing ran: Redis restarted or flushed its scripts
                return run(self._client, *self._call)
            raise
        except BaseException:
            self._let_go(broken=True)  # the answer may still be on its way: the connection goes
            raise
        self._let_go(broken=False)
        return answer

    def _let_go(self, broken: bool) -> None:
        if broken:
            self._connection.disconnect()
        self._pool.release(self._connection)
