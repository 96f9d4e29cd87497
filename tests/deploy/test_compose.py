"""Static checks of the container deployment: docker-compose.yml, Dockerfiles, nginx.conf."""

import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from shared.contract.settings import Settings
from tests.deploy import engine

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
NGINX_CONF = ROOT / "docker" / "nginx.conf"
API_DOCKERFILE = ROOT / "docker" / "api.Dockerfile"
WORKER_DOCKERFILE = ROOT / "docker" / "worker.Dockerfile"
ENV_EXAMPLE = ROOT / ".env.example"
PROMETHEUS_DIR = ROOT / "docker" / "prometheus"
PROMETHEUS_CONF = PROMETHEUS_DIR / "prometheus.yml"
GRAFANA_DIR = ROOT / "docker" / "grafana"
METRICS_SOURCES = [ROOT / "api" / "metrics.py", ROOT / "worker" / "metrics.py"]

DEFAULT_SERVICES = {"redis", "api", "proxy", "worker"}
MONITORING_SERVICES = {"prometheus", "grafana", "rq-dashboard"}
# One GPU serving a folder of models: its worker, in a profile of its own.
FOLDER_WORKER = "worker-folder"
DOCKERIGNORE = ROOT / ".dockerignore"

# What api/metrics.py and worker/metrics.py export, under the names Prometheus stores.
_COUNTERS = ["slotq_admissions", "slotq_jobs_ended", "slotq_worker_jobs", "slotq_gpu_busy_seconds"]
_HISTOGRAMS = [
    "slotq_http_request_duration_seconds",
    "slotq_job_queue_wait_seconds",
    "slotq_gpu_section_seconds",
    "slotq_job_duration_seconds",
]
_GAUGES = [
    "slotq_queue_depth",
    "slotq_queue_limit",
    "slotq_worker_duty_cycle",
    "slotq_worker_info",
    "slotq_cuda_memory_allocated_bytes",
    "slotq_cuda_memory_peak_bytes",
    "slotq_cuda_memory_reserved_bytes",
]
EXPORTED_METRICS = frozenset(
    [f"{name}_total" for name in _COUNTERS]
    + [f"{name}_{suffix}" for name in _HISTOGRAMS for suffix in ("bucket", "sum", "count")]
    + _GAUGES
)

# Default of SLOTQ_JOB_TIMEOUT_S: the longest a job may run.
DEFAULT_JOB_TIMEOUT_S = 900

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(us|ms|s|m|h)")
_DURATION_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


@functools.cache
def _compose() -> dict[str, Any]:
    """Return docker-compose.yml parsed as YAML."""
    data = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(data, dict), "docker-compose.yml is not a mapping"
    return data


def _service(name: str) -> dict[str, Any]:
    """Return one service definition from the compose file."""
    services = _compose().get("services") or {}
    assert name in services, f"service {name!r} missing from docker-compose.yml"
    return services[name]


def _environment(service: dict[str, Any]) -> dict[str, str]:
    """Return a service's `environment`, list or mapping form, as a dict."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        return dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {key: "" if value is None else str(value) for key, value in env.items()}


def _depends_on(service: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Return a service's `depends_on`, list or mapping form, as a dict."""
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return {name: {"condition": "service_started"} for name in deps}
    return {name: spec or {} for name, spec in deps.items()}


def _mounts(service: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """Return a service's volumes as (source, target, read_only) tuples, a source as written
    (`${VAR:-default}` uninterpolated)."""
    mounts = []
    for volume in service.get("volumes") or []:
        if isinstance(volume, dict):
            mounts.append((str(volume.get("source", "")), volume["target"], bool(volume.get("read_only"))))
            continue
        parts = re.split(r":(?![^{]*\})", volume)  # not the colon of a ${VAR:-default}
        source, target = (parts[0], parts[1]) if len(parts) > 1 else ("", parts[0])
        mode = parts[2] if len(parts) > 2 else ""
        mounts.append((source, target, "ro" in mode.split(",")))
    return mounts


def _interpolated(text: str) -> str:
    """Return a compose value as Compose reads it with no such variable set (no .env, no shell
    variable): `${VAR:-default}` and `${VAR-default}` give their default, `${VAR}` nothing."""
    return re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*(?::?-([^}]*))?\}", lambda found: found[1] or "", text)


def _extended(name: str) -> dict[str, Any]:
    """Return a service as `extends` makes it from its base service in this file: its environment
    and its volumes (by target) over the base's, its other keys in place of the base's."""
    service = _service(name)
    if "extends" not in service:
        return service
    assert set(service["extends"]) == {"service"}, "extends from another file is not read here"
    base = _extended(service["extends"]["service"])
    volumes = {}
    for each in (base, service):
        entries = each.get("volumes") or []
        volumes |= {target: volume for volume, (_, target, _) in zip(entries, _mounts(each), strict=True)}
    return {**base, **service, "environment": _environment(base) | _environment(service),
            "volumes": list(volumes.values())}


