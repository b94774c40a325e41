"""The Kubernetes manifests under deploy/k8s: kustomize builds every variant, the API's
own schemas accept every object (kubernetes-validate, strict: no unknown field, against
the newest Kubernetes release it knows), and the objects hold together: selectors match
labels, references name what exists, and the trainers' settings are ones hora accepts
(read by hora's own settings parser, the coordinator's command by its own).

No cluster is started. Needs ``kubectl kustomize`` (or ``kustomize build``) and kubernetes-validate
(the ``deploy`` extra; ``make deploy-deps`` installs it).
"""

from __future__ import annotations

import base64
import copy
import shutil
from pathlib import Path

import pytest
import yaml
from deploy_tools import ROOT, require, run

missing = []
if shutil.which("kubectl") is not None:
    KUSTOMIZE = ["kubectl", "kustomize"]
elif shutil.which("kustomize") is not None:
    KUSTOMIZE = ["kustomize", "build"]
else:
    missing.append("kubectl or kustomize (for kubectl kustomize)")
try:
    from kubernetes_validate import utils as kubernetes_validate
except ImportError:
    missing.append("kubernetes-validate (pip install -e '.[deploy]')")
require("Kubernetes manifests", missing)

from hora.settings import ENV_VARS, Settings  # noqa: E402
from hora_coordinator.settings import parse_command_line  # noqa: E402

pytestmark = [pytest.mark.deploy, pytest.mark.timeout(120)]

VERSION = kubernetes_validate.latest_version()
TOKEN = "0123456789abcdef0123456789abcdef"
# Kinds whose schemas are not Kubernetes' own (CRDs): checked by their references below.
CUSTOM = {"monitoring.coreos.com/v1"}
VARIANTS = {
    ".": "the default: deploy/k8s",
    "job": "a fixed-size Indexed Job",
    "elastic": "an elastic Deployment",
    "job-monitoring": "the job with the monitoring component",
    "elastic-monitoring": "the elastic one with the monitoring component",
}
KNOWN_ENV = {name for var in ENV_VARS for name in var.names}


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """deploy/k8s, copied, with a token file, and overlays that add the monitoring
    component as a user's would."""
    root = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(ROOT / "deploy" / "k8s", root,
                    ignore=shutil.ignore_patterns("token.env"))
    (root / "base" / "token.env").write_text(f"HORA_TOKEN={TOKEN}\n")
    for trainers in ("job", "elastic"):
        overlay = root / f"{trainers}-monitoring"
        overlay.mkdir()
        (overlay / "kustomization.yaml").write_text(
            f"resources: [../{trainers}]\ncomponents: [../components/monitoring]\n")
    return root


def kustomize(path: Path) -> list[dict]:
    out = run([*KUSTOMIZE, str(path)], timeout=60).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.fixture(scope="module")
def built(tree) -> dict[str, list[dict]]:
    return {variant: kustomize(tree / variant) for variant in VARIANTS}


def one(docs: list[dict], kind: str, component: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (
        component is None
        or d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == component)]
    assert len(found) == 1, f"{len(found)} {kind} ({component}) in {[d['kind'] for d in docs]}"
    return found[0]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def pod_labels(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"]["labels"]


def container(workload: dict) -> dict:
    (only,) = pod_spec(workload)["containers"]
    return only


def selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # no matchExpressions here
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def environment(workload: dict, **from_fields: str) -> dict[str, str]:
    """The container's environment as a pod would see it: secrets and the downward API
    filled in (the secret from the test's token file, fields from ``from_fields``)."""
    env = {}
    for var in container(workload)["env"]:
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "secretKeyRef" in var["valueFrom"]:
            env[var["name"]] = TOKEN
        else:
            field = var["valueFrom"]["fieldRef"]["fieldPath"]
            assert field in from_fields, f"{var['name']} comes from {field}"
            env[var["name"]] = from_fields[field]
    return env


def test_every_variant_builds_and_the_api_schemas_accept_every_object(built):
    for variant, docs in built.items():
        kinds = sorted(d["kind"] for d in docs)
        assert {"Deployment", "Service", "Secret", "NetworkPolicy"} <= set(kinds), variant
        for doc in docs:
            if doc["apiVersion"] in CUSTOM:
                continue
            try:
                kubernetes_validate.validate(doc, VERSION, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{VARIANTS[variant]}: {doc['kind']}/{doc['metadata']['name']} "
                            f"is not valid for Kubernetes {VERSION}: {exc.message} at "
                            f"{'.'.join(map(str, exc.path))}")
    assert sorted(d["kind"] for d in built["job-monitoring"] if d["apiVersion"] in CUSTOM) == [
        "ServiceMonitor"]


def test_strict_validation_rejects_a_misspelt_field(built):
    deployment = copy.deepcopy(one(built["job"], "Deployment", "coordinator"))
    probe = container(deployment).pop("readinessProbe")
    container(deployment)["readinesProbe"] = probe
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSION, strict=True)


