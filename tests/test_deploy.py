"""deploy/ checked offline: the compose files with `docker-compose config`, the Kubernetes
manifests against the Kubernetes schemas, the Prometheus config with promtool, the Grafana
provisioning and dashboard as files Grafana accepts. (Running them: test_compose_mesh.py.)"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from compose_local import COMPOSE_FILES, DEPLOY, compose, compose_config, pdmesh_services
from lws_schema import LWS_V1

from pdmesh.engine.config import EngineConfig

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
    roles = ("prefill", "decode")  # the KV store needs no GPU
    workers = [n for n, s in pdmesh_services(gpu).items() if s["command"][1] in roles]
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
        "Deployment",
        "Namespace",
        "Service",
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


def test_the_kv_store_is_deployed_with_its_data_plane_advertised() -> None:
    compose = compose_config()["services"]["kvstore"]
    env = compose["environment"]
    assert compose["command"] == ["pdmesh", "kvstore"] and "deploy" not in compose  # no GPU
    assert env["PDMESH_KV_ADVERTISE"] == "kvstore" and env["PDMESH_KV_PORT"] == "50082"
    docs = {(d["kind"], d["metadata"]["name"]): d for _, d in _manifests()}
    deployment = docs["Deployment", "kvstore"]
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert deployment["spec"]["replicas"] == 1 and env["PDMESH_KV_ADVERTISE"] == "$(POD_IP)"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": 50081, "kv": int(env["PDMESH_KV_PORT"]), "metrics": 9400}
    service = {p["name"]: p["port"] for p in docs["Service", "kvstore"]["spec"]["ports"]}
    assert service == ports and pod["metadata"]["annotations"]["prometheus.io/port"] == "9400"


# -- a decode worker over two nodes: a LeaderWorkerSet (deploy/k8s/multinode) ---------------------
MULTINODE = K8S / "multinode"


def _validate_lws(doc: dict) -> None:
    jsonschema.validate(doc, LWS_V1)
    for role in ("leaderTemplate", "workerTemplate"):  # the pods, against Kubernetes' own schema
        template = doc["spec"]["leaderWorkerTemplate"][role]
        pod = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": role.lower()}}
        kubernetes_validate.validate({**pod, "template": template}, K8S_VERSION, strict=True)


def _lws() -> dict:
    return yaml.safe_load((MULTINODE / "decode-lws.yaml").read_text())


def _worker_container(doc: dict) -> dict:
    return doc["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]


def test_leaderworkerset_validates_offline_and_wires_the_static_launch() -> None:
    doc = _lws()
    assert (doc["apiVersion"], doc["kind"]) == ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
    _validate_lws(doc)
    group = doc["spec"]["leaderWorkerTemplate"]
    size = group["size"]
    assert size == 2
    name, leader = doc["metadata"]["name"], group["leaderTemplate"]["spec"]["containers"][0]
    for role in ("leaderTemplate", "workerTemplate"):
        container = group[role]["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in container["env"]}
        # torchrun's flags from the variables LWS puts in every pod of the group.
        assert env["PDMESH_NNODES"] == "$(LWS_GROUP_SIZE)"
        assert env["PDMESH_NODE_RANK"] == "$(LWS_WORKER_INDEX)"
        assert env["PDMESH_MASTER_ADDR"] == "$(LWS_LEADER_ADDRESS)"
        assert env["PDMESH_KV_ADVERTISE"] == "$(POD_IP)"  # each rank's KV at its own pod's IP
        gpus = container["resources"]["limits"]["nvidia.com/gpu"]
        for node in range(size):  # the layout LWS's values make is one each pod can run
            config = EngineConfig(
                tensor_parallel_size=int(env["PDMESH_TENSOR_PARALLEL_SIZE"]),
                pipeline_parallel_size=int(env["PDMESH_PIPELINE_PARALLEL_SIZE"]),
                nnodes=size,
                node_rank=node,
                master_port=int(env["PDMESH_MASTER_PORT"]),
                device="cuda",
            )
            assert config.ranks_per_node == gpus
    ports = {p["name"]: p["containerPort"] for p in leader["ports"]}
    assert ports["rendezvous"] == int(env["PDMESH_MASTER_PORT"])
    assert "ports" not in _worker_container(doc)  # no gRPC there
    # Not in the base: an overlay adds it and lists its leader (<name>-<group>.<name>) for the
    # router.
    base_resources = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert "decode-lws.yaml" not in base_resources
    overlay = yaml.safe_load((MULTINODE / "kustomization.yaml").read_text())
    assert overlay["resources"] == ["../", "decode-lws.yaml"]
    listed = yaml.safe_load(overlay["patches"][0]["patch"])[0]["value"].split(",")
    base = yaml.safe_load((K8S / "configmap.yaml").read_text())["data"]["PDMESH_DECODE"]
    assert listed == [*base.split(","), f"{name}-0.{name}:{ports['grpc']}"]


@pytest.mark.parametrize(
    "break_it",
    [
        lambda d: d["spec"]["leaderWorkerTemplate"].update(sise=2),  # a typo
        lambda d: d["spec"]["leaderWorkerTemplate"].update(size="two"),
        lambda d: d["spec"].update(startupPolicy="WhenReady"),  # not one of its values
        lambda d: _worker_container(d)["env"][0].update(valu="8"),  # a typo in the pod
    ],
    ids=["typo", "size-type", "enum", "pod-field"],
)
def test_leaderworkerset_validation_rejects_a_broken_manifest(break_it) -> None:
    doc = _lws()
    break_it(doc)
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
        _validate_lws(doc)
