"""ComfyUI's websocket, ``/ws?clientId=``: the messages of the prompts this client submitted, as
their jobs move (each job's event log, ``shared/store/events.py``).

On connecting a client gets ``status`` (its ``sid``: the clientId it gave, else a new one). Then, for
each of its prompts: ``execution_start``, ``execution_cached`` and ``executing`` for the nodes up to
the sampler when the job starts; ``progress`` for each step (those between two of the worker's
reports, SLOTQ_PROGRESS_INTERVAL_MS apart, together) and its live previews as ComfyUI's binary
frames; when it ends, ``executing`` for the nodes after the sampler, ``executed`` with each output
node's images, ``execution_success`` (or ``execution_error``, ``execution_interrupted``),
``executing`` with ``node: null`` and ``status``.
A socket follows the prompts of its tenant and clientId only: another tenant under the same clientId
gets nothing of them. It holds one of the process's stream slots (SLOTQ_MAX_STREAMS) while open.
"""

from __future__ import annotations

import base64
import json
import struct
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, cast

from flask import Response, request
from flask_sock import Sock
from redis import Redis
from simple_websocket import Server

from api import state
from api.compat.comfyui import prompts
from api.compat.comfyui.prompts import Prompt, Prompts
from api.compat.comfyui.views import bp, failure, interrupted, job_view, remaining, store
from api.slots import Taken
from shared.contract import keys
from shared.contract.errors import InvalidRequestError, TenantStreamShareError, TooManyStreamsError
from shared.contract.jobs import JobStatus, JobView
from shared.contract.tenants import Tenant
from shared.store.connection import text

LOOK_EVERY_S = 0.25  # how often a socket looks for its client's new prompts and their events
VIEW_EVERY_S = 5.0  # how often a prompt whose log says nothing new is looked up (its log may be gone)
PREVIEW_FRAME = struct.pack(">II", 1, 1)  # ComfyUI's binary event 1 (a preview image), format 1 (JPEG)
TERMINAL = {status.value for status in JobStatus if status.is_terminal}
sock = Sock()


@dataclass
class Followed:
    """A prompt a socket follows: the last entry of its job's log it read, the last step it told."""

    prompt: Prompt
    entry: str = "0-0"
    started: bool = False
    step: int = 0
    viewed: float = field(default_factory=time.monotonic)


@bp.before_request
def reserve() -> Response | None:
    """A socket takes a stream slot before the handshake; where none is free it is refused with
    the error's status, not upgraded."""
    if request.endpoint != "comfyui.websocket":
        return None
    caller = prompts.tenant_name(state.tenant()) or None
    taken = state.streams().slots.take(caller)
    if taken is Taken.OVER_SHARE:
        raise TenantStreamShareError(retry_after=2)
    if taken is Taken.FULL:
        raise TooManyStreamsError(retry_after=2)
    request.environ["slotq.comfyui.slot"] = caller
    return None


@sock.route("/ws", bp=bp)
def websocket(ws: Server) -> None:
    """Send this client's prompts' messages until it closes the socket or the process drains."""
    client_id = request.args.get("clientId") or uuid.uuid4().hex
    try:
        if len(client_id) > prompts.MAX_CLIENT_ID:
            raise InvalidRequestError(details=[{"loc": ["clientId"], "msg": "at most "
                                                f"{prompts.MAX_CLIENT_ID} characters"}])
        Follower(ws, state.tenant(), client_id, store()).run()
    finally:
        state.streams().slots.give(request.environ["slotq.comfyui.slot"])


