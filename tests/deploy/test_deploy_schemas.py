"""deploy/: docker compose and Kubernetes manifests are valid against their published schemas,
offline (tests/deploy/schemas/, see vendor.py there for where each schema comes from), and wired
together: GPU, host IPC, the socket hostPath, probes, selectors, and the same alert rules.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from kvalloc.server.cli import COMMANDS
from referencing import Registry, Resource

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SCHEMAS = Path(__file__).parent / "schemas"
K8S_SCHEMAS = SCHEMAS / "kubernetes" / "v1.34.0"


class ComposeLoader(yaml.SafeLoader):
    """YAML plus compose's ``!reset`` tag (an override file removing a base value)."""


ComposeLoader.add_constructor("!reset", lambda loader, node: None)


def load_compose(name: str) -> dict[str, Any]:
    return yaml.load((DEPLOY / name).read_text(), Loader=ComposeLoader)


KUSTOMIZATION = DEPLOY / "k8s" / "kustomization.yaml"


def manifest_files() -> list[Path]:
    return sorted(p for p in (DEPLOY / "k8s").glob("*.yaml") if p != KUSTOMIZATION)


def load_k8s() -> dict[str, dict[str, Any]]:
    """Every manifest under deploy/k8s (the kustomization is not one), keyed by kind."""
    docs = [d for p in manifest_files() for d in yaml.safe_load_all(p.read_text()) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs), "one manifest per kind"
    return by_kind


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


K8S_SCHEMA_FILES = {
    ("apps/v1", "DaemonSet"): K8S_SCHEMAS / "daemonset-apps-v1.json",
    ("v1", "Service"): K8S_SCHEMAS / "service-v1.json",
    ("v1", "Namespace"): K8S_SCHEMAS / "namespace-v1.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"):
        SCHEMAS / "monitoring.coreos.com" / "servicemonitor-v1.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"):
        SCHEMAS / "monitoring.coreos.com" / "prometheusrule-v1.json",
}


def k8s_errors(doc: dict[str, Any]) -> list[str]:
    schema = _json(K8S_SCHEMA_FILES[(doc["apiVersion"], doc["kind"])])
    definitions = Resource.from_contents(_json(K8S_SCHEMAS / "_definitions.json"))
    registry = Registry().with_resource("https://kubernetes.io/api/_definitions.json", definitions)
    validator = jsonschema.Draft202012Validator(schema, registry=registry)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(doc)]


def compose_errors(doc: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft7Validator(_json(SCHEMAS / "compose-spec.json"))
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(doc)]


# ---------------------------------------------------------------- schemas


@pytest.mark.parametrize("name", ["docker-compose.yml", "docker-compose.cpu.yml"])
def test_compose_files_are_valid_compose_spec(name):
    assert compose_errors(load_compose(name)) == []


@pytest.mark.parametrize("kind", ["Namespace", "DaemonSet", "Service", "ServiceMonitor",
                                  "PrometheusRule"])
def test_k8s_manifests_are_valid_against_their_published_schemas(kind):
    assert k8s_errors(load_k8s()[kind]) == []


def test_the_schemas_are_strict_enough_to_catch_a_typo():
    """A misspelt field must fail, or the validation above proves nothing."""
    ds = load_k8s()["DaemonSet"]
    ds["spec"]["template"]["spec"]["hostIpc"] = ds["spec"]["template"]["spec"].pop("hostIPC")
    assert any("hostIpc" in e for e in k8s_errors(ds))
    sm = load_k8s()["ServiceMonitor"]
    sm["spec"]["endpoints"][0]["intervall"] = "5s"
    assert any("intervall" in e for e in k8s_errors(sm))
    compose = load_compose("docker-compose.yml")
    compose["services"]["allocator"]["ipc_mode"] = "host"
    assert any("ipc_mode" in e for e in compose_errors(compose))


# ---------------------------------------------------------------- compose wiring


