"""What the ComfyUI surface keeps beside each job, in Redis under ``slotq:comfyui:``: a prompt's graph
and the nodes it maps to (for ``/history``, ``/queue`` and the websocket), each tenant's prompts and
each client's (``client_id``) in submission order, the images a caller uploaded, and the names its
outputs are served under.

A prompt is a slotq job (its ``prompt_id`` is the job's id); these records only remember how the
caller asked for it. They are written after the job is admitted, so a refused prompt leaves nothing,
and they expire with the job's record (SLOTQ_RECORD_TTL_S). Each index keeps a tenant's newest
``MAX_LISTED`` entries, so no caller grows them without bound.

An output's file name carries a random token of its prompt (``ComfyUI_<token>_00001_.png``): Open
WebUI fetches ``/view`` without the key it sends elsewhere, so the name is the capability, as a
presigned URL is. It is never listed to anyone but the prompt's tenant.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from dataclasses import asdict, dataclass, field
from typing import Any, cast

from redis import Redis

from api.compat.comfyui.graph import Output
from shared.contract.tenants import Tenant

PREFIX = "slotq:comfyui"
MAX_LISTED = 1000  # a tenant's prompts, a client's, a tenant's uploads: the newest this many
MAX_CLIENT_ID = 128  # the longest client_id a caller may send (ComfyUI's are UUIDs)
OUTPUT_NAME = re.compile(r"(?P<prefix>.*)_(?P<token>[0-9a-f]{32})_(?P<number>[0-9]{5})_\.png")


@dataclass(frozen=True)
class Prompt:
    """A prompt as the caller sent it, and the nodes its job runs as."""

    id: str
    number: int
    tenant: str
    client_id: str
    graph: dict[str, Any]
    extra_data: dict[str, Any]
    order: list[str]  # the nodes it runs, dependencies first
    sampler: str  # the node whose steps its progress counts
    outputs: list[Output]
    token: str = field(default_factory=lambda: secrets.token_hex(16))

    def class_of(self, node: str) -> str:
        return str(self.graph.get(node, {}).get("class_type", ""))

    def file_name(self, output: Output, index: int) -> str:
        """The name the job's image ``index`` is served under at this output node."""
        prefix = output.filename_prefix.rsplit("/", 1)[-1] or "ComfyUI"
        return f"{prefix}_{self.token}_{index + 1:05}_.png"

    def images(self, output: Output, count: int) -> list[dict[str, str]]:
        """The output's images in ComfyUI's shape, for a job that made ``count``."""
        return [{"filename": self.file_name(output, index), "subfolder": "", "type": output.type}
                for index in range(count)]

    def queue_item(self) -> list[Any]:
        """The prompt as ComfyUI lists it in ``/queue`` and ``/history``: number, id, graph, extra
        data, the output nodes to execute."""
        return [self.number, self.id, self.graph, self.extra_data, [output.node for output in self.outputs]]

    @classmethod
    def from_json(cls, data: bytes) -> Prompt:
        fields = json.loads(data)
        fields["outputs"] = [Output(**each) for each in fields["outputs"]]
        return cls(**fields)


def tenant_name(tenant: Tenant | None) -> str:
    """The tenant's name in these keys; '' for an open service's one caller."""
    return tenant.name if tenant else ""


