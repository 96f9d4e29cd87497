"""Static checks of the Kubernetes manifests under deploy/: they parse, validate and agree."""

import copy
import functools
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from pydantic import TypeAdapter

from shared.contract.settings import KeyTable, Settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUSTOMIZATION = DEPLOY / "kustomization.yaml"
COMPONENT = DEPLOY / "prometheus" / "kustomization.yaml"
METRICS_SOURCES = [ROOT / "api" / "metrics.py", ROOT / "worker" / "metrics.py"]
DOCKERFILES = {"slotq-api": ROOT / "docker" / "api.Dockerfile",
               "slotq-worker": ROOT / "docker" / "worker.Dockerfile"}

# An old Kubernetes still in the providers' support, and the newest the validator knows.
K8S_VERSIONS = ["1.30", "latest"]

KEDA = "keda.sh/v1alpha1"
# No validator on PyPI ships KEDA's CRD schemas, so its fields are checked here by hand, against
# KEDA's reference (docs/2.17/reference/scaledobject-spec.md and the scalers' pages).
SCALED_OBJECT_FIELDS = {"scaleTargetRef", "pollingInterval", "cooldownPeriod", "initialCooldownPeriod",
                        "idleReplicaCount", "minReplicaCount", "maxReplicaCount", "fallback", "advanced",
                        "triggers"}
TRIGGER_FIELDS = {"type", "name", "metadata", "metricType", "authenticationRef", "useCachedMetrics"}
TRIGGER_METADATA = {
    "metrics-api": {"required": {"url", "valueLocation", "targetValue"},
                    "optional": {"format", "activationTargetValue", "unsafeSsl", "authMode", "method",
                                 "keyParamName", "aggregateFromKubeServiceEndpoints", "aggregationType"}},
    "prometheus": {"required": {"serverAddress", "query", "threshold"},
                   "optional": {"activationThreshold", "namespace", "customHeaders", "ignoreNullValues",
                                "queryParameters", "unsafeSsl", "authModes"}},
}
# What each scaler's authMode needs from the TriggerAuthentication.
AUTH_PARAMETERS = {"bearer": {"token"}, "basic": {"username"}, "apiKey": {"apiKey"}}
# A pod name as the downward API gives it to SLOTQ_WORKER_NAME.
POD_NAME = "slotq-worker-5d8f7c9b6-x2x7q"


@functools.cache
def _kustomization() -> dict[str, Any]:
    """Return deploy/kustomization.yaml."""
    data = yaml.safe_load(KUSTOMIZATION.read_text())
    assert isinstance(data, dict), "kustomization.yaml is not a mapping"
    return data


def _load_all(path: Path) -> list[dict[str, Any]]:
    """Return the documents of one YAML file, each a mapping."""
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    for doc in docs:
        assert isinstance(doc, dict), f"{path.name}: a document is not a mapping"
    return docs


@functools.cache
def _resources() -> tuple[dict[str, Any], ...]:
    """Every object the kustomization lists, in its order."""
    return tuple(doc for name in _kustomization()["resources"] for doc in _load_all(DEPLOY / name))


def _of_kind(kind: str) -> list[dict[str, Any]]:
    """Return every listed object of one kind."""
    return [doc for doc in _resources() if doc["kind"] == kind]