def _settings_from(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """Return the settings a process reads from this environment alone (raises on a bad value)."""
    for key in [key for key in os.environ if key.startswith("SLOTQ_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return Settings()


def _port_targets(service: dict[str, Any]) -> list[int]:
    """Return the container ports that a service publishes on the host."""
    targets = []
    for port in service.get("ports") or []:
        if isinstance(port, dict):
            targets.append(int(port["target"]))
        else:
            targets.append(int(str(port).rsplit(":", 1)[-1].split("/")[0]))
    return targets


def _parse_duration(value: str | int | float) -> float:
    """Return a compose duration such as 15m, 1m30s or 900s in seconds."""
    if isinstance(value, int | float):
        return float(value)
    text = value.strip()
    parts = _DURATION_PART.findall(text)
    if not parts or "".join(number + unit for number, unit in parts) != text:
        raise ValueError(f"not a compose duration: {value!r}")
    return sum(float(number) * _DURATION_UNITS[unit] for number, unit in parts)


def _instructions(path: Path) -> list[tuple[str, str]]:
    """Return a Dockerfile's (INSTRUCTION, arguments) pairs, continuations joined."""
    result: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, arguments = (pending + line).partition(" ")
        result.append((keyword.upper(), arguments.strip()))
        pending = ""
    assert not pending, f"{path.name} ends inside a line continuation"
    return result


def _base_image(path: Path) -> str:
    """Return the image of a Dockerfile's last FROM, with ARG defaults substituted."""
    args: dict[str, str] = {}
    image = ""
    for keyword, arguments in _instructions(path):
        if keyword == "ARG" and "=" in arguments:
            name, _, default = arguments.partition("=")
            args[name.strip()] = default.strip().strip("\"'")
        elif keyword == "FROM":
            image = arguments.split()[0]
            for name, default in args.items():
                image = image.replace("${" + name + "}", default).replace("$" + name, default)
    return image


def _run_text(path: Path) -> str:
    """Return all RUN commands of a Dockerfile as one string."""
    return "\n".join(args for keyword, args in _instructions(path) if keyword == "RUN")


def _pip_extras(path: Path) -> set[str]:
    """Return the extras of the local project (`.[x,y]`) that a Dockerfile pip-installs."""
    extras: set[str] = set()
    for match in re.finditer(r"pip install[^&;|]*?[\"']?\.\[([^\]]*)\]", _run_text(path)):
        extras.update(extra.strip() for extra in match.group(1).split(","))
    return extras


def _copy_sources(path: Path) -> list[str]:
    """Return the build-context sources of a Dockerfile's COPY/ADD instructions."""
    sources: list[str] = []
    for keyword, arguments in _instructions(path):
        if keyword not in {"COPY", "ADD"}:
            continue
        words = json.loads(arguments) if arguments.startswith("[") else shlex.split(arguments)
        if any(word.startswith("--from") for word in words):
            continue
        sources.extend(word for word in words[:-1] if not word.startswith("--"))
    return sources


def _env_instructions(path: Path) -> dict[str, str]:
    """Return the variables set by a Dockerfile's ENV instructions."""
    env: dict[str, str] = {}
    for keyword, arguments in _instructions(path):
        if keyword == "ENV":
            for word in shlex.split(arguments):
                name, _, value = word.partition("=")
                env[name] = value
    return env


def _last(path: Path, instruction: str) -> str:
    """Return the arguments of the last given instruction of a Dockerfile."""
    found = [args for keyword, args in _instructions(path) if keyword == instruction]
    assert found, f"{path.name} has no {instruction}"
    return found[-1]


def _strings(node: object) -> list[str]:
    """Return every string key and value in a parsed YAML tree."""
    if isinstance(node, dict):
        return [s for key, value in node.items() for s in [*_strings(key), *_strings(value)]]
    if isinstance(node, list):
        return [s for item in node for s in _strings(item)]
    return [node] if isinstance(node, str) else []


def _exposed_ports(service: dict[str, Any]) -> set[int]:
    """Return the container ports a service offers to the compose network (`expose` and `ports`)."""
    exposed = {int(str(port).split("/")[0]) for port in service.get("expose") or []}
    return exposed | set(_port_targets(service))


def _host_ips(service: dict[str, Any]) -> list[str]:
    """Return the host address each published port of a service binds (empty: all addresses)."""
    hosts = []
    for port in service.get("ports") or []:
        if isinstance(port, dict):
            hosts.append(str(port.get("host_ip", "")))
        else:
            parts = _interpolated(str(port)).split(":")
            hosts.append(parts[0] if len(parts) == 3 else "")
    return hosts


@functools.cache
def _prometheus() -> dict[str, Any]:
    """Return docker/prometheus/prometheus.yml parsed as YAML."""
    data = yaml.safe_load(PROMETHEUS_CONF.read_text())
    assert isinstance(data, dict), "prometheus.yml is not a mapping"
    return data


def _scrape_targets() -> list[tuple[str, str, int]]:
    """Return (job, host, port) for every static and DNS-discovered Prometheus scrape target."""
    targets = []
    for job in _prometheus().get("scrape_configs") or []:
        for static in job.get("static_configs") or []:
            for target in static.get("targets") or []:
                host, _, port = target.rpartition(":")
                targets.append((job["job_name"], host, int(port)))
        for dns in job.get("dns_sd_configs") or []:
            targets.extend((job["job_name"], name, int(dns["port"])) for name in dns["names"])
    return targets


def _alert_rules() -> list[dict[str, Any]]:
    """Return every alerting rule of the rule files that prometheus.yml loads."""
    rules = []
    for name in _prometheus().get("rule_files") or []:
        data = yaml.safe_load((PROMETHEUS_DIR / name).read_text())
        rules.extend(rule for group in data["groups"] for rule in group["rules"] if "alert" in rule)
    return rules


def _dashboard_exprs() -> dict[str, list[str]]:
    """Return the PromQL queries of each provisioned Grafana dashboard, by file name."""
    exprs = {}
    for path in sorted((GRAFANA_DIR / "dashboards").glob("*.json")):
        panels = json.loads(path.read_text())["panels"]
        exprs[path.name] = [target["expr"] for panel in panels for target in panel.get("targets", [])]
    return exprs


def _metric_names(promql: str) -> set[str]:
    """Return the slotq metric names a PromQL expression reads (a loose parse, good for our names)."""
    return set(re.findall(r"\bslotq_[a-z_]+", promql))


def _mount_source(service: dict[str, Any], target: str) -> Path:
    """Return the repo path bind-mounted at a container path, which must be read-only."""
    found = [(source, ro) for source, mount_target, ro in _mounts(service) if mount_target == target]
    assert found, f"nothing mounted at {target}: {_mounts(service)}"
    source, read_only = found[0]
    assert read_only, f"{source} is mounted read-write at {target}"
    return (ROOT / source).resolve()


def _docker_compose() -> list[str] | None:
    """Return the Compose v2 command line (plugin or standalone), or None where there is none."""
    for command in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(command[0]) is None:
            continue
        try:
            version = subprocess.run(
                [*command, "version", "--short"], capture_output=True, text=True, timeout=30
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        major = re.match(r"v?(\d+)\.", version.stdout.strip())
        if version.returncode == 0 and major and int(major.group(1)) >= 2:
            return command
    if engine.compose_cached() or os.environ.get("SLOTQ_REQUIRE_DOCKER") == "1":
        return [str(engine.compose_binary())]  # the one the container tests use
    return None


def test_services_exist() -> None:
    """The stack defines redis, api, proxy and worker and no obsolete `version` key."""
    assert {"redis", "api", "proxy", "worker"} <= set(_compose()["services"])
    assert "version" not in _compose()


def test_named_volumes_declared() -> None:
    """Redis data and model weights live on declared named volumes."""
    assert {"redis-data", "models"} <= set(_compose().get("volumes") or {})


def test_redis_persistence() -> None:
    """Redis runs with AOF persistence, fsynced every second, on the redis-data volume."""
    redis = _service("redis")
    command = redis.get("command")
    words = command if isinstance(command, list) else shlex.split(command or "")
    flags = dict(zip(words[1::2], words[2::2], strict=False)) if words else {}
    assert flags.get("--appendonly") == "yes", f"appendonly not on: {command!r}"
    assert flags.get("--appendfsync") == "everysec", f"appendfsync not everysec: {command!r}"
    assert ("redis-data", "/data", False) in _mounts(redis)


def test_redis_healthcheck() -> None:
    """Redis has a `redis-cli ping` healthcheck that depends_on can wait for."""
    test = _service("redis")["healthcheck"]["test"]
    text = " ".join(test) if isinstance(test, list) else test
    assert "redis-cli" in text
    assert "ping" in text


def test_api_is_scalable() -> None:
    """The api publishes no host port and has no fixed name, so --scale api=N works."""
    api = _service("api")
    assert "ports" not in api, "api must not publish host ports; the proxy does"
    assert "container_name" not in api
    assert "8000" in [str(port) for port in api.get("expose") or []]


def test_api_builds_api_dockerfile() -> None:
    """The api image is built from docker/api.Dockerfile with the repo as context."""
    build = _service("api")["build"]
    assert build["dockerfile"] == "docker/api.Dockerfile"
    assert Path(ROOT, build.get("context", ".")).resolve() == ROOT


def test_worker_builds_worker_dockerfile() -> None:
    """The worker image is built from docker/worker.Dockerfile with the repo as context."""
    build = _service("worker")["build"]
    assert build["dockerfile"] == "docker/worker.Dockerfile"
    assert Path(ROOT, build.get("context", ".")).resolve() == ROOT


@pytest.mark.parametrize("name", ["api", "worker"])
def test_waits_for_healthy_redis(name: str) -> None:
    """The api and the worker start only once Redis answers its healthcheck."""
    assert _depends_on(_service(name)).get("redis", {}).get("condition") == "service_healthy"


@pytest.mark.parametrize("name", ["api", "worker"])
def test_redis_url_points_at_redis_service(name: str) -> None:
    """The api and the worker reach Redis by its service name."""
    assert _environment(_service(name)).get("SLOTQ_REDIS_URL") == "redis://redis:6379/0"


@pytest.mark.parametrize("name", sorted(DEFAULT_SERVICES | MONITORING_SERVICES))
def test_restarts_unless_stopped(name: str) -> None:
    """Every long-running service comes back after a crash or a host reboot."""
    assert _service(name).get("restart") == "unless-stopped"


def test_api_healthchecks_use_healthz() -> None:
    """Compose and the api image probe /healthz with python, as slim has no curl."""
    test = _service("api")["healthcheck"]["test"]
    assert "/healthz" in (" ".join(test) if isinstance(test, list) else test)
    healthcheck = _last(API_DOCKERFILE, "HEALTHCHECK")
    assert "/healthz" in healthcheck
    assert "python" in healthcheck
    assert "curl" not in healthcheck


def test_proxy_publishes_nginx_port() -> None:
    """The proxy publishes a host port onto the port nginx listens on."""
    targets = _port_targets(_service("proxy"))
    assert targets, "proxy publishes no port"
    listens = {int(port) for port in re.findall(r"^\s*listen\s+(\d+)", NGINX_CONF.read_text(), re.M)}
    assert set(targets) <= listens, f"published {targets}, nginx listens on {listens}"


def test_proxy_publishes_on_loopback_by_default() -> None:
    """With no API keys by default, the proxy is reached from this host only unless told."""
    assert _host_ips(_service("proxy")) == ["127.0.0.1"]
    assert "${SLOTQ_BIND_ADDRESS:-127.0.0.1}:" in _service("proxy")["ports"][0]


def test_worker_is_healthy_once_ready() -> None:
    """The worker's healthcheck reads its /readyz, on the port its metrics are served on."""
    compose = " ".join(_service("worker")["healthcheck"]["test"])
    for healthcheck in (compose, _last(WORKER_DOCKERFILE, "HEALTHCHECK")):
        assert "/readyz" in healthcheck and "SLOTQ_WORKER_METRICS_PORT" in healthcheck


def test_every_worker_service_runs_one_image() -> None:
    """worker-xl and worker-folder run the worker's image, not images of their own."""
    image = _service("worker")["image"]
    for name in ("worker-xl", "worker-folder"):
        assert _extended(name).get("image") == image


def test_dockerfiles_fetch_no_frontend() -> None:
    """No `# syntax=` line: BuildKit would fetch that front end from Docker Hub before building."""
    for dockerfile in (API_DOCKERFILE, WORKER_DOCKERFILE):
        assert not re.search(r"^#\s*syntax\s*=", dockerfile.read_text(), re.M | re.I), dockerfile.name


def test_env_example_changes_nothing_until_uncommented() -> None:
    """`cp .env.example .env` sets nothing: each setting is shown commented out, at its default."""
    assignment = r"^\s*(?:export\s+)?[A-Za-z_][A-Za-z0-9_]*\s*=.*$"
    assert re.findall(assignment, ENV_EXAMPLE.read_text(), re.M) == []


def test_proxy_mounts_nginx_conf_read_only() -> None:
    """The proxy mounts the repo's docker/nginx.conf read-only as nginx's config."""
    mounts = _mounts(_service("proxy"))
    conf = [(src, ro) for src, target, ro in mounts if target == "/etc/nginx/nginx.conf"]
    assert conf, f"nginx.conf not mounted: {mounts}"
    source, read_only = conf[0]
    assert NGINX_CONF.is_file()
    assert (ROOT / source).resolve() == NGINX_CONF.resolve()
    assert read_only
    assert "api" in _depends_on(_service("proxy"))


def test_nginx_balances_over_api_replicas() -> None:
    """The proxy re-resolves `api` via Docker DNS per request, so scaled replicas are used."""
    conf = NGINX_CONF.read_text()
    assert re.search(r"^\s*resolver\s+127\.0\.0\.11\b[^;]*valid=", conf, re.M)
    variables = dict(re.findall(r"^\s*set\s+\$(\w+)\s+(\S+);", conf, re.M))
    passes = re.findall(r"^\s*proxy_pass\s+(\S+);", conf, re.M)
    assert passes, "nginx.conf has no proxy_pass"
    for target in passes:
        assert target.startswith("$"), f"static proxy_pass {target} is resolved once only"
        assert variables.get(target[1:]) == "http://api:8000"


def test_nginx_passes_event_streams_through_unbuffered() -> None:
    """A job's event stream has a location of its own: unbuffered, read timeout above the keep-alive."""
    from api.streams import KEEPALIVE_S

    conf = NGINX_CONF.read_text()
    found = re.search(r"location ~ \^/v1/jobs/\[\^/\]\+/events\$ \{(?P<body>[^}]*)\}", conf)
    assert found, "no location for /v1/jobs/<id>/events"
    body = found["body"]
    assert re.search(r"^\s*proxy_buffering\s+off;", body, re.M)
    assert re.search(r"^\s*proxy_http_version\s+1\.1;", body, re.M)
    read = re.search(r"^\s*proxy_read_timeout\s+(\d+)s;", body, re.M)
    assert read and int(read[1]) > 2 * KEEPALIVE_S
    assert re.match(found.group(0).split()[2], "/v1/jobs/abc-123/events")


def test_nginx_limits_and_forwards_headers() -> None:
    """The proxy caps request bodies and forwards request id and client address."""
    conf = NGINX_CONF.read_text()
    # The API's own limit (SLOTQ_MAX_BODY_BYTES, 12 MiB by default) answers 413 in its envelope.
    assert re.search(r"^\s*client_max_body_size\s+12m;", conf, re.M)
    assert re.search(r"^\s*proxy_set_header\s+X-Request-ID\s+\S+;", conf, re.M)
    assert re.search(r"^\s*proxy_set_header\s+X-Forwarded-For\s+\$proxy_add_x_forwarded_for;", conf, re.M)
    assert re.search(r"^\s*proxy_read_timeout\s+\d+s?;", conf, re.M)


def test_worker_reserves_nvidia_gpu() -> None:
    """The worker reserves one NVIDIA GPU and is told to use CUDA."""
    worker = _service("worker")
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert any(
        device.get("driver") == "nvidia" and "gpu" in device.get("capabilities", []) for device in devices
    ), devices
    assert _environment(worker).get("SLOTQ_DEVICE", "").startswith("cuda")


def test_worker_models_volume() -> None:
    """Model weights persist on the named `models` volume at /models (HF_HOME)."""
    assert ("models", "/models", False) in _mounts(_service("worker"))
    assert _env_instructions(WORKER_DOCKERFILE).get("HF_HOME") == "/models"
    assert _env_instructions(WORKER_DOCKERFILE).get("SLOTQ_CACHE_DIR", "").startswith("/models/")


def test_worker_stop_grace_covers_longest_job() -> None:
    """A stopping worker gets SIGTERM and at least the longest job's time to finish it."""
    worker = _service("worker")
    assert worker.get("stop_signal", "SIGTERM") == "SIGTERM"
    assert "stop_grace_period" in worker, "default 10 s grace would kill running jobs"
    assert _parse_duration(worker["stop_grace_period"]) >= DEFAULT_JOB_TIMEOUT_S


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("15m", 900.0), ("900s", 900.0), ("1m30s", 90.0), ("1h", 3600.0), ("500ms", 0.5), (20, 20.0)],
)
def test_parse_duration(value: str | int, seconds: float) -> None:
    """Compose durations are converted to seconds."""
    assert _parse_duration(value) == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["15", "15 minutes", "m", ""])
def test_parse_duration_rejects_garbage(value: str) -> None:
    """Strings that are not compose durations raise ValueError."""
    with pytest.raises(ValueError, match="not a compose duration"):
        _parse_duration(value)


def test_api_dockerfile_has_no_torch() -> None:
    """The api image installs only the `api` extra: no worker extra and no torch."""
    assert _base_image(API_DOCKERFILE).startswith("python:3.11-slim")
    assert _pip_extras(API_DOCKERFILE) == {"api"}
    assert "torch" not in _run_text(API_DOCKERFILE).lower()


def test_worker_dockerfile_keeps_cuda_torch() -> None:
    """The worker image starts from a CUDA torch image and installs `.[worker]` on top."""
    assert "cuda" in _base_image(WORKER_DOCKERFILE)
    assert "worker" in _pip_extras(WORKER_DOCKERFILE)
    run = _run_text(WORKER_DOCKERFILE)
    for flag in ("--upgrade", "-U ", "--force-reinstall", "--index-url", "--extra-index-url"):
        assert flag not in run, f"{flag} could replace the image's CUDA torch"


@pytest.mark.parametrize(
    ("dockerfile", "command"),
    [
        (API_DOCKERFILE, ["slotq", "api", "--host", "0.0.0.0", "--port", "8000"]),
        (WORKER_DOCKERFILE, ["slotq", "worker"]),
    ],
    ids=["api", "worker"],
)
def test_dockerfile_runs_slotq_as_non_root(dockerfile: Path, command: list[str]) -> None:
    """Each image runs its slotq command in exec form as a non-root user."""
    assert json.loads(_last(dockerfile, "CMD")) == command
    assert _last(dockerfile, "USER") not in {"root", "0"}


@pytest.mark.parametrize("dockerfile", [API_DOCKERFILE, WORKER_DOCKERFILE], ids=["api", "worker"])
def test_dockerfile_copy_sources_exist(dockerfile: Path) -> None:
    """Every file a Dockerfile copies exists and is not excluded by .dockerignore."""
    ignored = {
        line.strip().strip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith(("#", "!"))
    }
    sources = _copy_sources(dockerfile)
    assert sources, f"{dockerfile.name} copies nothing"
    for source in sources:
        top = source.strip("/").split("/")[0]
        assert top not in ignored, f"{source} is excluded by .dockerignore"
        if not any(char in source for char in "*?["):
            assert (ROOT / source).exists(), f"{dockerfile.name} copies missing {source}"


def test_compose_references_existing_files() -> None:
    """Every Dockerfile and bind-mounted file named in the compose file exists."""
    for name, service in _compose()["services"].items():
        build = service.get("build")
        if isinstance(build, dict) and "dockerfile_inline" in build:
            assert (ROOT / build.get("context", ".")).is_dir(), f"{name}: build context missing"
        elif isinstance(build, dict):
            path = ROOT / build.get("context", ".") / build.get("dockerfile", "Dockerfile")
            assert path.is_file(), f"{name}: {path} missing"
        for source, _, _ in _mounts(service):
            if source.startswith((".", "/")):
                assert (ROOT / source).exists(), f"{name}: bind mount {source} missing"


def test_env_example_documents_compose_variables() -> None:
    """Every ${VAR} and SLOTQ_* variable named in the compose file is in .env.example."""
    if not ENV_EXAMPLE.is_file():
        pytest.fail(f"{ENV_EXAMPLE.name} is missing; it must document the compose variables")
    names: set[str] = set()
    for text in _strings(_compose()):
        names.update(re.findall(r"(?<!\$)\$\{?([A-Za-z_][A-Za-z0-9_]*)", text))
        names.update(re.findall(r"\bSLOTQ_[A-Z0-9_]+\b", text))
    assert names, "expected the compose file to name some variables"
    documented = set(
        re.findall(
            r"^\s*(?:#\s*)?(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)\s*=",
            ENV_EXAMPLE.read_text(),
            re.M,
        )
    )
    missing = sorted(names - documented)
    assert not missing, f"{ENV_EXAMPLE.name} does not document: {', '.join(missing)}"


def test_monitoring_services_only_in_their_profile() -> None:
    """Prometheus, Grafana and rq-dashboard run with --profile monitoring; the stack runs without."""
    services = _compose()["services"]
    assert MONITORING_SERVICES <= set(services)
    for name in MONITORING_SERVICES:
        assert services[name].get("profiles") == ["monitoring"], name
    for name in DEFAULT_SERVICES:
        assert not services[name].get("profiles"), f"{name} must start without a profile"
        assert not set(_depends_on(services[name])) & MONITORING_SERVICES, f"{name} needs monitoring"


@pytest.mark.parametrize("name", sorted(MONITORING_SERVICES))
def test_monitoring_service_conventions(name: str) -> None:
    """Each monitoring service logs like the rest, pins its image and publishes on loopback only."""
    service = _service(name)
    assert service.get("logging") == _compose()["x-logging"]
    if "image" in service:
        assert re.search(r":v?\d+\.\d+\.\d+$", service["image"]), f"unpinned image {service['image']}"
    hosts = _host_ips(service)
    assert hosts, f"{name} publishes no port"
    assert set(hosts) == {"127.0.0.1"}, f"{name} is published beyond 127.0.0.1: {service['ports']}"


def test_cpu_override_reserves_no_gpu() -> None:
    """With docker-compose.cpu.yml every worker service runs on the CPU and reserves no device."""
    command = _docker_compose()
    if command is None:
        pytest.skip("Docker Compose v2 is not installed here; the file is checked as YAML only")
    result = subprocess.run(
        [*command, "-f", "docker-compose.yml", "-f", "docker-compose.cpu.yml", "--profile", "*", "config",
         "--format", "json"], cwd=ROOT, capture_output=True, text=True, timeout=60, env=_without_env_file(),
    )
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    workers = {name for name in services if name.startswith("worker")}
    assert workers == {"worker", "worker-xl", "worker-folder"}
    for name in workers:
        assert "deploy" not in services[name], name
        assert services[name]["environment"]["SLOTQ_DEVICE"] == "cpu", name


def test_the_ollama_override_shares_the_card_with_settings_the_worker_knows() -> None:
    """docker-compose.ollama.yml: Ollama beside the worker on one GPU, the worker letting go of it when
    idle and when Ollama takes its memory, with settings the worker reads (not typos it would ignore)."""
    override = yaml.safe_load((ROOT / "docker-compose.ollama.yml").read_text())
    environment = override["services"]["worker"]["environment"]
    worker = Settings(**{name.removeprefix("SLOTQ_").lower(): value for name, value in environment.items()})
    assert worker.idle_release_s > 0 and worker.yield_below_mb > 0 and worker.host_model_cache > 0
    ollama = override["services"]["ollama"]
    assert re.search(r":\d+\.\d+\.\d+$", ollama["image"]), ollama["image"]  # pinned
    assert ollama["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert set(_host_ips(ollama)) == {"127.0.0.1"}
    command = _docker_compose()
    if command is None:
        return  # checked as YAML only, as the other files are where Compose v2 is missing
    files = ["-f", "docker-compose.yml", "-f", "docker-compose.ollama.yml"]
    result = subprocess.run([*command, *files, "config", "--format", "json"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60, env=_without_env_file())
    assert result.returncode == 0, result.stderr
    merged = json.loads(result.stdout)["services"]
    assert merged["worker"]["environment"]["SLOTQ_IDLE_RELEASE_S"] == "300"
    assert merged["worker"]["environment"]["SLOTQ_DEVICE"] == "cuda"  # the base's, kept


def _without_env_file() -> dict[str, str]:
    """The environment with no SLOTQ_ or COMPOSE_ variable, which compose would read."""
    return {key: value for key, value in os.environ.items() if not key.startswith(("SLOTQ_", "COMPOSE_"))}


def test_compose_config_is_valid() -> None:
    """`docker compose config` accepts the file with and without the monitoring profile."""
    command = _docker_compose()
    if command is None:
        pytest.skip("Docker Compose v2 is not installed here; the file is checked as YAML only")
    for profile in ([], ["--profile", "monitoring"], ["--profile", "folder"]):
        result = subprocess.run(
            [*command, *profile, "config", "-q"], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stderr
    with_folder = DEFAULT_SERVICES | {FOLDER_WORKER}
    for profile, expected in (([], DEFAULT_SERVICES), (["--profile", "folder"], with_folder)):
        services = subprocess.run(
            [*command, *profile, "config", "--services"], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        assert set(services.stdout.split()) == expected


def test_folder_worker_only_in_its_profile() -> None:
    """worker-folder is the worker, extended, started with --profile folder only; it waits for Redis and
    Prometheus finds it as it finds the worker."""
    folder = _service(FOLDER_WORKER)
    assert folder.get("profiles") == ["folder"]
    assert folder["extends"] == {"service": "worker"}
    for name in DEFAULT_SERVICES:
        assert FOLDER_WORKER not in _depends_on(_service(name)), f"{name} needs the folder's worker"
    # Compose's extends does not carry depends_on over: stated again.
    assert _depends_on(folder).get("redis", {}).get("condition") == "service_healthy"
    assert "worker" in folder["networks"]["default"]["aliases"]
    assert ("slotq-worker", "worker", 9101) in _scrape_targets()


def test_folder_is_mounted_read_only_on_the_api_and_its_worker() -> None:
    """The API and worker-folder mount one host folder read-only where their SLOTQ_MODELS_DIR says, apart
    from the worker's hub cache; a plain `up` works without that folder, and no build carries it."""
    mounted = set()
    for name in ("api", FOLDER_WORKER):
        service = _extended(name)
        folder = _environment(service)["SLOTQ_MODELS_DIR"]
        found = [(source, ro) for source, target, ro in _mounts(service) if target == folder]
        assert found, f"{name}: nothing mounted at SLOTQ_MODELS_DIR={folder}"
        [(source, read_only)] = found
        assert read_only, f"{name} mounts the models read-write"
        mounted.add((source, folder))
    [(source, folder)] = mounted
    # The short syntax: Compose creates a missing host folder (the long syntax's create_host_path is false),
    # so the API of a plain `docker compose up` starts without one, offering no model of it.
    [entry] = [volume for volume in _service("api")["volumes"] if str(volume).startswith(source)]
    assert isinstance(entry, str), "the API's models folder in the long syntax"
    assert entry.startswith("${"), "the host folder is not a variable"
    default = _interpolated(source)
    assert default.startswith("./"), f"default host folder {default!r} is not beside the compose file"
    # The build context is the repository: checkpoints in the default folder must not be sent with it.
    ignored = {line.strip().strip("/") for line in DOCKERIGNORE.read_text().splitlines() if line.strip()}
    assert Path(default).parts[0] in ignored, f"{default} is not in .dockerignore"
    # The hub cache (HF_HOME) stays the writable `models` volume: a single file's configs are read there.
    hf_home = _env_instructions(WORKER_DOCKERFILE)["HF_HOME"]
    assert ("models", hf_home, False) in _mounts(_extended(FOLDER_WORKER))
    assert not Path(folder).is_relative_to(hf_home) and not Path(hf_home).is_relative_to(folder)


def test_folder_worker_serves_every_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """With models in the folder and no .env, worker-folder serves each of them on CUDA, one pipeline kept
    on the GPU, and the API offers them beside its named models."""
    for name, pipeline in (("anime", "StableDiffusionPipeline"), ("photo", "StableDiffusionXLPipeline")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model_index.json").write_text(json.dumps({"_class_name": pipeline}))
    env = {key: _interpolated(value) for key, value in _environment(_extended(FOLDER_WORKER)).items()}
    assert env["SLOTQ_WORKER_MODELS"] == "*"
    assert env["SLOTQ_MODEL_CACHE"] == str(Settings.model_fields["model_cache"].default)
    settings = _settings_from(env | {"SLOTQ_MODELS_DIR": str(tmp_path)}, monkeypatch)
    assert settings.served_models == ["anime", "photo"]
    assert (settings.device, settings.model_cache) == ("cuda", 1)
    api_env = {key: _interpolated(value) for key, value in _environment(_service("api")).items()}
    offered = _settings_from(api_env | {"SLOTQ_MODELS_DIR": str(tmp_path)}, monkeypatch).offered_models
    assert {"anime": "sd", "photo": "sdxl"}.items() <= offered.items()
    # Without the folder (a plain `up`: Compose made it empty), the API offers its named models alone.
    empty = tmp_path / "empty"
    empty.mkdir()
    named = _settings_from(api_env | {"SLOTQ_MODELS_DIR": str(empty)}, monkeypatch).offered_models
    assert list(named) == [entry.partition("=")[0] for entry in api_env["SLOTQ_MODEL_NAMES"].split(",")]


@pytest.mark.parametrize(("text", "value"), [
    ("${A:-./models}", "./models"), ("${A-1}", "1"), ("${A}", ""), ("x${A:-y}z", "xyz"), ("plain", "plain")])
def test_interpolated(text: str, value: str) -> None:
    """Compose variables read with nothing set give their defaults."""
    assert _interpolated(text) == value


def test_prometheus_mounts_its_config() -> None:
    """Prometheus reads docker/prometheus read-only, and every rule file it names is there."""
    prometheus = _service("prometheus")
    assert _mount_source(prometheus, "/etc/prometheus") == PROMETHEUS_DIR.resolve()
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]
    assert _prometheus()["global"]["scrape_interval"] == "15s"
    for name in _prometheus().get("rule_files") or []:
        assert (PROMETHEUS_DIR / name).is_file(), f"rule file {name} missing"


def test_scrape_targets_are_compose_services() -> None:
    """Every scrape target is a compose service and a port that service offers on the network."""
    targets = _scrape_targets()
    assert {job for job, _, _ in targets} >= {"slotq-api", "slotq-worker"}
    for job, host, port in targets:
        assert host in _compose()["services"], f"{job}: {host} is not a compose service"
        assert port in _exposed_ports(_service(host)), f"{job}: {host} does not expose {port}"


@pytest.mark.parametrize("job", ["slotq-api", "slotq-worker"])
def test_scrapes_every_replica(job: str) -> None:
    """API and worker are found by DNS (type A), so each replica of --scale is scraped."""
    config = next(c for c in _prometheus()["scrape_configs"] if c["job_name"] == job)
    assert not config.get("static_configs"), f"{job}: a static target reaches one replica only"
    assert [dns.get("type") for dns in config["dns_sd_configs"]] == ["A"]


def test_worker_serves_metrics_to_the_network() -> None:
    """The worker binds its metrics port on all addresses and exposes it (default port 9101)."""
    worker = _service("worker")
    port = Settings.model_fields["worker_metrics_port"].default
    assert _environment(worker).get("SLOTQ_WORKER_METRICS_HOST") == "0.0.0.0"
    assert port in _exposed_ports(worker)
    assert ("slotq-worker", "worker", port) in _scrape_targets()


def test_exported_metrics_match_the_code() -> None:
    """Every metric listed here as exported is named in api/metrics.py or worker/metrics.py."""
    code = "\n".join(path.read_text() for path in METRICS_SOURCES)
    for name in [*_COUNTERS, *_HISTOGRAMS, *_GAUGES]:
        assert f'"{name}"' in code, f"{name} is not exported by the code"


def test_alerts_and_dashboards_read_exported_metrics() -> None:
    """The alert rules and the dashboard query only metrics that the API and the worker export."""
    rules = _alert_rules()
    assert rules, "no alert rules"
    for rule in rules:
        assert {"alert", "expr", "for"} <= set(rule), rule
        assert _metric_names(rule["expr"]) <= EXPORTED_METRICS, rule["alert"]
    dashboards = _dashboard_exprs()
    assert dashboards, "no Grafana dashboard"
    for name, exprs in dashboards.items():
        names = {metric for expr in exprs for metric in _metric_names(expr)}
        assert names, f"{name} queries no slotq metric"
        assert names <= EXPORTED_METRICS, f"{name}: unknown {sorted(names - EXPORTED_METRICS)}"


def test_promtool_accepts_config_and_rules() -> None:
    """promtool validates prometheus.yml and passes the alert rules' unit tests."""
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed here (Debian: apt-get install prometheus)")
    for args in (["check", "config", "prometheus.yml"], ["test", "rules", "alerts.test.yml"]):
        result = subprocess.run(
            ["promtool", *args], cwd=PROMETHEUS_DIR, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stdout + result.stderr


def test_grafana_provisioning() -> None:
    """Grafana gets the repo's datasource and dashboards, and the datasource is Prometheus."""
    grafana = _service("grafana")
    provisioning = _mount_source(grafana, "/etc/grafana/provisioning")
    assert provisioning == (GRAFANA_DIR / "provisioning").resolve()
    providers = yaml.safe_load((provisioning / "dashboards" / "slotq.yml").read_text())["providers"]
    for provider in providers:
        assert _mount_source(grafana, provider["options"]["path"]).is_dir()
    sources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert [source["url"] for source in sources] == ["http://prometheus:9090"]
    assert 9090 in _exposed_ports(_service("prometheus"))
    assert "prometheus" in _depends_on(grafana)
    uids = {source["uid"] for source in sources}
    for path in (GRAFANA_DIR / "dashboards").glob("*.json"):
        for panel in json.loads(path.read_text())["panels"]:
            assert panel["datasource"]["uid"] in uids, f"{path.name}: panel {panel['title']!r}"


def test_rq_dashboard_reads_slotq_redis() -> None:
    """rq-dashboard reads the api's Redis as JSON, with the RQ major version slotq runs."""
    dashboard = _service("rq-dashboard")
    env = _environment(dashboard)
    assert env.get("RQ_DASHBOARD_REDIS_URL") == _environment(_service("api"))["SLOTQ_REDIS_URL"]
    assert env.get("RQ_DASHBOARD_REDIS_URL", "").startswith("redis://redis:")
    assert env.get("RQ_DASHBOARD_JSON") == "true", "slotq stores jobs as JSON; pickle cannot read them"
    assert _depends_on(dashboard).get("redis", {}).get("condition") == "service_healthy"
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    rq = next(dep.split("#")[0].strip() for dep in dependencies if re.match(r"rq\b", dep))
    inline = dashboard["build"]["dockerfile_inline"]
    assert f'"{rq}"' in inline, f"the dashboard image must install {rq}"
    assert re.search(r'"rq-dashboard==[\d.]+"', inline), "rq-dashboard is not pinned"
