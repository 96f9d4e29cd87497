"""Static checks of the container deployment: docker-compose.yml, Dockerfiles, nginx.conf."""

import functools
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
NGINX_CONF = ROOT / "docker" / "nginx.conf"
API_DOCKERFILE = ROOT / "docker" / "api.Dockerfile"
WORKER_DOCKERFILE = ROOT / "docker" / "worker.Dockerfile"
ENV_EXAMPLE = ROOT / ".env.example"

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
    """Return a service's volumes as (source, target, read_only) tuples."""
    mounts = []
    for volume in service.get("volumes") or []:
        if isinstance(volume, dict):
            mounts.append((str(volume.get("source", "")), volume["target"], bool(volume.get("read_only"))))
            continue
        parts = volume.split(":")
        source, target = (parts[0], parts[1]) if len(parts) > 1 else ("", parts[0])
        mode = parts[2] if len(parts) > 2 else ""
        mounts.append((source, target, "ro" in mode.split(",")))
    return mounts


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


@pytest.mark.parametrize("name", ["redis", "api", "proxy", "worker"])
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


def test_nginx_limits_and_forwards_headers() -> None:
    """The proxy caps request bodies and forwards request id and client address."""
    conf = NGINX_CONF.read_text()
    assert re.search(r"^\s*client_max_body_size\s+64k;", conf, re.M)
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
        if isinstance(build, dict):
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
