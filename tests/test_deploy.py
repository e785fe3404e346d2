"""deploy/ checked offline: the compose files with `docker-compose config`, the Kubernetes
manifests against the Kubernetes schemas, the Prometheus config with promtool, the Grafana
provisioning and dashboard as files Grafana accepts. (Running them: test_compose_mesh.py.)"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from compose_local import COMPOSE_FILES, DEPLOY, compose, compose_config, pdmesh_services

K8S = DEPLOY / "k8s"
K8S_VERSION = "1.30.0"  # the oldest Kubernetes the manifests promise to work on


def test_compose_files_validate() -> None:
    for files in (COMPOSE_FILES[:1], COMPOSE_FILES):
        out = compose("config", "--quiet", files=files)
        assert out.returncode == 0, out.stderr


def test_compose_validation_rejects_a_broken_file(tmp_path: Path) -> None:
    broken = tmp_path / "docker-compose.yml"
    text = COMPOSE_FILES[0].read_text().replace("    healthcheck:\n", "    healthchek:\n", 1)
    broken.write_text(text.replace("context: ..", f"context: {DEPLOY.parent}"))
    out = compose("config", "--quiet", files=(broken,))
    assert out.returncode != 0
    assert "healthchek" in out.stderr


def test_gpu_workers_reserve_gpus_and_the_cpu_override_drops_them() -> None:
    gpu = compose_config(COMPOSE_FILES[:1])
    cpu = compose_config(COMPOSE_FILES)
    workers = [n for n, s in pdmesh_services(gpu).items() if s["command"][1] != "router"]
    assert workers == ["decode-0", "prefill-0"]
    gpu_ids = []
    for name in workers:
        devices = gpu["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
        gpu_ids += devices[0]["device_ids"]
        assert "deploy" not in cpu["services"][name]
        assert cpu["services"][name]["environment"]["PDMESH_DEVICE"] == "cpu"
    assert len(set(gpu_ids)) == len(gpu_ids), "two workers share a GPU"
    for name, svc in pdmesh_services(cpu).items():
        assert svc["build"]["dockerfile"] == "deploy/Dockerfile.cpu", name
    assert {"jaeger", "prometheus", "grafana"} <= set(cpu["services"])


def test_every_pdmesh_service_is_scraped_and_traced() -> None:
    config = compose_config()
    scraped = {
        target.split(":")[0]
        for job in yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())[
            "scrape_configs"
        ]
        for static in job["static_configs"]
        for target in static["targets"]
    }
    assert scraped == set(pdmesh_services(config))
    for name, svc in pdmesh_services(config).items():
        assert svc["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317", name


def test_prometheus_config_passes_promtool() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is missing: `make test` installs Debian's prometheus package")
    out = subprocess.run(
        [promtool, "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_grafana_provisioning_and_dashboard() -> None:
    sources = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/datasources/datasources.yml").read_text()
    )["datasources"]
    uids = {s["uid"]: s for s in sources}
    assert uids["prometheus"]["type"] == "prometheus" and uids["jaeger"]["type"] == "jaeger"
    providers = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/dashboards/dashboards.yml").read_text()
    )["providers"]
    assert providers[0]["options"]["path"] == "/var/lib/grafana/dashboards"
    dashboard = json.loads((DEPLOY / "grafana/dashboards/pdmesh.json").read_text())
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    titles = " | ".join(p["title"] for p in panels).lower()
    for topic in ("first token", "inter-token", "throughput", "kv cache", "bandwidth", "queue"):
        assert topic in titles
    for panel in panels:
        assert panel["datasource"]["uid"] in uids
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "prometheus"
            assert "pdmesh_" in target["expr"]


def _manifests() -> list[tuple[Path, dict]]:
    return [
        (path, doc)
        for path in sorted(K8S.glob("*.yaml"))
        if path.name != "kustomization.yaml"
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]


def test_kubernetes_manifests_validate_offline() -> None:
    docs = _manifests()
    kinds = sorted(doc["kind"] for _, doc in docs)
    assert kinds == [
        "ConfigMap",
        "Deployment",
        "Namespace",
        "Service",
        "Service",
        "Service",
        "StatefulSet",
        "StatefulSet",
    ]
    for path, doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        assert doc["metadata"].get("namespace", "pdmesh") == "pdmesh", path
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted({p.name for p, _ in docs})


def test_kubernetes_validation_rejects_a_typo() -> None:
    _, statefulset = next((p, d) for p, d in _manifests() if d["kind"] == "StatefulSet")
    statefulset["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPrt"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(statefulset, K8S_VERSION, strict=True)


def test_router_lists_every_statefulset_pod_and_pods_are_scraped() -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for _, d in _manifests()}
    config = docs["ConfigMap", "pdmesh"]["data"]
    for pool, port in (("prefill", 50071), ("decode", 50061)):
        sts = docs["StatefulSet", pool]
        assert sts["spec"]["serviceName"] == pool
        assert docs["Service", pool]["spec"]["clusterIP"] == "None"
        listed = config[f"PDMESH_{pool.upper()}"].split(",")
        assert listed == [f"{pool}-{i}.{pool}:{port}" for i in range(sts["spec"]["replicas"])]
        pod = sts["spec"]["template"]
        container = pod["spec"]["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["grpc"] == port
        assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(ports["metrics"])
        assert ports["metrics"] == int(config["PDMESH_METRICS_PORT"])
    decode_env = {e["name"]: e for e in docs["StatefulSet", "decode"]["spec"]["template"]["spec"][
        "containers"][0]["env"]}  # fmt: skip
    assert decode_env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert decode_env["PDMESH_KV_ADVERTISE"]["value"] == "$(POD_IP)"