def _one(kind: str, name: str) -> dict[str, Any]:
    """Return the listed object of this kind and name."""
    found = [doc for doc in _of_kind(kind) if doc["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def _workloads() -> list[dict[str, Any]]:
    """Every object that runs pods."""
    return _of_kind("Deployment") + _of_kind("StatefulSet")


def _pod(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    """The workload's one container (slotq runs one process per pod)."""
    containers = _pod(workload)["containers"]
    assert len(containers) == 1, f"{workload['metadata']['name']}: {len(containers)} containers"
    return containers[0]


def _env_file(path: Path) -> dict[str, str]:
    """Read KEY=VALUE lines as kustomize's `envs` does (comments and blank lines skipped)."""
    pairs = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f"{path.name}: not KEY=VALUE: {line!r}"
            pairs[key.strip()] = value
    return pairs


@functools.cache
def _secrets() -> dict[str, dict[str, str]]:
    """The Secrets the kustomization generates, by name, with the values of the checked-in examples."""
    secrets: dict[str, dict[str, str]] = {}
    for generator in _kustomization().get("secretGenerator", []):
        data = secrets.setdefault(generator["name"], {})
        for env in generator.get("envs", []):
            data.update(_env_file(DEPLOY / f"{env}.example"))
        for literal in generator.get("literals", []):
            key, _, value = literal.partition("=")
            data[key] = value
    return secrets


def _config_maps() -> dict[str, dict[str, str]]:
    return {doc["metadata"]["name"]: doc.get("data", {}) for doc in _of_kind("ConfigMap")}


def _pod_env(workload: dict[str, Any]) -> dict[str, str]:
    """The environment the workload's container starts with (later sources win, as in the kubelet)."""
    container, env = _container(workload), {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(_config_maps()[source["configMapRef"]["name"]])
        if "secretRef" in source:
            env.update(_secrets()[source["secretRef"]["name"]])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[var["name"]] = POD_NAME
    return env


def _settings_of(workload: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The settings the workload's process reads from its environment (raises on a bad value)."""
    for key in list(os.environ):
        if key.startswith("SLOTQ_"):
            monkeypatch.delenv(key)
    for key, value in _pod_env(workload).items():
        monkeypatch.setenv(key, value)
    return Settings()


def _setting_names() -> set[str]:
    return {f"SLOTQ_{name.upper()}" for name in Settings.model_fields}


def _container_port(workload: dict[str, Any], port: int | str) -> int:
    """Resolve a probe's or a Service's port (a name or a number) to a port the container declares."""
    declared = {p.get("name"): p["containerPort"] for p in _container(workload).get("ports", [])}
    if isinstance(port, str):
        assert port in declared, f"{workload['metadata']['name']} declares no port named {port!r}"
        return declared[port]
    assert port in declared.values(), f"{workload['metadata']['name']} declares no port {port}"
    return port


def _is_number(text: str) -> bool:
    return re.fullmatch(r"\d+(\.\d+)?", text) is not None


def test_every_manifest_parses() -> None:
    """Every YAML file under deploy/ parses; each object has a kind and a name, and no namespace."""
    files = sorted(DEPLOY.rglob("*.yaml"))
    assert KUSTOMIZATION in files and COMPONENT in files
    for path in files:
        for doc in _load_all(path):
            assert {"apiVersion", "kind"} <= doc.keys(), f"{path.name}: {sorted(doc)}"
            if doc["kind"] in ("Kustomization", "Component"):
                continue
            metadata = doc.get("metadata", {})
            assert metadata.get("name"), f"{path.name}: a {doc['kind']} without a name"
            # The kustomization places every object, so an overlay can move them all at once.
            assert "namespace" not in metadata, f"{path.name}: {doc['kind']} names its own namespace"


def test_kustomization_accounts_for_every_file() -> None:
    """Each manifest is listed, each listed file exists, and the real secrets never reach git."""
    kustomization = _kustomization()
    manifests = {path.name for path in DEPLOY.glob("*.yaml")} - {KUSTOMIZATION.name}
    assert sorted(kustomization["resources"]) == sorted(manifests)
    assert kustomization["namespace"] == _of_kind("Namespace")[0]["metadata"]["name"]
    accounted = {KUSTOMIZATION, COMPONENT, DEPLOY / ".gitignore"} | {DEPLOY / name for name in manifests}
    ignored = (DEPLOY / ".gitignore").read_text().split()
    for generator in kustomization["secretGenerator"]:
        for env in generator.get("envs", []):
            assert env in ignored, f"{env} is not in deploy/.gitignore"
            assert (DEPLOY / f"{env}.example").is_file(), f"no {env}.example beside it"
            accounted |= {DEPLOY / env, DEPLOY / f"{env}.example"}
    stray = {path for path in DEPLOY.rglob("*") if path.is_file()} - accounted
    assert not stray, f"files in deploy/ that no kustomization uses: {sorted(map(str, stray))}"
    assert yaml.safe_load(COMPONENT.read_text())["kind"] == "Component"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_core_objects_match_kubernetes_schemas(version: str) -> None:
    """Every built-in object validates, strictly (no unknown field), against Kubernetes' own schemas."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    if version == "latest":
        version = kubernetes_validate.latest_version()
    secrets = [{"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "stringData": data}
               for name, data in _secrets().items()]
    # KEDA hands `advanced.horizontalPodAutoscalerConfig.behavior` to an HPA as it is: check it as one.
    scaled = _one("ScaledObject", "slotq-worker")["spec"]
    target = {"apiVersion": "apps/v1", "kind": "Deployment", "name": scaled["scaleTargetRef"]["name"]}
    keda_hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
                "metadata": {"name": "keda-hpa-slotq-worker"},
                "spec": {"scaleTargetRef": target,
                         "minReplicas": max(1, scaled["minReplicaCount"]),
                         "maxReplicas": scaled["maxReplicaCount"],
                         "behavior": scaled["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]}}
    core = [doc for doc in _resources() if doc["apiVersion"] != KEDA]
    kinds = {"Deployment", "Service", "HorizontalPodAutoscaler", "StatefulSet", "ConfigMap", "Namespace"}
    assert {doc["kind"] for doc in core} >= kinds
    problems = []
    for doc in [*core, *secrets, keda_hpa]:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = "/".join(map(str, exc.absolute_path))
            problems.append(f"{doc['kind']}/{doc['metadata']['name']} at {where}: {exc.message}")
    assert not problems, f"on Kubernetes {version}:\n" + "\n".join(problems)


def _check_trigger(trigger: dict[str, Any]) -> None:
    """One KEDA trigger: known fields, its scaler's required metadata, every metadata value a string."""
    assert set(trigger) <= TRIGGER_FIELDS, f"unknown trigger fields {set(trigger) - TRIGGER_FIELDS}"
    assert trigger["type"] in TRIGGER_METADATA, f"unchecked scaler {trigger['type']}"
    assert trigger.get("metricType", "AverageValue") in ("AverageValue", "Value")
    metadata, fields = trigger["metadata"], TRIGGER_METADATA[trigger["type"]]
    assert fields["required"] <= metadata.keys(), f"missing {fields['required'] - metadata.keys()}"
    unknown = metadata.keys() - fields["required"] - fields["optional"]
    assert not unknown, f"unknown {trigger['type']} metadata {sorted(unknown)}"
    # KEDA's metadata is map[string]string: a bare 4 or true would be refused by the CRD's schema.
    bad = {key: value for key, value in metadata.items() if not isinstance(value, str)}
    assert not bad, f"metadata values must be strings: {bad}"
    for key in ("targetValue", "activationTargetValue", "threshold", "activationThreshold"):
        if key in metadata:
            assert _is_number(metadata[key]), f"{key}: {metadata[key]!r} is not a number"
    assert float(metadata.get("targetValue", metadata.get("threshold", "0"))) > 0


def _check_scaled_object(scaled: dict[str, Any]) -> None:
    """A ScaledObject's own fields, its target and each trigger."""
    spec = scaled["spec"]
    assert scaled["apiVersion"] == KEDA
    assert set(spec) <= SCALED_OBJECT_FIELDS, f"unknown fields {set(spec) - SCALED_OBJECT_FIELDS}"
    target = spec["scaleTargetRef"]
    assert target.get("apiVersion", "apps/v1") == "apps/v1"
    assert target.get("kind", "Deployment") == "Deployment"
    assert _container(_one("Deployment", target["name"]))["name"] == "worker"
    keys = ("minReplicaCount", "maxReplicaCount", "cooldownPeriod", "pollingInterval")
    counts = {key: spec[key] for key in keys}
    assert all(isinstance(value, int) and value >= 0 for value in counts.values()), counts
    assert spec["minReplicaCount"] in (0, 1) and spec["minReplicaCount"] <= spec["maxReplicaCount"]
    assert spec["triggers"], "no trigger"
    for trigger in spec["triggers"]:
        _check_trigger(trigger)


def test_scaled_object_scales_the_worker() -> None:
    """A ScaledObject targets each model's worker Deployment with known fields; nothing else scales them."""
    scaled_objects = _of_kind("ScaledObject")
    workers = {doc["metadata"]["name"] for doc in _of_kind("Deployment")
               if _container(doc)["name"] == "worker"}
    assert workers == {"slotq-worker", "slotq-worker-xl"}
    assert sorted(doc["spec"]["scaleTargetRef"]["name"] for doc in scaled_objects) == sorted(workers)
    for scaled in scaled_objects:
        _check_scaled_object(scaled)
    # KEDA makes the workers' HPAs; a second one would fight it.
    targets = {hpa["spec"]["scaleTargetRef"]["name"] for hpa in _of_kind("HorizontalPodAutoscaler")}
    assert not targets & workers
    # The worker's count is KEDA's: a `replicas` in the manifest would reset it on every apply.
    assert all("replicas" not in deployment["spec"] for deployment in _of_kind("Deployment"))


def test_trigger_authentication_exists_and_reads_a_real_key() -> None:
    """Each authenticationRef names a TriggerAuthentication whose Secret and key exist; the example agrees."""
    auths = {doc["metadata"]["name"]: doc for doc in _of_kind("TriggerAuthentication")}
    for trigger in [t for doc in _of_kind("ScaledObject") for t in doc["spec"]["triggers"]]:
        ref = trigger.get("authenticationRef")
        if ref is None:
            continue
        assert ref.get("kind", "TriggerAuthentication") == "TriggerAuthentication"
        auth = auths[ref["name"]]
        assert auth["apiVersion"] == KEDA
        parameters = set()
        for entry in auth["spec"]["secretTargetRef"]:
            assert set(entry) == {"parameter", "name", "key"}
            assert all(isinstance(value, str) for value in entry.values())
            assert entry["key"] in _secrets()[entry["name"]], f"Secret {entry['name']} has no {entry['key']}"
            parameters.add(entry["parameter"])
        mode = trigger["metadata"].get("authMode")
        assert mode in AUTH_PARAMETERS and AUTH_PARAMETERS[mode] <= parameters, (mode, parameters)
    # The example's KEDA token is one of its API keys, so a copy of it works as it is.
    secrets = _secrets()["slotq-secrets"]
    assert secrets["KEDA_TOKEN"] in TypeAdapter(KeyTable).validate_json(secrets["SLOTQ_API_KEYS"])


@pytest.mark.parametrize("scaled", ["slotq-worker", "slotq-worker-xl"])
def test_metrics_api_asks_the_api_service_for_the_waiting_count(scaled: str, monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    """The metrics-api URL names the API Service, its namespace and port, and the count GET /v1/queue
    has of the line of the model the target's workers serve."""
    from api.openapi import QUEUE_SCHEMA

    spec = _one("ScaledObject", scaled)["spec"]
    trigger, deployment = spec["triggers"][0], spec["scaleTargetRef"]["name"]
    assert trigger["type"] == "metrics-api"
    url = urlsplit(trigger["metadata"]["url"])
    service = _one("Service", "slotq-api")
    # KEDA's operator runs in its own namespace: the bare Service name would not resolve there.
    assert url.hostname == f"{service['metadata']['name']}.{_kustomization()['namespace']}.svc"
    assert url.port in {port["port"] for port in service["spec"]["ports"]}
    assert (url.scheme, url.path) == ("http", "/v1/queue")
    # Its own model's line: models.<name>.waiting, a name the API accepts.
    models, name, field = trigger["metadata"]["valueLocation"].split(".")
    assert models in QUEUE_SCHEMA["required"]
    line = QUEUE_SCHEMA["properties"][models]["additionalProperties"]
    assert line["properties"][field]["type"] == "integer"
    assert name == _settings_of(_one("Deployment", deployment), monkeypatch).model_name
    assert name in _settings_of(_one("Deployment", "slotq-api"), monkeypatch).offered_models
    # Every replica answers the same service-wide count: summing over endpoints would multiply it.
    assert trigger["metadata"].get("aggregateFromKubeServiceEndpoints", "false") == "false"


def test_api_scales_on_its_own_cpu() -> None:
    """The HPA targets the API Deployment, on CPU utilisation, with at least two replicas."""
    hpa = _one("HorizontalPodAutoscaler", "slotq-api")["spec"]
    target = hpa["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"]) == ("apps/v1", "Deployment")
    assert _container(_one("Deployment", target["name"]))["name"] == "api"
    assert 2 <= hpa["minReplicas"] <= hpa["maxReplicas"]
    assert [(m["type"], m["resource"]["name"], m["resource"]["target"]["type"]) for m in hpa["metrics"]] == [
        ("Resource", "cpu", "Utilization")]
    # Utilisation is a share of the request: without one the HPA has nothing to divide by.
    assert "cpu" in _container(_one("Deployment", target["name"]))["resources"]["requests"]


def _selected(selector: dict[str, str]) -> list[dict[str, Any]]:
    """The workloads whose pods carry every label of the selector."""
    return [workload for workload in _workloads()
            if selector.items() <= workload["spec"]["template"]["metadata"]["labels"].items()]


def test_selectors_match_their_pods() -> None:
    """Services, the PDB and each workload's own selector pick exactly the pods meant, on declared ports."""
    for workload in _workloads():
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert _selected(workload["spec"]["selector"]["matchLabels"]) == [workload]
    for service in _of_kind("Service"):
        selector = service["spec"]["selector"]
        assert len(_selected(selector)) == 1, f"Service {service['metadata']['name']} selects {selector}"
        for port in service["spec"]["ports"]:
            _container_port(_selected(selector)[0], port.get("targetPort", port["port"]))
    pdb = _one("PodDisruptionBudget", "slotq-api")
    assert _selected(pdb["spec"]["selector"]["matchLabels"]) == [_one("Deployment", "slotq-api")]
    redis = _one("StatefulSet", "slotq-redis")
    assert _one("Service", redis["spec"]["serviceName"])["spec"]["clusterIP"] == "None"


def test_every_reference_exists() -> None:
    """Each ConfigMap, Secret, key and volume a pod names is in the manifests or generated by kustomize."""
    for workload in _workloads():
        pod, container = _pod(workload), _container(workload)
        for source in container.get("envFrom", []):
            if "configMapRef" in source:
                assert source["configMapRef"]["name"] in _config_maps()
            if "secretRef" in source:
                assert source["secretRef"]["name"] in _secrets()
        for var in container.get("env", []):
            ref = var.get("valueFrom", {})
            if "configMapKeyRef" in ref:
                assert ref["configMapKeyRef"]["key"] in _config_maps()[ref["configMapKeyRef"]["name"]]
            if "secretKeyRef" in ref:
                assert ref["secretKeyRef"]["key"] in _secrets()[ref["secretKeyRef"]["name"]]
        volumes = {volume["name"] for volume in pod.get("volumes", [])}
        volumes |= {claim["metadata"]["name"] for claim in workload["spec"].get("volumeClaimTemplates", [])}
        mounts = {mount["name"] for mount in container.get("volumeMounts", [])}
        assert mounts <= volumes, f"{workload['metadata']['name']} mounts {mounts - volumes}"


def test_config_map_holds_only_real_settings() -> None:
    """Every key of the ConfigMap is a SLOTQ_* setting that exists; so is each SLOTQ_* of the secrets."""
    known = _setting_names()
    for name, data in _config_maps().items():
        assert set(data) <= known, f"ConfigMap {name}: not settings: {sorted(set(data) - known)}"
        assert all(isinstance(value, str) for value in data.values()), f"ConfigMap {name}: a non-string"
    for name, data in _secrets().items():
        slotq = {key for key in data if key.startswith("SLOTQ_")}
        assert slotq <= known, f"Secret {name}: not settings: {sorted(slotq - known)}"


@pytest.mark.parametrize("name", ["slotq-api", "slotq-worker", "slotq-worker-xl"])
def test_pod_environment_is_valid(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment each pod starts with names only real settings and passes their validation."""
    env = _pod_env(_one("Deployment", name))
    unknown = {key for key in env if key.startswith("SLOTQ_")} - _setting_names()
    assert not unknown, f"{name}: not settings: {sorted(unknown)}"
    settings = _settings_of(_one("Deployment", name), monkeypatch)
    assert settings.redis_url == _config_maps()["slotq-config"]["SLOTQ_REDIS_URL"]


def _gpus(container: dict[str, Any], section: str) -> int:
    return int(container.get("resources", {}).get(section, {}).get("nvidia.com/gpu", 0))


def test_only_the_workers_ask_for_a_gpu() -> None:
    """Each worker asks for exactly one GPU (limit = request) and tolerates GPU taints; nothing else asks."""
    workers = ("slotq-worker", "slotq-worker-xl")
    for name in workers:
        worker = _container(_one("Deployment", name))
        assert _gpus(worker, "limits") == 1
        assert _gpus(worker, "requests") in (0, 1)  # unset: the kubelet copies the limit
        assert any(t["key"] == "nvidia.com/gpu" for t in _pod(_one("Deployment", name))["tolerations"])
    for workload in _workloads():
        if workload["metadata"]["name"] not in workers:
            container = _container(workload)
            name = workload["metadata"]["name"]
            assert _gpus(container, "limits") == _gpus(container, "requests") == 0, name


def test_worker_finishes_its_job_before_sigkill(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's grace period covers its longest job plus a minute; the API's covers its drain."""
    worker = _one("Deployment", "slotq-worker")
    settings = _settings_of(worker, monkeypatch)
    assert settings.device == "cuda"
    assert _pod(worker)["terminationGracePeriodSeconds"] >= settings.job_timeout_s + 60
    # A rollout must never need a spare GPU: the old pod goes (and drains) before the new one comes.
    assert worker["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0
    assert worker["spec"]["progressDeadlineSeconds"] > _pod(worker)["terminationGracePeriodSeconds"]
    api = _one("Deployment", "slotq-api")
    # gunicorn's graceful timeout is SLOTQ_DRAIN_S + 20 s (api/server.py).
    assert _pod(api)["terminationGracePeriodSeconds"] >= _settings_of(api, monkeypatch).drain_s + 20


def test_probes_ask_the_right_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    """The API's probes are /readyz and /healthz on its port; the worker's is /readyz on its metrics port."""
    api = _one("Deployment", "slotq-api")
    container = _container(api)
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    for probe in ("readinessProbe", "livenessProbe"):
        # The image's command serves on 8000.
        assert _container_port(api, container[probe]["httpGet"]["port"]) == 8000
    assert '"--port", "8000"' in DOCKERFILES["slotq-api"].read_text()
    worker = _one("Deployment", "slotq-worker")
    settings = _settings_of(worker, monkeypatch)
    probe = _container(worker)["readinessProbe"]["httpGet"]
    assert probe["path"] == "/readyz"  # 503 while Redis or the result store is away (worker/metrics.py)
    assert _container_port(worker, probe["port"]) == settings.worker_metrics_port
    # The kubelet probes the pod's IP: the default 127.0.0.1 would never answer it.
    assert settings.worker_metrics_host == "0.0.0.0"


def test_redis_keeps_the_queue_on_a_volume() -> None:
    """Redis runs with AOF into a claimed volume, behind the Service that SLOTQ_REDIS_URL names."""
    redis = _one("StatefulSet", "slotq-redis")
    container = _container(redis)
    args = " ".join(container["args"])
    assert "--appendonly yes" in args and "--appendfsync everysec" in args
    data_dir = re.search(r"--dir (\S+)", args)
    assert data_dir, "no --dir: redis would write where its image's WORKDIR happens to be"
    claims = {claim["metadata"]["name"] for claim in redis["spec"]["volumeClaimTemplates"]}
    assert {m["name"] for m in container["volumeMounts"] if m["mountPath"] == data_dir.group(1)} <= claims
    url = urlsplit(_config_maps()["slotq-config"]["SLOTQ_REDIS_URL"])
    service = _one("Service", url.hostname or "")
    assert url.port in {port["port"] for port in service["spec"]["ports"]}
    assert _selected(service["spec"]["selector"]) == [redis]


def test_pods_run_unprivileged() -> None:
    """Every pod runs as non-root, with seccomp, without privilege escalation, and with capped memory."""
    for workload in _workloads():
        name, pod, container = workload["metadata"]["name"], _pod(workload), _container(workload)
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
        assert pod.get("automountServiceAccountToken") is False, name
        assert container["securityContext"]["allowPrivilegeEscalation"] is False, name
        assert container["securityContext"]["capabilities"]["drop"] == ["ALL"], name
        assert {"cpu", "memory"} <= container["resources"]["requests"].keys(), name
        assert "memory" in container["resources"]["limits"], name
        if name in DOCKERFILES:
            # The uid the image creates its user with, so files it owns stay its own.
            uid = pod["securityContext"]["runAsUser"]
            assert f"--uid {uid} " in DOCKERFILES[name].read_text(), name


def _apply_patch(doc: dict[str, Any], operations: list[dict[str, Any]]) -> dict[str, Any]:
    """Apply JSON-patch `replace` and `add` operations to a copy of a document."""
    patched = copy.deepcopy(doc)
    for operation in operations:
        assert operation["op"] in ("replace", "add"), f"unchecked patch op {operation['op']}"
        *parents, last = operation["path"].strip("/").split("/")
        node = patched
        for part in parents:
            node = node[part]
        assert operation["op"] == "add" or last in node, f"replace of a missing {operation['path']}"
        node[last] = operation["value"]
    return patched


def test_prometheus_component_swaps_in_a_valid_trigger(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Prometheus alternative patches each ScaledObject into one that passes the same checks,
    on its own model's workers and line."""
    component = yaml.safe_load(COMPONENT.read_text())
    assert component["apiVersion"] == "kustomize.config.k8s.io/v1alpha1"
    patched = set()
    for patch in component["patches"]:
        target = patch["target"]
        assert (f"{target['group']}/{target['version']}", target["kind"]) == (KEDA, "ScaledObject")
        scaled = _apply_patch(_one("ScaledObject", target["name"]), yaml.safe_load(patch["patch"]))
        _check_scaled_object(scaled)
        [trigger] = scaled["spec"]["triggers"]
        assert trigger["type"] == "prometheus"
        query = trigger["metadata"]["query"]
        exported = "\n".join(path.read_text() for path in METRICS_SOURCES)
        for metric in set(re.findall(r"\bslotq_\w+", query)):
            assert f'"{metric}"' in exported, f"{metric} is not a metric slotq exports"
        target_deployment = _one("Deployment", scaled["spec"]["scaleTargetRef"]["name"])
        model = _settings_of(target_deployment, monkeypatch).model_name
        # Each API replica reports the whole line: max() over replicas, never a bare sum.
        assert f'max by (priority) (slotq_queue_depth{{model="{model}"}})' in query
        assert f'slotq_worker_info{{model="{model}"}}' in query
        patched.add(target["name"])
    assert patched == {doc["metadata"]["name"] for doc in _of_kind("ScaledObject")}


def _kustomize() -> list[str] | None:
    """Return a kustomize command line (kubectl's built-in one, or the standalone), or None."""
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    return None


def _build(directory: Path) -> subprocess.CompletedProcess[str]:
    command = _kustomize()
    assert command is not None
    return subprocess.run([*command, str(directory)], capture_output=True, text=True, timeout=60)


def test_kustomize_builds_the_manifests(tmp_path: Path) -> None:
    """kustomize builds deploy/ (only once secrets.env exists), namespaced, with the registry's images."""
    if _kustomize() is None:
        pytest.skip("neither kubectl nor kustomize is installed here")
    copied = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copied, ignore=shutil.ignore_patterns("secrets.env"))
    refused = _build(copied)
    assert refused.returncode != 0 and "secrets.env" in refused.stderr, "built without secrets.env"
    shutil.copy(copied / "secrets.env.example", copied / "secrets.env")
    built = _build(copied)
    assert built.returncode == 0, built.stderr
    docs = [doc for doc in yaml.safe_load_all(built.stdout) if doc]
    namespace = _kustomization()["namespace"]
    assert all(doc["metadata"].get("namespace") == namespace for doc in docs if doc["kind"] != "Namespace")
    images = {image["name"]: f"{image['newName']}:{image['newTag']}" for image in _kustomization()["images"]}
    for doc in docs:
        if doc["kind"] == "Deployment":
            container = doc["spec"]["template"]["spec"]["containers"][0]
            # The image each manifest names (both workers' is slotq-worker), as the registry has it.
            named = _container(_one("Deployment", doc["metadata"]["name"]))["image"]
            assert container["image"] == images[named]
    secret = next(doc for doc in docs if doc["kind"] == "Secret")
    assert secret["metadata"]["name"] == "slotq-secrets" and "KEDA_TOKEN" in secret["data"]
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(
        {"resources": ["../deploy"], "components": ["../deploy/prometheus"]}))
    with_prometheus = _build(overlay)
    assert with_prometheus.returncode == 0, with_prometheus.stderr
    scaled = next(doc for doc in yaml.safe_load_all(with_prometheus.stdout) if doc["kind"] == "ScaledObject")
    assert [trigger["type"] for trigger in scaled["spec"]["triggers"]] == ["prometheus"]
