"""Static checks of the Kubernetes manifests under deploy/: they parse, validate and agree."""

import copy
import functools
import json
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
# Opt-in: one GPU serving a folder of models (its workers, their ScaledObject, the API's mount).
FOLDER_COMPONENT = DEPLOY / "folder" / "kustomization.yaml"
METRICS_SOURCES = [ROOT / "api" / "metrics.py", ROOT / "worker" / "metrics.py"]
# By image, as the manifests name it (each Deployment of the API or a worker runs one of these).
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
# What kustomize fills in for a ScaledObject's scalingModifiers (KEDA's reference, as above).
SCALING_MODIFIERS = {"formula", "target", "activationTarget", "metricType"}
# SDXL's weights in float16, about (docs/models.md): what a pipeline kept in host memory costs at most.
PIPELINE_GIB = 7
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


Docs = tuple[dict[str, Any], ...]


def _of_kind(kind: str, docs: Docs | None = None) -> list[dict[str, Any]]:
    """Return every listed object of one kind (of the default install, unless docs are given)."""
    return [doc for doc in (_resources() if docs is None else docs) if doc["kind"] == kind]


def _one(kind: str, name: str, docs: Docs | None = None) -> dict[str, Any]:
    """Return the listed object of this kind and name."""
    found = [doc for doc in _of_kind(kind, docs) if doc["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def _workloads(docs: Docs | None = None) -> list[dict[str, Any]]:
    """Every object that runs pods."""
    return _of_kind("Deployment", docs) + _of_kind("StatefulSet", docs)


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


def _settings_of(workload: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                 overrides: dict[str, str] | None = None) -> Settings:
    """The settings the workload's process reads from its environment (raises on a bad value),
    with some values replaced (a mounted folder by one of the test's)."""
    for key in list(os.environ):
        if key.startswith("SLOTQ_"):
            monkeypatch.delenv(key)
    for key, value in (_pod_env(workload) | (overrides or {})).items():
        monkeypatch.setenv(key, value)
    return Settings()


@functools.cache
def _folder_component() -> dict[str, Any]:
    """Return deploy/folder/kustomization.yaml."""
    data = yaml.safe_load(FOLDER_COMPONENT.read_text())
    assert isinstance(data, dict), "folder/kustomization.yaml is not a mapping"
    return data


@functools.cache
def _with_folder() -> Docs:
    """The default install with the folder component: its patches applied, its objects added."""
    docs = list(_resources())
    for patch in _folder_component()["patches"]:
        target = patch["target"]
        [index] = [i for i, doc in enumerate(docs)
                   if (doc["apiVersion"], doc["kind"], doc["metadata"]["name"])
                   == (f"{target['group']}/{target['version']}", target["kind"], target["name"])]
        docs[index] = _apply_patch(docs[index], yaml.safe_load(patch["patch"]))
    folder = FOLDER_COMPONENT.parent
    added = [doc for name in _folder_component()["resources"] for doc in _load_all(folder / name)]
    return (*docs, *added)


# The default install, and the default install with the folder component: the same checks hold for both.
INSTALLS = ["default", "folder"]


def _install(name: str) -> Docs:
    return _with_folder() if name == "folder" else _resources()


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
    assert {KUSTOMIZATION, COMPONENT, FOLDER_COMPONENT} <= set(files)
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
    accounted = {KUSTOMIZATION, DEPLOY / ".gitignore"} | {DEPLOY / name for name in manifests}
    for component in (COMPONENT, FOLDER_COMPONENT):
        listed = yaml.safe_load(component.read_text()).get("resources", [])
        accounted |= {component} | {component.parent / name for name in listed}
    ignored = (DEPLOY / ".gitignore").read_text().split()
    for generator in kustomization["secretGenerator"]:
        for env in generator.get("envs", []):
            assert env in ignored, f"{env} is not in deploy/.gitignore"
            assert (DEPLOY / f"{env}.example").is_file(), f"no {env}.example beside it"
            accounted |= {DEPLOY / env, DEPLOY / f"{env}.example"}
    stray = {path for path in DEPLOY.rglob("*") if path.is_file()} - accounted
    assert not stray, f"files in deploy/ that no kustomization uses: {sorted(map(str, stray))}"
    assert yaml.safe_load(COMPONENT.read_text())["kind"] == "Component"
    assert yaml.safe_load(FOLDER_COMPONENT.read_text())["kind"] == "Component"


def _keda_hpa(scaled_object: dict[str, Any]) -> dict[str, Any]:
    """The HPA KEDA makes of a ScaledObject: it hands `advanced.horizontalPodAutoscalerConfig.behavior`
    to it as it is, so that part is checked as one."""
    scaled = scaled_object["spec"]
    target = {"apiVersion": "apps/v1", "kind": "Deployment", "name": scaled["scaleTargetRef"]["name"]}
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": f"keda-hpa-{scaled_object['metadata']['name']}"},
            "spec": {"scaleTargetRef": target,
                     "minReplicas": max(1, scaled["minReplicaCount"]),
                     "maxReplicas": scaled["maxReplicaCount"],
                     "behavior": scaled["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]}}


def _schema_problems(docs: list[dict[str, Any]], version: str) -> list[str]:
    """What Kubernetes' own schemas refuse in these objects, strictly (no unknown field)."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    if version == "latest":
        version = kubernetes_validate.latest_version()
    problems = []
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = "/".join(map(str, exc.absolute_path))
            problems.append(f"on Kubernetes {version}: {doc['kind']}/{doc['metadata']['name']} at {where}: "
                            f"{exc.message}")
    return problems


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_core_objects_match_kubernetes_schemas(version: str) -> None:
    """Every built-in object validates, strictly (no unknown field), against Kubernetes' own schemas."""
    secrets = [{"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "stringData": data}
               for name, data in _secrets().items()]
    core = [doc for doc in _resources() if doc["apiVersion"] != KEDA]
    kinds = {"Deployment", "Service", "HorizontalPodAutoscaler", "StatefulSet", "ConfigMap", "Namespace"}
    assert {doc["kind"] for doc in core} >= kinds
    problems = _schema_problems([*core, *secrets, _keda_hpa(_one("ScaledObject", "slotq-worker"))], version)
    assert not problems, "\n".join(problems)


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


def _check_scaled_object(scaled: dict[str, Any], docs: Docs | None = None) -> None:
    """A ScaledObject's own fields, its target (among docs) and each trigger."""
    spec = scaled["spec"]
    assert scaled["apiVersion"] == KEDA
    assert set(spec) <= SCALED_OBJECT_FIELDS, f"unknown fields {set(spec) - SCALED_OBJECT_FIELDS}"
    target = spec["scaleTargetRef"]
    assert target.get("apiVersion", "apps/v1") == "apps/v1"
    assert target.get("kind", "Deployment") == "Deployment"
    assert _container(_one("Deployment", target["name"], docs))["name"] == "worker"
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


def _selected(selector: dict[str, str], docs: Docs | None = None) -> list[dict[str, Any]]:
    """The workloads whose pods carry every label of the selector."""
    return [workload for workload in _workloads(docs)
            if selector.items() <= workload["spec"]["template"]["metadata"]["labels"].items()]


@pytest.mark.parametrize("install", INSTALLS)
def test_selectors_match_their_pods(install: str) -> None:
    """Services, the PDB and each workload's own selector pick exactly the pods meant, on declared ports."""
    docs = _install(install)
    for workload in _workloads(docs):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert _selected(workload["spec"]["selector"]["matchLabels"], docs) == [workload]
    for service in _of_kind("Service", docs):
        selector = service["spec"]["selector"]
        assert len(_selected(selector, docs)) == 1, f"{service['metadata']['name']} selects {selector}"
        for port in service["spec"]["ports"]:
            _container_port(_selected(selector, docs)[0], port.get("targetPort", port["port"]))
    pdb = _one("PodDisruptionBudget", "slotq-api", docs)
    assert _selected(pdb["spec"]["selector"]["matchLabels"], docs) == [_one("Deployment", "slotq-api", docs)]
    redis = _one("StatefulSet", "slotq-redis", docs)
    assert _one("Service", redis["spec"]["serviceName"], docs)["spec"]["clusterIP"] == "None"


@pytest.mark.parametrize("install", INSTALLS)
def test_every_reference_exists(install: str) -> None:
    """Each ConfigMap, Secret, key and volume a pod names is in the manifests or generated by kustomize."""
    for workload in _workloads(_install(install)):
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


@pytest.mark.parametrize(("install", "workers"), [
    ("default", {"slotq-worker", "slotq-worker-xl"}),
    ("folder", {"slotq-worker", "slotq-worker-xl", "slotq-worker-folder"})])
def test_only_the_workers_ask_for_a_gpu(install: str, workers: set[str]) -> None:
    """Each worker asks for exactly one GPU (limit = request) and tolerates GPU taints; nothing else asks."""
    docs = _install(install)
    deployments = _of_kind("Deployment", docs)
    assert {doc["metadata"]["name"] for doc in deployments if _container(doc)["name"] == "worker"} == workers
    for name in workers:
        worker = _container(_one("Deployment", name, docs))
        assert _gpus(worker, "limits") == 1
        assert _gpus(worker, "requests") in (0, 1)  # unset: the kubelet copies the limit
        assert any(t["key"] == "nvidia.com/gpu" for t in _pod(_one("Deployment", name, docs))["tolerations"])
    for workload in _workloads(docs):
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


@pytest.mark.parametrize("install", INSTALLS)
def test_pods_run_unprivileged(install: str) -> None:
    """Every pod runs as non-root, with seccomp, without privilege escalation, and with capped memory."""
    for workload in _workloads(_install(install)):
        name, pod, container = workload["metadata"]["name"], _pod(workload), _container(workload)
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
        assert pod.get("automountServiceAccountToken") is False, name
        assert container["securityContext"]["allowPrivilegeEscalation"] is False, name
        assert container["securityContext"]["capabilities"]["drop"] == ["ALL"], name
        assert {"cpu", "memory"} <= container["resources"]["requests"].keys(), name
        assert "memory" in container["resources"]["limits"], name
        if container["image"] in DOCKERFILES:
            # The uid the image creates its user with, so files it owns stay its own.
            uid = pod["securityContext"]["runAsUser"]
            assert f"--uid {uid} " in DOCKERFILES[container["image"]].read_text(), name


def _apply_patch(doc: dict[str, Any], operations: list[dict[str, Any]]) -> dict[str, Any]:
    """Apply JSON-patch `replace` and `add` operations to a copy of a document (`-` appends to a list;
    an `add` of a member that exists would replace it, which is refused here)."""
    patched = copy.deepcopy(doc)
    for operation in operations:
        assert operation["op"] in ("replace", "add"), f"unchecked patch op {operation['op']}"
        *parents, last = operation["path"].strip("/").split("/")
        node = patched
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if isinstance(node, list):
            assert operation["op"] == "add" and last == "-", f"unchecked list patch {operation['path']}"
            node.append(operation["value"])
            continue
        assert (last in node) == (operation["op"] == "replace"), f"{operation['op']} at {operation['path']}"
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


def test_folder_component_is_opt_in() -> None:
    """The default install neither lists the folder component nor holds its objects; the component adds
    one worker Deployment and its ScaledObject, and only adds to the API what it reads the folder with."""
    assert (_folder_component()["apiVersion"], _folder_component()["kind"]) == (
        "kustomize.config.k8s.io/v1alpha1", "Component")
    assert "folder" not in _kustomization().get("components", [])
    names = {(doc["kind"], doc["metadata"]["name"]) for doc in _resources()}
    added = {(doc["kind"], doc["metadata"]["name"]) for doc in _with_folder()} - names
    assert added == {("Deployment", "slotq-worker-folder"), ("ScaledObject", "slotq-worker-folder")}
    assert "SLOTQ_MODELS_DIR" not in _pod_env(_one("Deployment", "slotq-api"))
    before, after = _one("Deployment", "slotq-api"), _one("Deployment", "slotq-api", _with_folder())
    assert _pod(after)["volumes"][:-1] == _pod(before)["volumes"]
    assert _container(after)["volumeMounts"][:-1] == _container(before)["volumeMounts"]
    assert [var["name"] for var in _container(after)["env"]] == ["SLOTQ_MODELS_DIR"]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_folder_objects_match_kubernetes_schemas(version: str) -> None:
    """What the folder component adds or changes validates as the default install does: the worker,
    the API with the folder, the HPA KEDA makes of the ScaledObject, and the ScaledObject's own fields."""
    docs = _with_folder()
    changed = [doc for doc in docs if doc not in _resources()]
    assert {doc["metadata"]["name"] for doc in changed} == {"slotq-api", "slotq-worker-folder"}
    scaled = _one("ScaledObject", "slotq-worker-folder", docs)
    _check_scaled_object(scaled, docs)
    core = [doc for doc in changed if doc["apiVersion"] != KEDA]
    problems = _schema_problems([*core, _keda_hpa(scaled)], version)
    assert not problems, "\n".join(problems)


def _write_model(folder: Path, pipeline: str) -> None:
    """A diffusers folder as the folder's reader sees one: its model_index.json (no weights needed)."""
    folder.mkdir(parents=True)
    (folder / "model_index.json").write_text(json.dumps({"_class_name": pipeline}))


def test_folder_is_mounted_read_only_at_one_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The worker and the API mount the one claim read-only where SLOTQ_MODELS_DIR says, apart from the
    worker's hub cache; with models there, the worker serves each of them and the API offers them."""
    docs = _with_folder()
    worker, api = _one("Deployment", "slotq-worker-folder", docs), _one("Deployment", "slotq-api", docs)
    mounted = set()
    for workload in (worker, api):
        folder = _pod_env(workload)["SLOTQ_MODELS_DIR"]
        [mount] = [m for m in _container(workload)["volumeMounts"] if m["mountPath"] == folder]
        [volume] = [v for v in _pod(workload)["volumes"] if v["name"] == mount["name"]]
        assert mount.get("readOnly") is True, workload["metadata"]["name"]
        assert volume["persistentVolumeClaim"].get("readOnly") is True, workload["metadata"]["name"]
        mounted.add((volume["persistentVolumeClaim"]["claimName"], folder))
    [(claim, folder)] = mounted
    # The user's claim, holding the models: one made here would start empty.
    assert claim not in {doc["metadata"]["name"] for doc in _of_kind("PersistentVolumeClaim", docs)}
    # The hub cache stays writable and apart: a single file's configs, the tiny models, are written there.
    found = re.search(r"HF_HOME=(\S+)", DOCKERFILES["slotq-worker"].read_text())
    assert found, "the worker image sets no HF_HOME"
    writable = {m["mountPath"] for m in _container(worker)["volumeMounts"] if not m.get("readOnly")}
    assert found[1] in writable and not Path(folder).is_relative_to(found[1])
    _write_model(tmp_path / "anime", "StableDiffusionPipeline")
    _write_model(tmp_path / "photo", "StableDiffusionXLPipeline")
    # The layout the manifest's comment asks for: configs/<family>, no model of its own.
    _write_model(tmp_path / "configs" / "sd", "StableDiffusionPipeline")
    local = {"SLOTQ_MODELS_DIR": str(tmp_path)}
    settings = _settings_of(worker, monkeypatch, local)
    assert settings.worker_models == ["*"] and settings.served_models == ["anime", "photo"]
    # The pod's hub cache is an emptyDir and nothing is downloaded: a single file's configs come from
    # the folder, where the families with configs of their own have them.
    for family in ("sd", "sdxl"):
        assert Path(settings.checkpoint_configs[family]).is_relative_to(folder), family
    offered = _settings_of(api, monkeypatch, local).offered_models
    assert list(offered)[:2] == ["default", "xl"]
    assert {"anime": "sd", "photo": "sdxl"}.items() <= offered.items()


def _gibibytes(quantity: str) -> float:
    """A memory quantity (Gi or Mi) in GiB."""
    units = {"Gi": 1, "Mi": 1 / 1024}
    return float(quantity[:-2]) * units[quantity[-2:]]


def test_folder_worker_runs_as_the_others_do(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The folder's worker finishes its job before SIGKILL, rolls without a spare GPU, is probed on its
    metrics port, and its memory limit holds the pipelines it keeps in host memory."""
    worker = _one("Deployment", "slotq-worker-folder", _with_folder())
    _write_model(tmp_path / "anime", "StableDiffusionPipeline")
    settings = _settings_of(worker, monkeypatch, {"SLOTQ_MODELS_DIR": str(tmp_path)})
    assert settings.device == "cuda" and settings.worker_name == POD_NAME
    assert _pod(worker)["terminationGracePeriodSeconds"] >= settings.job_timeout_s + 60
    assert worker["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0
    assert worker["spec"]["progressDeadlineSeconds"] > _pod(worker)["terminationGracePeriodSeconds"]
    probe = _container(worker)["readinessProbe"]["httpGet"]
    assert probe["path"] == "/readyz"
    assert _container_port(worker, probe["port"]) == settings.worker_metrics_port
    # The worker measures the node's free memory, not the pod's limit (worker/models.py): the limit must
    # hold the host cache, a model being loaded and the running one.
    limit = _gibibytes(_container(worker)["resources"]["limits"]["memory"])
    assert limit >= (settings.host_model_cache + 2) * PIPELINE_GIB


def test_folder_scales_on_the_folders_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    """The folder's ScaledObject targets its Deployment and counts the jobs of the folder's models, from
    GET /v1/queue: every line's (`waiting`) less those of the models with workers of their own."""
    from api.openapi import QUEUE_SCHEMA

    docs = _with_folder()
    spec = _one("ScaledObject", "slotq-worker-folder", docs)["spec"]
    assert spec["scaleTargetRef"]["name"] == "slotq-worker-folder"
    modifiers = spec["advanced"]["scalingModifiers"]
    assert set(modifiers) <= SCALING_MODIFIERS, f"unknown fields {set(modifiers) - SCALING_MODIFIERS}"
    assert _is_number(modifiers["target"]) and float(modifiers["target"]) > 0
    assert modifiers.get("metricType", "AverageValue") == "AverageValue"
    url = _one("ScaledObject", "slotq-worker")["spec"]["triggers"][0]["metadata"]["url"]
    reads = {}
    for trigger in spec["triggers"]:
        assert (trigger["type"], trigger["metadata"]["url"]) == ("metrics-api", url)
        assert trigger["metadata"].get("aggregateFromKubeServiceEndpoints", "false") == "false"
        assert trigger["metadata"]["authMode"] == "bearer"
        assert _one("TriggerAuthentication", trigger["authenticationRef"]["name"], docs)
        # The formula's names: a hyphen would read as a minus there.
        assert re.fullmatch(r"[a-z][a-z_]*", trigger["name"]), trigger["name"]
        reads[trigger["name"]] = trigger["metadata"]["valueLocation"]
    every, *others = (term.strip() for term in modifiers["formula"].split(" - "))
    assert {every, *others} == set(reads) and len(others) == len(reads) - 1
    assert reads[every] == "waiting" and QUEUE_SCHEMA["properties"]["waiting"]["type"] == "integer"
    # Less exactly the lines of the models whose workers are Deployments of their own.
    own = {_settings_of(doc, monkeypatch).model_name for doc in _of_kind("Deployment")
           if _container(doc)["name"] == "worker"}
    assert {reads[name] for name in others} == {f"models.{model}.waiting" for model in own}
    # An answer of GET /v1/queue, read as KEDA reads it (a GJSON path of plain keys).
    answer: dict[str, Any] = {"waiting": 9, "models": {"default": {"waiting": 3}, "xl": {"waiting": 1},
                                                       "anime": {"waiting": 4}, "photo": {"waiting": 1}}}

    def value(path: str) -> int:
        node: Any = answer
        for key in path.split("."):
            node = node[key]
        return int(node)

    assert value(reads[every]) - sum(value(reads[name]) for name in others) == 5  # anime's 4 and photo's 1


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
    assert "slotq-worker-folder" not in {doc["metadata"]["name"] for doc in docs}


def test_kustomize_builds_the_folder_component(tmp_path: Path) -> None:
    """Listed in deploy/kustomization.yaml as its comment says, the folder component builds: its objects
    namespaced and on the registry's image, the API with the folder, every built-in object valid."""
    if _kustomize() is None:
        pytest.skip("neither kubectl nor kustomize is installed here")
    copied = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copied, ignore=shutil.ignore_patterns("secrets.env"))
    shutil.copy(copied / "secrets.env.example", copied / "secrets.env")
    kustomization = yaml.safe_load((copied / "kustomization.yaml").read_text())
    (copied / "kustomization.yaml").write_text(yaml.safe_dump({**kustomization, "components": ["folder"]}))
    built = _build(copied)
    assert built.returncode == 0, built.stderr
    docs = tuple(doc for doc in yaml.safe_load_all(built.stdout) if doc)
    namespace = _kustomization()["namespace"]
    assert all(doc["metadata"].get("namespace") == namespace for doc in docs if doc["kind"] != "Namespace")
    images = {image["name"]: f"{image['newName']}:{image['newTag']}" for image in _kustomization()["images"]}
    assert _container(_one("Deployment", "slotq-worker-folder", docs))["image"] == images["slotq-worker"]
    assert _one("ScaledObject", "slotq-worker-folder", docs)
    api = _one("Deployment", "slotq-api", docs)
    assert _container(api)["env"] == _container(_one("Deployment", "slotq-api", _with_folder()))["env"]
    assert "model-folder" in {volume["name"] for volume in _pod(api)["volumes"]}
    problems = _schema_problems([doc for doc in docs if doc["apiVersion"] != KEDA], "latest")
    assert not problems, "\n".join(problems)