class Follower:
    """One socket's loop over its client's prompts."""

    def __init__(self, ws: Server, tenant: Tenant | None, client_id: str, records: Prompts) -> None:
        self.ws, self.tenant, self.client_id, self.records = ws, tenant, client_id, records
        self.connection: Redis = records.connection
        self.followed: dict[str, Followed] = {}
        self.after = 0  # the last prompt number of the client's seen

    def run(self) -> None:
        self.send("status", {"status": {"exec_info": {"queue_remaining": remaining(self.tenant)}},
                             "sid": self.client_id})
        for prompt in self.records.of_client(self.tenant, self.client_id, 0):  # those that have not ended
            self.after = max(self.after, prompt.number)
            view = job_view(prompt.id, self.tenant)
            if view is not None and not view.status.is_terminal:
                self.followed[prompt.id] = Followed(prompt)
        waits = state.waits()
        while self.ws.connected and not waits.draining:
            for prompt in self.records.of_client(self.tenant, self.client_id, self.after):
                self.after = max(self.after, prompt.number)
                self.followed[prompt.id] = Followed(prompt)
            for followed in list(self.followed.values()):
                if self.read(followed):
                    del self.followed[followed.prompt.id]
            with waits.watching(*self.followed) as wake:
                wake.wait(LOOK_EVERY_S)

    def read(self, followed: Followed) -> bool:
        """Send what the prompt's job logged since the last read; whether it has ended."""
        entries = cast(list[tuple[bytes, dict[bytes, bytes]]],
                       self.connection.xrange(keys.log_key(followed.prompt.id), f"({followed.entry}", "+"))
        events = [text(fields[b"event"]) for _, fields in entries]
        last_preview = max((index for index, event in enumerate(events) if event == "preview"), default=-1)
        for index, ((entry_id, fields), event) in enumerate(zip(entries, events, strict=True)):
            followed.entry = text(entry_id)
            if event == "started" or (event == "progress" and not followed.started):
                self.started(followed)
            if event == "progress":
                self.progress(followed, json.loads(fields.get(b"data", b"{}") or b"{}") or {})
            if event == "preview" and index == last_preview:  # the picture is the latest: sent once
                self.preview(followed)
            if event in TERMINAL:
                return self.ended(followed)
        now = time.monotonic()
        if not entries and now - followed.viewed >= VIEW_EVERY_S:  # its log may be gone: its view says
            followed.viewed = now
            view = job_view(followed.prompt.id, self.tenant)
            if view is None or view.status.is_terminal:
                return self.ended(followed, view)
        return False

    def preview(self, followed: Followed) -> None:
        """The job's latest preview as ComfyUI's binary frame: event and format, then the JPEG."""
        stored = cast(bytes | None, self.connection.get(keys.preview_key(followed.prompt.id)))
        if stored is None:
            return  # the job has ended a while: its images say more
        image = str(json.loads(stored).get("image", ""))
        self.ws.send(PREVIEW_FRAME + base64.b64decode(image.partition(",")[2]))

    def progress(self, followed: Followed, progress: dict[str, Any]) -> None:
        """A ``progress`` for each step up to the one reported: the worker reports at most every
        SLOTQ_PROGRESS_INTERVAL_MS, so the steps between two reports are told together."""
        step, total = progress.get("step"), progress.get("total")
        if not isinstance(step, int) or not isinstance(total, int):
            return
        for value in range(followed.step + 1, step + 1):
            self.send("progress", {"value": value, "max": total, "prompt_id": followed.prompt.id,
                                   "node": followed.prompt.sampler})
        followed.step = max(followed.step, step)

    def started(self, followed: Followed) -> None:
        """The job started: its graph starts, and runs up to its sampler."""
        if followed.started:
            return
        followed.started = True
        prompt, now = followed.prompt, int(time.time() * 1000)
        self.send("execution_start", {"prompt_id": prompt.id, "timestamp": now})
        self.send("execution_cached", {"nodes": [], "prompt_id": prompt.id, "timestamp": now})
        for node in prompt.order[:prompt.order.index(prompt.sampler) + 1]:
            self.executing(prompt, node)

    def ended(self, followed: Followed, view: JobView | None = None) -> bool:
        """The job ended: the rest of the graph and its outputs, or its error; then ``node: null``."""
        prompt = followed.prompt
        view = view or job_view(prompt.id, self.tenant)
        now = int(time.time() * 1000)
        if view is not None and view.status is JobStatus.SUCCEEDED:
            self.started(followed)
            for node in prompt.order[prompt.order.index(prompt.sampler) + 1:]:
                self.executing(prompt, node)
                output = next((each for each in prompt.outputs if each.node == node), None)
                if output is not None:
                    self.send("executed", {"node": node, "display_node": node, "prompt_id": prompt.id,
                                           "output": {"images": prompt.images(output, len(view.images))}})
            self.send("execution_success", {"prompt_id": prompt.id, "timestamp": now})
        elif view is not None and view.status is JobStatus.CANCELED:
            self.send("execution_interrupted", interrupted(prompt, now))
        elif view is not None:
            self.send("execution_error", failure(prompt, view, now))
        self.executing(prompt, None)
        self.send("status", {"status": {"exec_info": {"queue_remaining": remaining(self.tenant)}}})
        return True

    def executing(self, prompt: Prompt, node: str | None) -> None:
        self.send("executing", {"node": node, "display_node": node, "prompt_id": prompt.id})

    def send(self, kind: str, data: dict[str, Any]) -> None:
        self.ws.send(json.dumps({"type": kind, "data": data}, separators=(",", ":")))