def test_compose_allocator_has_a_gpu_host_ipc_and_a_healthcheck():
    alloc = load_compose("docker-compose.yml")["services"]["allocator"]
    assert alloc["ipc"] == "host"
    (gpu,) = alloc["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    assert "/healthz" in " ".join(alloc["healthcheck"]["test"])
    assert all(p.startswith("127.0.0.1:") for p in alloc["ports"]), "bind loopback only"


def test_compose_runs_prometheus_grafana_and_loadgen_against_the_allocator():
    services = load_compose("docker-compose.yml")["services"]
    assert set(services) == {"allocator", "loadgen", "prometheus", "grafana"}
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = scrape["scrape_configs"]
    assert job["job_name"] == "kvalloc", "alerts select job=kvalloc"
    assert job["static_configs"][0]["targets"] == ["allocator:8900"]
    assert "./prometheus:/etc/prometheus:ro" in services["prometheus"]["volumes"]
    grafana_mounts = services["grafana"]["volumes"]
    assert "./grafana/provisioning:/etc/grafana/provisioning:ro" in grafana_mounts
    assert "./grafana/dashboards:/var/lib/grafana/dashboards:ro" in grafana_mounts
    loadgen = services["loadgen"]
    assert loadgen["depends_on"]["allocator"]["condition"] == "service_healthy"
    assert set(loadgen["volumes"]) == set(services["allocator"]["volumes"]), "the IPC socket"
    for rel in ("prometheus", "grafana/provisioning", "grafana/dashboards"):
        assert (DEPLOY / rel).is_dir(), rel


def test_cpu_override_drops_the_gpu_reservation_and_builds_a_cpu_image():
    override = load_compose("docker-compose.cpu.yml")["services"]
    assert "deploy" in override["allocator"] and override["allocator"]["deploy"] is None
    for name in ("allocator", "loadgen"):
        assert override[name]["build"]["args"]["BASE_IMAGE"].startswith("python:")
    base = load_compose("docker-compose.yml")["services"]
    assert override["allocator"]["image"] != base["allocator"]["image"]


def test_grafana_provisioning_points_at_the_dashboard_and_prometheus():
    ds = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    dash = _json(DEPLOY / "grafana/dashboards/kvalloc.json")
    assert source["uid"] == next(v for v in dash["templating"]["list"]
                                 if v["name"] == "datasource")["current"]["value"]
    prov = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/kvalloc.yml").read_text())
    assert prov["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"


# ---------------------------------------------------------------- Kubernetes wiring


def test_daemonset_runs_one_gpu_allocator_per_node_with_host_ipc_and_a_socket_hostpath():
    pod = load_k8s()["DaemonSet"]["spec"]["template"]["spec"]
    assert pod["hostIPC"] is True
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert volumes["sockets"]["hostPath"]["path"] == mounts["sockets"] == "/run/kvalloc"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    sc = container["securityContext"]
    assert sc["runAsNonRoot"] and not sc["allowPrivilegeEscalation"]
    assert sc["readOnlyRootFilesystem"]


def test_triton_caches_its_kernels_where_the_allocator_may_write():
    """Triton writes compiled kernels to TRITON_CACHE_DIR, else under a home the image's user
    does not have: the image points it into /tmp, and the DaemonSet, whose root filesystem is
    read-only, onto a writable emptyDir mount."""
    env = dict(pair.split("=", 1) for pair in shlex.split(dockerfile_instruction("ENV")))
    assert Path(env["TRITON_CACHE_DIR"]).is_relative_to("/tmp")
    pod = load_k8s()["DaemonSet"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"]
    cache = Path({e["name"]: e.get("value") for e in container["env"]}["TRITON_CACHE_DIR"])
    scratch = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
    writable = [Path(m["mountPath"]) for m in container["volumeMounts"]
                if m["name"] in scratch and not m.get("readOnly", False)]
    assert any(cache.is_relative_to(mount) for mount in writable), (cache, writable)


def test_service_and_servicemonitor_select_the_allocator_pods():
    k8s = load_k8s()
    pod_labels = k8s["DaemonSet"]["spec"]["template"]["metadata"]["labels"]
    svc = k8s["Service"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    monitor = k8s["ServiceMonitor"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    port_names = {p["name"] for p in svc["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= port_names
    container_ports = {p["name"] for p in k8s["DaemonSet"]["spec"]["template"]["spec"][
        "containers"][0]["ports"]}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= container_ports
    # the job label is what alerts.yml selects on (up{job="kvalloc"})
    assert pod_labels[monitor["spec"]["jobLabel"]] == "kvalloc"
    assert all(d["metadata"].get("namespace", "kvalloc") == "kvalloc" for d in k8s.values())


def test_kustomization_applies_every_manifest_once_namespace_first():
    """No kustomization schema is vendored: its structure is checked here."""
    kust = yaml.safe_load(KUSTOMIZATION.read_text())
    assert (kust["apiVersion"], kust["kind"]) == ("kustomize.config.k8s.io/v1beta1",
                                                  "Kustomization")
    assert set(kust) == {"apiVersion", "kind", "namespace", "resources"}
    assert kust["namespace"] == "kvalloc"
    assert sorted(kust["resources"]) == [p.name for p in manifest_files()]
    assert kust["resources"][0] == "namespace.yaml"


def test_the_deployments_cannot_run_tokenless_on_all_interfaces():
    """Every deployment listens on 0.0.0.0, so each must carry a token it cannot start without:
    the DaemonSet's secret is not optional, compose refuses an unset KVALLOC_TOKEN, and the image's
    own default is refused by the service unless a token is given."""
    container = load_k8s()["DaemonSet"]["spec"]["template"]["spec"]["containers"][0]
    (env,) = [e for e in container["env"] if e["name"] == "KVALLOC_TOKEN"]
    assert env["valueFrom"]["secretKeyRef"] == {"name": "kvalloc-token", "key": "token",
                                                "optional": False}
    assert "--insecure-no-token" not in container["args"]
    compose = load_compose("docker-compose.yml")["services"]
    for name in ("allocator", "loadgen"):
        assert compose[name]["environment"]["KVALLOC_TOKEN"].startswith("${KVALLOC_TOKEN:?")
        assert "--insecure-no-token" not in compose[name]["command"]
    assert "--insecure-no-token" not in dockerfile_instruction("CMD")
    readme = (DEPLOY / "k8s" / "README.md").read_text()
    assert "create secret generic kvalloc-token" in readme


def test_the_gpu_image_is_the_stack_the_gpu_tests_run_on():
    base = next(line for line in (ROOT / "Dockerfile").read_text().splitlines()
                if line.startswith("ARG BASE_IMAGE="))
    assert base == "ARG BASE_IMAGE=pytorch/pytorch:2.11.0-cuda13.0-cudnn9-runtime"


def test_prometheusrule_carries_exactly_the_alerts_of_alerts_yml_and_the_gpu_step_latency():
    """The DaemonSet runs on GPU nodes: its rules take step-latency.yml's threshold."""
    groups = [g for name in ("alerts.yml", "step-latency.yml")
              for g in yaml.safe_load((DEPLOY / "prometheus" / name).read_text())["groups"]]
    assert load_k8s()["PrometheusRule"]["spec"] == {"groups": groups}


# ---------------------------------------------------------------- commands vs the real CLI


def parse(command: list[str]) -> argparse.Namespace:
    """``command`` parsed by the `kvalloc` subcommand's own argument parser."""
    name, *args = command
    parser = argparse.ArgumentParser(prog=f"kvalloc {name}", exit_on_error=False)
    importlib.import_module(COMMANDS[name][0]).add_arguments(parser)
    return parser.parse_args(args)


def dockerfile_instruction(name: str) -> str:
    lines = (ROOT / "Dockerfile").read_text().replace("\\\n", " ").splitlines()
    (line,) = [ln for ln in lines if ln.startswith(f"{name} ")]
    return line.removeprefix(f"{name} ").strip()


STREAM = "stream:///run/kvalloc/kvalloc.stream"


def deployed_serves() -> list[list[str]]:
    """Every ``kvalloc serve`` command shipped: the image's default, compose's, the DaemonSet's."""
    compose = load_compose("docker-compose.yml")["services"]
    pod = load_k8s()["DaemonSet"]["spec"]["template"]["spec"]
    return [json.loads(dockerfile_instruction("CMD")), compose["allocator"]["command"],
            pod["containers"][0]["args"]]


def test_every_deployed_command_is_accepted_by_the_kvalloc_cli():
    assert json.loads(dockerfile_instruction("ENTRYPOINT")) == ["kvalloc"]
    for command in deployed_serves():
        serve = parse(command)
        assert serve.host == "0.0.0.0" and serve.port == 8900, command
        assert serve.ipc == [STREAM], command
    loadgen = parse(load_compose("docker-compose.yml")["services"]["loadgen"]["command"])
    assert loadgen.address == STREAM


def test_no_shipped_deployment_serves_zeromq():
    """ZeroMQ's listener aborts the whole service when an accept meets EMFILE (docs/security.md),
    so nothing shipped serves it, over ``ipc://`` or ``tcp://``: same-host workers take the
    stream socket, others REST; neither a container nor a Service publishes a ZeroMQ port."""
    for command in deployed_serves():
        assert not [a for a in parse(command).ipc if a.startswith(("ipc://", "tcp://"))], command
    compose = load_compose("docker-compose.yml")["services"]
    assert all(not c.get("command") or "ipc://" not in " ".join(c["command"])
               for c in compose.values())
    k8s = load_k8s()
    pod_ports = k8s["DaemonSet"]["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert [p["containerPort"] for p in pod_ports] == [8900]
    assert [p["port"] for p in k8s["Service"]["spec"]["ports"]] == [8900]
    assert compose["allocator"]["ports"] == ["127.0.0.1:8900:8900"]
    assert dockerfile_instruction("EXPOSE").split() == ["8900"]


def test_ports_and_socket_paths_agree_across_image_compose_and_kubernetes():
    assert "127.0.0.1:8900/healthz" in dockerfile_instruction("HEALTHCHECK")
    alloc = load_compose("docker-compose.yml")["services"]["allocator"]
    serve = parse(alloc["command"])
    assert "127.0.0.1:8900/healthz" in " ".join(alloc["healthcheck"]["test"])
    assert Path(serve.uds).parent == Path("/run/kvalloc")  # the kvalloc-run volume
    container = load_k8s()["DaemonSet"]["spec"]["template"]["spec"]["containers"][0]
    k8s_serve = parse(container["args"])
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"http": 8900}
    assert k8s_serve.uds.startswith("/run/kvalloc/")
    assert k8s_serve.ipc == serve.ipc == [STREAM]


# ---------------------------------------------------------------- what the docs tell one to run

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), DEPLOY / "k8s" / "README.md"]


def test_every_doc_applies_the_manifests_as_the_kustomization():
    """``kubectl apply -f deploy/k8s/`` would apply kustomization.yaml as a resource and the
    DaemonSet before its Namespace; only ``-k`` applies the kustomization, namespace first."""
    commands = [line.strip(" `") for doc in DOCS for line in doc.read_text().splitlines()
                if "kubectl apply" in line and "deploy/k8s" in line]
    assert commands, "the docs say how to apply the manifests"
    for command in commands:
        assert "kubectl apply -k deploy/k8s/" in command, command


def test_every_doc_that_starts_compose_sets_the_token_first():
    """The compose file refuses to start with KVALLOC_TOKEN unset: a doc that says
    ``docker compose ... up`` says to export it before."""
    starting = [doc for doc in DOCS if "docker compose -f deploy/docker-compose.yml" in
                doc.read_text()]
    assert starting
    for doc in starting:
        text = doc.read_text()
        export = text.find('export KVALLOC_TOKEN="$(openssl rand -hex 32)"')
        assert 0 <= export < text.find("docker compose -f deploy/docker-compose.yml"), doc


def test_the_image_carries_every_package_and_can_carry_the_worker_extra():
    """The image is built from every folder pyproject installs (``kvalloc worker`` included),
    and ``KVALLOC_EXTRAS`` adds an extra pyproject declares, as the docs say."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = set(project["tool"]["setuptools"]["package-dir"].values())
    lines = (ROOT / "Dockerfile").read_text().replace("\\\n", " ").splitlines()
    copied = [line.split()[1] for line in lines if line.startswith("COPY ")]
    assert folders <= set(copied)
    context = (ROOT / ".dockerignore").read_text().splitlines()
    assert "*" in context  # only what is let back in reaches the build
    assert {f"!{c}/" if (ROOT / c).is_dir() else f"!{c}" for c in copied} <= set(context)
    assert 'ARG KVALLOC_EXTRAS=""' in lines
    (install,) = [line for line in lines if "/wheels/" in line and line.startswith("RUN ")]
    assert '"kvalloc${KVALLOC_EXTRAS} @ file://' in install
    assert "worker" in project["project"]["optional-dependencies"]
    assert "--build-arg KVALLOC_EXTRAS='[worker]'" in (ROOT / "docs" / "observability.md"
                                                        ).read_text()
