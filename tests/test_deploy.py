"""deploy/ checked offline: the compose files with `docker-compose config`, the Prometheus
configs with promtool, the Grafana provisioning and dashboard as files Grafana accepts. (The
Kubernetes manifests: test_deploy_kubernetes.py; running the compose files:
test_compose_mesh.py, test_compose_planner.py.)"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from compose_local import COMPOSE_FILES, DEPLOY, compose, compose_config, pdmesh_services

# The deployments' compose files, as their users layer them: GPU, and no GPU.
PLANNER_FILES = (DEPLOY / "docker-compose.planner.yml", DEPLOY / "docker-compose.planner.cpu.yml")
FIXED = {"cuda": COMPOSE_FILES[:1], "cpu": COMPOSE_FILES}
PLANNER = {"cuda": (COMPOSE_FILES[0], PLANNER_FILES[0]), "cpu": (*COMPOSE_FILES, *PLANNER_FILES)}
DEPLOYMENTS = {
    f"{name}-{device}": files
    for name, by_device in (("fixed", FIXED), ("planner", PLANNER))
    for device, files in by_device.items()
}


def test_compose_files_validate() -> None:
    layered = {f for files in DEPLOYMENTS.values() for f in files}
    assert layered == set(DEPLOY.glob("docker-compose*.yml")), "a compose file no test layers"
    for files in DEPLOYMENTS.values():
        out = compose("config", "--quiet", files=files)
        assert out.returncode == 0, out.stderr


def test_compose_validation_rejects_a_broken_file(tmp_path: Path) -> None:
    broken = tmp_path / "docker-compose.yml"
    text = COMPOSE_FILES[0].read_text().replace("    healthcheck:\n", "    healthchek:\n", 1)
    broken.write_text(text.replace("context: ..", f"context: {DEPLOY.parent}"))
    out = compose("config", "--quiet", files=(broken,))
    assert out.returncode != 0
    assert "healthchek" in out.stderr


@pytest.mark.parametrize(
    ("files", "expected"),
    [(FIXED, ["decode-0", "prefill-0"]), (PLANNER, ["worker-0", "worker-1", "worker-2"])],
    ids=["fixed", "planner"],
)
def test_gpu_workers_reserve_gpus_and_the_cpu_override_drops_them(
    files: dict[str, tuple[Path, ...]], expected: list[str]
) -> None:
    gpu = compose_config(files["cuda"])
    cpu = compose_config(files["cpu"])
    kinds = ("prefill", "decode", "worker")  # the KV store needs no GPU
    workers = [n for n, s in pdmesh_services(gpu).items() if s["command"][1] in kinds]
    assert workers == expected
    assert [n for n, s in pdmesh_services(cpu).items() if s["command"][1] in kinds] == expected
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


def _prometheus_config(config: dict) -> Path:
    """The Prometheus config the compose `config` mounts into its prometheus service."""
    (source,) = [
        v["source"]
        for v in config["services"]["prometheus"]["volumes"]
        if v["target"] == "/etc/prometheus/prometheus.yml"
    ]
    return Path(source)


@pytest.mark.parametrize("deployment", sorted(DEPLOYMENTS))
def test_every_pdmesh_service_is_scraped_and_traced(deployment: str) -> None:
    config = compose_config(DEPLOYMENTS[deployment])
    scraped = {
        target.split(":")[0]
        for job in yaml.safe_load(_prometheus_config(config).read_text())["scrape_configs"]
        for static in job["static_configs"]
        for target in static["targets"]
    }
    assert scraped == set(pdmesh_services(config))
    for name, svc in pdmesh_services(config).items():
        assert svc["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317", name


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_planner_deployment_runs_one_worker_pool_and_the_planner(device: str) -> None:
    services = pdmesh_services(compose_config(PLANNER[device]))
    assert services["router"]["command"] == ["pdmesh", "router", "--planner"]
    workers = {n: s for n, s in services.items() if n not in ("router", "kvstore")}
    started: dict[str, list[str]] = {"prefill": [], "decode": []}
    for name, svc in workers.items():
        program, kind, flag, role = svc["command"]  # pdmesh worker --role ROLE, nothing else
        assert [program, kind, flag] == ["pdmesh", "worker", "--role"], name
        env = svc["environment"]
        assert env["PDMESH_KV_ADVERTISE"] == name and env["PDMESH_KVSTORE_ADVERTISE"] == name
        assert svc["healthcheck"]["test"][-1] == f"127.0.0.1:{env['PDMESH_PORT']}", name
        started[role].append(f"{name}:{env['PDMESH_PORT']}")
    assert started["prefill"] and started["decode"], "a pool that starts without a role"
    # The planner never switches the last worker of a role: some role must have one to spare.
    assert max(len(pool) for pool in started.values()) >= 2, "a pool the planner cannot change"
    router = services["router"]
    # The router lists each worker under the role it starts in, and waits for all of them.
    for role, listed in started.items():
        assert router["environment"][f"PDMESH_{role.upper()}"].split(",") == listed
    assert set(router["depends_on"]) == set(workers)


@pytest.mark.parametrize("name", ["prometheus.yml", "prometheus.planner.yml"])
def test_prometheus_config_passes_promtool(name: str) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is missing: `make test` installs Debian's prometheus package")
    out = subprocess.run(
        [promtool, "check", "config", str(DEPLOY / "prometheus" / name)],
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
