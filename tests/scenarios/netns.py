"""Separate "hosts" on one Linux machine, built from network namespaces, for tests across a network.

A :class:`Lab` is a bridge in the root namespace with the address 10.A.B.1/24 and, for each host, a
network namespace joined to the bridge by a veth pair: a host has its own loopback, its own ports
and its own address 10.A.B.n, and reaches the others only through the bridge, as machines on one
switch do. The test process stays in the root namespace and reaches every host at its address.
Each process also runs in a UTS namespace of its own whose host name is the host's, so that what a
process reports as its host (a worker's heartbeat) tells the hosts apart.

``host.cut()`` sets the root end of the host's veth down: its processes run on but can reach no one
and no one can reach them (a partition, not a crash); ``host.restore()`` mends it.

Needs root, ``ip`` (iproute2) and ``unshare`` (util-linux); :func:`require_network` skips a test
where they are missing, or fails it under ``SLOTQ_REQUIRE_NETNS=1`` so that CI cannot skip silently.
Names carry the owner's pid, so a lab left behind by a killed test run is removed by the next one.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

from shared.contract.settings import Settings
from slotq.harness import Process, slotq_env
from slotq.harness import wait_api as wait_api  # the harness's waits, as the scenarios import them
from slotq.harness import wait_workers as wait_workers
from slotq.localredis import is_reachable, redis_server_binary
from tests.conftest import wait_for

REQUIRE_ENV = "SLOTQ_REQUIRE_NETNS"
NAMESPACE_PREFIX = "slotq"  # namespaces: slotq-<pid>-<tag>-<host>
LINK_PREFIX = "sq"  # interfaces: sq<tag>br, sq<tag>v<n>; Linux allows 15 characters
STALE_NAMESPACE = re.compile(rf"^{NAMESPACE_PREFIX}-(\d+)-([0-9a-f]{{6}})-")
STALE_BRIDGE = re.compile(rf"^{NAMESPACE_PREFIX}-(\d+)-([0-9a-f]{{6}})$")  # the bridge's alias
HOST_NAME = re.compile(r"^[a-z][a-z0-9-]{0,30}$")
GRACE_S = 5.0
REDIS_PORT, SENTINEL_PORT, API_PORT, WORKER_METRICS_PORT = 6379, 26379, 8000, 9101


class LabError(RuntimeError):
    """The lab could not be built or taken down."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS``; with ``check``, a failure raises with ip's own message."""
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if check and result.returncode != 0:
        raise LabError(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")
    return result


def _forward_within(bridge: str, action: str) -> None:
    """Insert (``-I``) or delete (``-D``) the rule that lets traffic between the hosts of a bridge
    through iptables' FORWARD chain. Where br_netfilter is loaded (Docker loads it, and sets that
    chain's policy to DROP), bridged packets pass the chain: without the rule hosts cannot reach
    each other. Docker's own bridge has the same rule."""
    if shutil.which("iptables") is None:
        return  # no iptables, no filter on bridged traffic either
    rule = ["FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT"]
    done = subprocess.run(["iptables", "-w", action, *rule], capture_output=True, text=True, timeout=30)
    if done.returncode != 0 and action == "-I":
        raise LabError(f"`iptables -I {' '.join(rule)}` failed: {done.stderr.strip()}")


@cache
def network_available() -> str | None:
    """None when namespaces and veth pairs can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare", "hostname"):
        if shutil.which(tool) is None:
            return f"no `{tool}` on PATH"
    tag = secrets.token_hex(3)
    namespace, veth = f"{NAMESPACE_PREFIX}-{os.getpid()}-{tag}-probe", f"{LINK_PREFIX}{tag}v0"
    try:
        for args in (["netns", "add", namespace],
                     ["link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", namespace]):
            result = _ip(*args, check=False)
            if result.returncode != 0:
                return f"`ip {' '.join(args)}` failed: {result.stderr.strip()}"
    finally:
        _ip("link", "del", veth, check=False)
        _ip("netns", "del", namespace, check=False)
    return None


def require_network() -> None:
    """Skip the calling test when no lab can be built here; fail it instead under SLOTQ_REQUIRE_NETNS=1."""
    reason = network_available()
    if reason is None:
        return
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1, but no network namespaces here: {reason}", pytrace=False)
    pytest.skip(f"no network namespaces here: {reason}")


class Host:
    """One namespace on the lab's bridge: an address, the processes started there, a link to cut."""

    def __init__(self, lab: Lab, name: str, index: int) -> None:
        self.lab, self.name = lab, name
        self.ip = str(lab.subnet[index])
        self.namespace = f"{lab.prefix}-{name}"
        self.veth = f"{LINK_PREFIX}{lab.tag}v{index}"  # the root end; the host's end is its eth0
        self.dir = lab.root / name
        self.processes: list[Process] = []

    def build(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        _ip("netns", "add", self.namespace)
        _ip("link", "add", self.veth, "type", "veth", "peer", "name", "eth0", "netns", self.namespace)
        _ip("link", "set", self.veth, "master", self.lab.bridge)
        _ip("link", "set", self.veth, "up")
        _ip("-n", self.namespace, "addr", "add", f"{self.ip}/{self.lab.subnet.prefixlen}", "dev", "eth0")
        _ip("-n", self.namespace, "link", "set", "eth0", "up")
        _ip("-n", self.namespace, "link", "set", "lo", "up")

    def popen(self, args: Sequence[str], env: Mapping[str, str] | None = None,
              log_path: Path | None = None) -> Process:
        """Start ``args`` on this host with its output in ``log_path``; stopped at the lab's teardown."""
        log_path = log_path or self.dir / f"{Path(args[0]).name}-{len(self.processes)}.log"
        # ip, unshare and sh each exec the next, so the pid is the command's own. A session of its
        # own lets teardown signal the command's children too (gunicorn's workers).
        command = ["ip", "netns", "exec", self.namespace, "unshare", "--uts", "--",
                   "sh", "-c", 'hostname "$0" && exec "$@"', self.name, *args]
        with log_path.open("ab") as log:  # the child keeps its own copy of the descriptor
            popen = subprocess.Popen(command, env=None if env is None else dict(env),
                                     stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        process = Process(popen=popen, log=log_path)
        self.processes.append(process)
        return process

    def cut(self) -> None:
        """Partition the host: its processes run on, but no packet leaves or reaches it."""
        _ip("link", "set", self.veth, "down")

    def restore(self) -> None:
        """Mend the partition."""
        _ip("link", "set", self.veth, "up")

    def pids(self) -> list[int]:
        """Every process in the namespace, whoever started it."""
        result = _ip("netns", "pids", self.namespace, check=False)
        return [int(pid) for pid in result.stdout.split()]

    def remove(self) -> None:
        """Delete the veth pair (both ends go together) and the namespace; already gone is fine."""
        _ip("link", "del", self.veth, check=False)
        _ip("netns", "del", self.namespace, check=False)


class Lab:
    """A bridge and the hosts on it; a context manager that takes everything down on exit."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.tag = secrets.token_hex(3)
        self.prefix = f"{NAMESPACE_PREFIX}-{os.getpid()}-{self.tag}"
        self.bridge = f"{LINK_PREFIX}{self.tag}br"
        self.subnet = ipaddress.IPv4Network("10.0.0.0/24")  # until __enter__ picks a free one
        self.hosts: list[Host] = []
        self.entered = False

    @property
    def gateway(self) -> str:
        """The bridge's address: where the test process itself is seen from the hosts."""
        return str(self.subnet[1])

    def __enter__(self) -> Lab:
        sweep_stale()
        self.subnet = _free_subnet()
        self.entered = True
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "alias", self.prefix)  # for sweep_stale
            _ip("addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            _forward_within(self.bridge, "-I")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def host(self, name: str) -> Host:
        """A new host on the bridge, with the next free address."""
        if not self.entered:
            raise LabError("enter the lab (`with Lab(root) as lab:`) before adding hosts")
        if not HOST_NAME.match(name) or any(host.name == name for host in self.hosts):
            raise ValueError(f"host name {name!r} is taken or not a short lowercase name")
        if len(self.hosts) + 2 >= self.subnet.num_addresses - 1:
            raise LabError(f"no address left in {self.subnet}")
        host = Host(self, name, len(self.hosts) + 2)
        self.hosts.append(host)  # first: teardown must cover a half-built host
        host.build()
        return host

    def close(self) -> None:
        """Stop every process, then delete the hosts and the bridge, whatever failed before."""
        try:
            stop_processes([process for host in self.hosts for process in host.processes], GRACE_S)
            for host in self.hosts:  # what the test started in a host some other way
                _kill_pids(host.pids())
        finally:
            for host in self.hosts:
                host.remove()
            _forward_within(self.bridge, "-D")
            _ip("link", "del", self.bridge, check=False)
        left = [host.namespace for host in self.hosts if host.pids()] + _links_named(self.tag)
        if left:
            raise LabError(f"lab {self.tag} left behind: {left}")


def stop_processes(processes: Sequence[Process], grace: float) -> None:
    """SIGTERM each process's session, SIGKILL what is left after ``grace`` seconds, reap them all."""
    for process in processes:
        _signal_session(process, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for process in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.popen.wait(max(0.0, deadline - time.monotonic()))
    for process in processes:
        # Even when the leader is gone: gunicorn's workers may outlive a killed master.
        _signal_session(process, signal.SIGKILL)
        process.popen.wait(10)


def sweep_stale() -> None:
    """Remove the namespaces and links of labs whose test process is gone (a run killed outright)."""
    stale_tags: set[str] = set()
    for namespace in _ip("netns", "list", check=False).stdout.split("\n"):
        name = namespace.split(" ")[0]
        match = STALE_NAMESPACE.match(name)
        if match and not _alive(int(match[1])):
            _kill_pids([int(pid) for pid in _ip("netns", "pids", name, check=False).stdout.split()])
            _ip("netns", "del", name, check=False)
            stale_tags.add(match[2])
    for link in _links():
        match = STALE_BRIDGE.match(link.get("ifalias", ""))
        if match and not _alive(int(match[1])):
            stale_tags.add(match[2])
    for tag in stale_tags:
        for name in _links_named(tag):
            _ip("link", "del", name, check=False)


def _free_subnet() -> ipaddress.IPv4Network:
    """A random 10.A.B.0/24 that no route on this machine overlaps."""
    routes = json.loads(_ip("-j", "-4", "route", "show", "table", "all").stdout or "[]")
    taken = [ipaddress.ip_network(route["dst"], strict=False) for route in routes
             if route.get("dst") not in (None, "default")]
    for _ in range(200):
        candidate = ipaddress.IPv4Network(f"10.{random.randrange(1, 255)}.{random.randrange(256)}.0/24")
        if not any(candidate.overlaps(network) for network in taken):
            return candidate
    raise LabError("no free /24 in 10.0.0.0/8 on this machine")


def _links() -> list[dict[str, Any]]:
    links: list[dict[str, Any]] = json.loads(_ip("-j", "link", "show", check=False).stdout or "[]")
    return links


def _links_named(tag: str) -> list[str]:
    return [link["ifname"] for link in _links() if link["ifname"].startswith(f"{LINK_PREFIX}{tag}")]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_session(process: Process, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.popen.pid, signum)


def _kill_pids(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


# --- slotq's processes on a host --------------------------------------------------------------


def start_redis(host: Host, *args: str, port: int = REDIS_PORT) -> Process:
    """A redis-server on the host's address, RDB and AOF off; ``args`` first (a config file, --sentinel)."""
    data = host.dir / f"redis-{port}"
    data.mkdir(parents=True, exist_ok=True)
    persistence = [] if "--sentinel" in args else ["--save", "", "--appendonly", "no"]
    process = host.popen([redis_server_binary(), *args, "--port", str(port), "--bind", "0.0.0.0",
                          "--protected-mode", "no", *persistence, "--dir", str(data), "--daemonize", "no"],
                         log_path=host.dir / f"redis-{port}.log")
    process.url = f"redis://{host.ip}:{port}/0"

    def answers() -> bool:
        process.check_running(f"redis-server on {host.name}:{port}")
        return is_reachable(process.url, timeout=0.2)

    wait_for(answers, timeout=15, what=f"redis-server on {host.name}:{port}")
    return process


def start_api(host: Host, settings: Settings, port: int = API_PORT, **extra: Any) -> Process:
    """``slotq api`` (gunicorn) on all of the host's addresses; returns at once, see the harness's
    :func:`wait_api`."""
    env = slotq_env(settings, **extra)
    # A home of the host's own: several gunicorns on one machine must share nothing under ~, and
    # gunicorn 27 would put its control socket there (api/server.py turns it off; this holds anyway).
    env["HOME"] = str(host.dir)
    env.pop("XDG_RUNTIME_DIR", None)
    command = [sys.executable, "-m", "slotq.cli", "api", "--host", "0.0.0.0", "--port", str(port)]
    process = host.popen(command, env, host.dir / f"api-{port}.log")
    process.url = f"http://{host.ip}:{port}"
    return process


def start_worker(host: Host, settings: Settings, **extra: Any) -> Process:
    """``slotq worker`` named after the host; returns at once, see the harness's :func:`wait_workers`.

    The metrics port is the same on every host: each namespace has ports of its own.
    """
    extra = {"worker_name": host.name, "worker_metrics_host": "0.0.0.0", **extra}
    process = host.popen([sys.executable, "-m", "slotq.cli", "worker"], slotq_env(settings, **extra),
                         host.dir / "worker.log")
    port = extra.get("worker_metrics_port", settings.worker_metrics_port)
    process.url = f"http://{host.ip}:{port}" if port else ""
    return process
