"""Where image bytes live when not in Redis: a folder, or an S3-compatible bucket.

SLOTQ_RESULT_STORE chooses (``shared/store/results.py`` builds on these): ``file:///path`` is a
:class:`Folder` that the API and the worker share (a volume); ``s3://bucket/prefix`` a
:class:`Bucket` reached through boto3. Both hold named objects (``images/<job>/<attempt>/0.png``,
``inputs/<job>/image``) and give the same four operations: put (atomic: a reader sees the whole
object or none), get, delete, and list with each object's write time, which the sweep uses.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

from shared.contract.errors import StorageUnavailableError

TEMPORARY = ".partial-"  # a folder's object being written; never listed as an object


class Blobs(Protocol):
    """Named objects of bytes."""

    def put(self, name: str, data: bytes) -> None: ...
    def get(self, name: str) -> bytes | None: ...
    def delete(self, names: Iterable[str]) -> None: ...
    def listing(self) -> Iterator[tuple[str, float]]: ...
    def url(self, name: str, expires_s: int) -> str | None: ...
    def check(self) -> None: ...


class Folder:
    """Objects as files under a folder: written to a temporary name, then renamed into place."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _path(self, name: str) -> Path:
        return self.root / name

    def put(self, name: str, data: bytes) -> None:
        path = self._path(name)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f"{TEMPORARY}{secrets.token_hex(4)}-{path.name}")
            with partial.open("wb") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())  # on disk before it has its name: a crash leaves no torn file
            os.replace(partial, path)
        except OSError as exc:
            raise StorageUnavailableError(f"could not write {name} under {self.root}: {exc}") from exc

    def get(self, name: str) -> bytes | None:
        try:
            return self._path(name).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StorageUnavailableError(f"could not read {name} under {self.root}: {exc}") from exc

    def delete(self, names: Iterable[str]) -> None:
        for name in names:
            path = self._path(name)
            path.unlink(missing_ok=True)
            for parent in path.parents:  # empty folders go too, up to the root
                if parent == self.root or not parent.is_relative_to(self.root):
                    break
                try:
                    parent.rmdir()
                except OSError:
                    break  # not empty

    def listing(self) -> Iterator[tuple[str, float]]:
        """Every object with its write time; a partial write shows under its temporary name."""
        for folder, _, files in os.walk(self.root):
            for file in files:
                path = Path(folder) / file
                try:
                    written = path.stat().st_mtime
                except FileNotFoundError:
                    continue  # deleted meanwhile
                yield path.relative_to(self.root).as_posix(), written

    def url(self, name: str, expires_s: int) -> str | None:
        return None  # served through the API

    def check(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f"{TEMPORARY}ready"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise StorageUnavailableError(f"the result folder {self.root} is not writable: {exc}") from exc


class Bucket:
    """Objects in an S3-compatible bucket under a prefix. A PUT is atomic in S3 itself."""

    def __init__(self, client: Any, bucket: str, prefix: str) -> None:
        self.client, self.bucket, self.prefix = client, bucket, prefix.strip("/")

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _errors(self) -> tuple[type[BaseException], ...]:
        from botocore.exceptions import BotoCoreError, ClientError

        return BotoCoreError, ClientError

    def put(self, name: str, data: bytes) -> None:
        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(name), Body=data)
        except self._errors() as exc:
            raise StorageUnavailableError(f"could not write {name} to s3://{self.bucket}: {exc}") from exc

    def get(self, name: str) -> bytes | None:
        from botocore.exceptions import ClientError

        try:
            answer = self.client.get_object(Bucket=self.bucket, Key=self._key(name))
            return bytes(answer["Body"].read())
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise StorageUnavailableError(f"could not read {name} from s3://{self.bucket}: {exc}") from exc
        except self._errors() as exc:
            raise StorageUnavailableError(f"could not read {name} from s3://{self.bucket}: {exc}") from exc

    def delete(self, names: Iterable[str]) -> None:
        keys = [{"Key": self._key(name)} for name in names]
        for start in range(0, len(keys), 1000):  # DeleteObjects takes at most 1,000 keys
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys[start:start + 1000],
                                                                   "Quiet": True})

    def listing(self) -> Iterator[tuple[str, float]]:
        skip = len(self.prefix) + 1 if self.prefix else 0
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=f"{self.prefix}/" if self.prefix else "")
        for page in pages:
            for item in page.get("Contents", []):
                yield item["Key"][skip:], item["LastModified"].timestamp()

    def url(self, name: str, expires_s: int) -> str | None:
        return str(self.client.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": self._key(name)}, ExpiresIn=expires_s))

    def check(self) -> None:
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except self._errors() as exc:
            raise StorageUnavailableError(f"the bucket s3://{self.bucket} does not answer: {exc}") from exc