class Prompts:
    """The surface's records of one queue's Redis."""

    def __init__(self, connection: Redis, ttl_s: int) -> None:
        self.connection, self.ttl_s = connection, ttl_s

    def number(self) -> int:
        """The next prompt's number (ComfyUI numbers its queue; slotq's order is its own)."""
        return int(self.connection.incr(f"{PREFIX}:number"))

    def save(self, prompt: Prompt) -> None:
        """Remember an admitted prompt, in its tenant's list and its client's."""
        tenant, client = self._tenant_key(prompt.tenant), self._client_key(prompt.tenant, prompt.client_id)
        with self.connection.pipeline() as pipe:
            pipe.set(self._key(prompt.id), json.dumps(asdict(prompt), separators=(",", ":")), ex=self.ttl_s)
            pipe.set(self._file_key(prompt.token), prompt.id, ex=self.ttl_s)
            for index in (tenant, client):
                pipe.zadd(index, {prompt.id: prompt.number})
                pipe.zremrangebyrank(index, 0, -MAX_LISTED - 1)
                pipe.expire(index, self.ttl_s)
            pipe.execute()

    def get(self, prompt_id: str, tenant: Tenant | None) -> Prompt | None:
        """The tenant's prompt with this id; None for any other (another tenant's reads as unknown)."""
        return _owned(cast(bytes | None, self.connection.get(self._key(prompt_id))), tenant)

    def listed(self, tenant: Tenant | None, newest: int | None = None) -> list[Prompt]:
        """The tenant's prompts, oldest first (the newest ``newest`` of them where given)."""
        index = self._tenant_key(tenant_name(tenant))
        ids = cast(list[bytes], self.connection.zrange(index, -newest if newest else 0, -1))
        return self._prompts(index, ids, tenant)

    def of_client(self, tenant: Tenant | None, client_id: str, after: int) -> list[Prompt]:
        """The client's prompts numbered after ``after``, oldest first."""
        index = self._client_key(tenant_name(tenant), client_id)
        ids = cast(list[bytes], self.connection.zrangebyscore(index, f"({after}", "+inf"))
        return self._prompts(index, ids, tenant)

    def ended(self, prompts: list[Prompt]) -> dict[str, dict[str, Any]]:
        """The history entries kept of these prompts (those that have ended and been read), by id."""
        if not prompts:
            return {}
        raw = cast(list[bytes | None], self.connection.mget([self._ended_key(each.id) for each in prompts]))
        return {prompt.id: json.loads(data) for prompt, data in zip(prompts, raw, strict=True) if data}

    def keep_ended(self, prompt: Prompt, entry: dict[str, Any]) -> None:
        """Keep an ended prompt's history entry, which no longer changes: ``/history``, which clients
        poll, reads it in one round trip with the others."""
        data = json.dumps(entry, separators=(",", ":"))
        self.connection.set(self._ended_key(prompt.id), data, ex=self.ttl_s)

    def forget(self, prompt: Prompt) -> None:
        """Take a prompt out of the history (``POST /history``); its job, and its images, stay."""
        with self.connection.pipeline() as pipe:
            pipe.delete(self._key(prompt.id), self._ended_key(prompt.id))
            pipe.zrem(self._tenant_key(prompt.tenant), prompt.id)
            pipe.execute()

    def by_file(self, name: str) -> tuple[Prompt, int] | None:
        """The prompt whose output is served under this file name, and the image's index; None for a
        name no prompt has."""
        match = OUTPUT_NAME.fullmatch(name)
        if match is None:
            return None
        prompt_id = cast(bytes | None, self.connection.get(self._file_key(match["token"])))
        data = cast(bytes | None, self.connection.get(self._key(prompt_id.decode()))) if prompt_id else None
        if data is None:
            return None
        prompt = Prompt.from_json(data)
        if not secrets.compare_digest(prompt.token, match["token"]):
            return None
        return prompt, int(match["number"]) - 1

    # --- uploads ------------------------------------------------------------------------------------

    def upload(self, tenant: Tenant | None, name: str, data: bytes, overwrite: bool) -> str:
        """Keep an uploaded image under ``name`` (a free name like ComfyUI's, "photo (1).png", where
        one is taken and ``overwrite`` is off); the name it has."""
        owner = tenant_name(tenant)
        index = f"{PREFIX}:uploads:{_hashed(owner)}"
        stem, dot, suffix = name.rpartition(".") if "." in name else (name, "", "")
        chosen, count = name, 1
        while not overwrite and self.connection.exists(self._upload_key(owner, chosen)):
            chosen, count = f"{stem} ({count}){dot}{suffix}", count + 1
        dropped = cast(list[bytes], self.connection.zrange(index, 0, -MAX_LISTED))
        with self.connection.pipeline() as pipe:
            pipe.set(self._upload_key(owner, chosen), data, ex=self.ttl_s)
            pipe.zadd(index, {chosen: self.connection.time()[0]})
            for old in dropped:  # beyond the newest MAX_LISTED: the oldest go
                pipe.delete(self._upload_key(owner, old.decode()))
                pipe.zrem(index, old)
            pipe.expire(index, self.ttl_s)
            pipe.execute()
        return chosen

    def uploaded(self, tenant: Tenant | None, name: str) -> bytes | None:
        """An image the tenant uploaded under this name; None where it has none."""
        return cast(bytes | None, self.connection.get(self._upload_key(tenant_name(tenant), name)))

    # --- keys -----------------------------------------------------------------------------------------

    def many(self, ids: list[str], tenant: Tenant | None) -> list[Prompt | None]:
        """The tenant's prompts with these ids, in one round trip; None for each it has not."""
        if not ids:
            return []
        raw = cast(list[bytes | None], self.connection.mget([self._key(each) for each in ids]))
        return [_owned(data, tenant) for data in raw]

    def _prompts(self, index: str, ids: list[bytes], tenant: Tenant | None) -> list[Prompt]:
        found = self.many([each.decode() for each in ids], tenant)
        gone = [each for each, prompt in zip(ids, found, strict=True) if prompt is None]
        if gone:  # expired or forgotten: the index lets go of them
            self.connection.zrem(index, *gone)
        return [prompt for prompt in found if prompt is not None]

    @staticmethod
    def _key(prompt_id: str) -> str:
        return f"{PREFIX}:prompt:{prompt_id}"

    @staticmethod
    def _ended_key(prompt_id: str) -> str:
        return f"{PREFIX}:ended:{prompt_id}"

    @staticmethod
    def _file_key(token: str) -> str:
        return f"{PREFIX}:file:{token}"

    @staticmethod
    def _tenant_key(tenant: str) -> str:
        return f"{PREFIX}:prompts:{_hashed(tenant)}"

    @staticmethod
    def _client_key(tenant: str, client_id: str) -> str:
        return f"{PREFIX}:client:{_hashed(tenant)}:{_hashed(client_id)}"

    @staticmethod
    def _upload_key(tenant: str, name: str) -> str:
        return f"{PREFIX}:upload:{_hashed(tenant)}:{_hashed(name)}"


def _owned(data: bytes | None, tenant: Tenant | None) -> Prompt | None:
    """A prompt's record, if it is this tenant's."""
    if data is None:
        return None
    prompt = Prompt.from_json(data)
    return prompt if prompt.tenant == tenant_name(tenant) else None


def _hashed(name: str) -> str:
    """A caller's name or a client's id in a key: fixed length, whatever it holds."""
    return hashlib.sha256(name.encode()).hexdigest()[:32]