def test_without_the_token_file_kustomize_names_it(tree, tmp_path):
    bare = tmp_path / "k8s"
    shutil.copytree(tree, bare, ignore=shutil.ignore_patterns("token.env"))
    proc = run([*KUSTOMIZE, str(bare / "job")], timeout=60, check=False)
    assert proc.returncode != 0
    assert "token.env" in proc.stderr


def test_the_default_is_the_fixed_size_job(built):
    assert built["."] == built["job"]


def test_the_coordinator_serves_on_the_ports_its_probes_and_service_use(built):
    docs = built["job"]
    deployment = one(docs, "Deployment", "coordinator")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert selects(deployment["spec"]["selector"], pod_labels(deployment))
    coordinator = container(deployment)
    ports = {p["name"]: p["containerPort"] for p in coordinator["ports"]}
    # The command is one hora-coordinator accepts, serving where the ports say.
    assert coordinator["command"][0] == "hora-coordinator"
    settings = parse_command_line(coordinator["command"][1:]).settings
    assert (settings.host, settings.grpc_port, settings.http_port) == (
        "0.0.0.0", ports["grpc"], ports["http"])
    # Readiness: the gRPC health service; liveness: /healthz. Neither needs the token.
    assert coordinator["readinessProbe"]["grpc"]["port"] == ports["grpc"]
    assert coordinator["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    # The image's user (deploy/Dockerfile), not root.
    security = pod_spec(deployment)["securityContext"]
    assert security["runAsNonRoot"] and security["runAsUser"] == 10001
    service = one(docs, "Service", "coordinator")
    assert selects({"matchLabels": service["spec"]["selector"]}, pod_labels(deployment))
    assert {(p["name"], p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {
        ("grpc", ports["grpc"], "grpc"), ("http", ports["http"], "http")}


def test_the_token_is_a_secret_that_every_workload_reads(built):
    for variant in ("job", "elastic"):
        docs = built[variant]
        secret = one(docs, "Secret")
        assert base64.b64decode(secret["data"]["HORA_TOKEN"]).decode() == TOKEN
        for workload in (d for d in docs if d["kind"] in ("Deployment", "Job")):
            (ref,) = [v["valueFrom"]["secretKeyRef"] for v in container(workload)["env"]
                      if v["name"] == "HORA_TOKEN"]
            assert ref == {"name": secret["metadata"]["name"], "key": "HORA_TOKEN"}


def trainer_checks(docs: list[dict], trainers: dict, env: dict[str, str]) -> Settings:
    """What both kinds of trainers need; the settings hora reads from their environment."""
    assert set(env) <= KNOWN_ENV, f"unknown to hora: {set(env) - KNOWN_ENV}"
    service = one(docs, "Service", "coordinator")
    grpc_port = {p["name"]: p["port"] for p in service["spec"]["ports"]}["grpc"]
    assert env["HORA_COORDINATOR"] == f"{service['metadata']['name']}:{grpc_port}"
    settings = Settings.from_env(env)
    trainer = container(trainers)
    assert trainer["image"] == container(one(docs, "Deployment", "coordinator"))["image"]
    assert set(trainer["resources"]["requests"]) == {"cpu", "memory"}
    # A /dev/shm in memory, not the runtime's 64 MiB default.
    (shm,) = [m for m in trainer["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (volume,) = [v for v in pod_spec(trainers)["volumes"] if v["name"] == shm["name"]]
    assert volume["emptyDir"]["medium"] == "Memory"
    assert pod_spec(trainers)["securityContext"]["runAsNonRoot"]
    return settings


def test_the_indexed_job_starts_n_trainers_that_wait_for_a_world_of_n(built):
    docs = built["job"]
    job = one(docs, "Job")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert pod_spec(job)["restartPolicy"] == "Never"
    env = environment(job, **{
        "metadata.labels['batch.kubernetes.io/job-name']": job["metadata"]["name"],
        "metadata.annotations['batch.kubernetes.io/job-completion-index']": "1",
        "status.podIP": "10.0.0.7"})
    settings = trainer_checks(docs, job, env)
    assert spec["parallelism"] == spec["completions"] == settings.size > 1
    assert not settings.is_elastic
    assert (settings.rank, settings.data_plane_address) == (1, "10.0.0.7")
    assert settings.job_id == job["metadata"]["name"]


def test_the_elastic_trainers_are_a_deployment_between_min_and_max(built):
    docs = built["elastic"]
    trainers = one(docs, "Deployment", "trainer")
    assert selects(trainers["spec"]["selector"], pod_labels(trainers))
    settings = trainer_checks(docs, trainers, environment(trainers, **{
        "status.podIP": "10.0.0.8"}))
    assert settings.is_elastic
    assert settings.min_size <= trainers["spec"]["replicas"] <= settings.max_size
    assert settings.size == trainers["spec"]["replicas"]
    # Once trained the pod idles: a Deployment would restart it, and it would join
    # the finished job again.
    command = " ".join(container(trainers)["command"])
    assert "pytorch_digits_elastic.py" in command and "sleep infinity" in command


@pytest.mark.parametrize("variant", ["job", "elastic"])
def test_network_policies_let_only_trainers_reach_the_coordinator_and_each_other(
        built, variant):
    docs = built[variant]
    coordinator = one(docs, "Deployment", "coordinator")
    trainers = next(d for d in docs if d["kind"] in ("Job", "Deployment")
                    and d["metadata"]["labels"]["app.kubernetes.io/component"] == "trainer")
    other = {"app": "something-else"}
    policies = {p["metadata"]["name"]: p["spec"] for p in docs if p["kind"] == "NetworkPolicy"}

    def admitted(to: dict, source: dict, port: str | None) -> bool:
        """Whether the policies that select ``to`` let ``source`` pods in on ``port``."""
        applying = [p for p in policies.values() if selects(p["podSelector"], to)]
        assert applying, f"no policy selects {to}"
        for policy in applying:
            assert policy["policyTypes"] == ["Ingress"]
            for rule in policy.get("ingress", []):
                peers = [selects(peer["podSelector"], source) for peer in rule["from"]]
                ports = [p["port"] for p in rule.get("ports", [])]
                if any(peers) and (not ports or port in ports):
                    return True
        return False

    assert admitted(pod_labels(coordinator), pod_labels(trainers), "grpc")
    assert not admitted(pod_labels(coordinator), other, "grpc")
    assert not admitted(pod_labels(coordinator), pod_labels(trainers), "http")
    assert admitted(pod_labels(trainers), pod_labels(trainers), "any")
    assert not admitted(pod_labels(trainers), other, "any")
    assert not admitted(pod_labels(trainers), pod_labels(coordinator), "any")


def test_the_service_monitor_scrapes_the_coordinator_with_the_token(built):
    docs = built["job-monitoring"]
    monitor = one(docs, "ServiceMonitor")
    service = one(docs, "Service", "coordinator")
    secret = one(docs, "Secret")
    assert selects(monitor["spec"]["selector"], service["metadata"]["labels"])
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    credentials = endpoint["authorization"]["credentials"]
    # The generated Secret's name, hash suffix included.
    assert credentials == {"name": secret["metadata"]["name"], "key": "HORA_TOKEN"}
    policy = next(p for p in docs if p["kind"] == "NetworkPolicy"
                  and p["metadata"]["name"] == "hora-coordinator-metrics")
    assert selects(policy["spec"]["podSelector"],
                   pod_labels(one(docs, "Deployment", "coordinator")))
    assert [p["port"] for p in policy["spec"]["ingress"][0]["ports"]] == [endpoint["port"]]


def test_the_monitoring_component_carries_the_grafana_dashboard(built):
    for variant in ("job-monitoring", "elastic-monitoring"):
        configmap = one(built[variant], "ConfigMap")
        # Grafana's dashboard sidecar (kube-prometheus-stack) loads ConfigMaps so labelled.
        assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
        (name, text) = configmap["data"].popitem()
        assert name == "hora-dashboard.json"
        # The component's copy is the dashboard tests/dashboard checks against /metrics.
        assert text == (ROOT / "deploy" / "grafana" / "hora-dashboard.json").read_text()
    assert not [d for d in built["job"] if d["kind"] == "ConfigMap"]
