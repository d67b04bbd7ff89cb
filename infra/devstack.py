"""The embedded dev stack: broker + Redis-compatible server from pip packages, then every service.

`DevStack` is used by `sluice dev` and by the end-to-end tests, so what the tests start is what a
developer runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import httpx
from redis.exceptions import RedisError

from infra.keys import create_key, create_signing_key
from infra.launcher import (
    LocalCluster,
    ManagedProcess,
    free_port,
    free_ports,
    port_is_free,
    spawn,
    start_broker,
    start_redis,
    start_redis_cluster,
    wait_until,
)
from infra.topics import create_topics
from plumbing.clients import mget_any, redis_client, sync_redis_client
from queue_schemas.codec import decode
from queue_schemas.config import SluiceConfig, load_config
from queue_schemas.messages import Heartbeat
from queue_schemas.settings import BusSettings

DEV_TEAM = "dev"
INFRA_PROCESSES = ("broker", "redis")  # and the nodes of a local Redis Cluster, redis-cluster-PORT
SERVICE_STOP_TIMEOUT_S = 15.0
# Restarting a service that exited, as compose's restart policy does: after 0.5 s, doubling for each exit
# in a row up to 30 s; a process that ran for STEADY_S before it exited starts the count again.
RESTART_FIRST_S = 0.5
RESTART_MAX_S = 30.0
STEADY_S = 30.0
# How long a service process may take to answer on its first start (it fails at once if it exits).
SERVICE_START_S = 180.0

# The dev broker answers a waiting fetch only when the wait expires and joins groups in half the session
# timeout, so the dev stack runs both short.
DEV_KAFKA_ENV = {
    "SLUICE_KAFKA_FETCH_WAIT_MS": "5",
    "SLUICE_KAFKA_SESSION_TIMEOUT_MS": "3000",
    "SLUICE_KAFKA_HEARTBEAT_INTERVAL_MS": "500",
}


@dataclass(frozen=True)
class Endpoints:
    url: str
    api_key: str
    kafka_bootstrap: str
    redis_url: str
    scaler_url: str

    def env_lines(self) -> list[str]:
        return [
            f"SLUICE_URL={self.url}",
            f"SLUICE_API_KEY={self.api_key}",
            f"SLUICE_KAFKA_BOOTSTRAP={self.kafka_bootstrap}",
            f"SLUICE_REDIS_URL={self.redis_url}",
            f"SLUICE_SCALER_URL={self.scaler_url}",
        ]

    def curl(self, model: str) -> str:
        body = (
            f'{{"model": "{model}", "stream": true, "messages": [{{"role": "user", "content": "Hello!"}}]}}'
        )
        return (
            f"curl -N {self.url}/v1/chat/completions -H 'Authorization: Bearer {self.api_key}' "
            f"-H 'Content-Type: application/json' -d '{body}'"
        )


@dataclass
class DevStack:
    workdir: Path
    config_path: Path | None = None
    ingress_port: int | None = None
    prefix: str = "sluice"
    extra_env: dict[str, str] = field(default_factory=dict)
    processes: list[ManagedProcess] = field(default_factory=list)
    workers_ready_s: float = 300.0
    # Transport security for every client: `front(service, port)` puts an endpoint (a TLS proxy, say) in
    # front of the broker ("kafka") or Redis ("redis") and returns the port clients use instead; `security`
    # holds the BusSettings fields (TLS files, SASL) every service and the stack's own clients are given.
    front: Callable[[str, int], int] | None = None
    security: dict[str, str] = field(default_factory=dict)
    redis_tls: bool = False
    # Durability, for restarting the broker or Redis under load: Redis writes an append-only file; the
    # broker keeps its log in `broker_storage` (an `s3://` engine configured by `broker_env`).
    redis_persist: bool = False
    broker_storage: str = "memory://tansu/"
    broker_env: dict[str, str] | None = None
    # Dispatchers per pool, all active, sharing the pool's partitions by lease (dispatcher.leases): a
    # killed one's partitions pass to the other in about a second. Named dispatcher-POOL, -POOL-2, ...
    dispatchers: int = 2
    # Every Prometheus endpoint of the running stack (ingress, scaler, each dispatcher), once started.
    metrics_urls: list[str] = field(default_factory=list)
    # Ingress processes, on consecutive ports from the first (named ingress, ingress-2, ...): a load
    # balancer in front of them is all a client needs. Their URLs, once started, in `ingress_urls`.
    ingresses: int = 1
    ingress_urls: list[str] = field(default_factory=list)
    # A local Redis Cluster of this many primaries (each with a replica) instead of one server.
    redis_cluster: int = 0
    cluster: LocalCluster | None = None

    def __post_init__(self) -> None:
        self.config: SluiceConfig = load_config(self.config_path)
        self.log_dir = self.workdir / "logs"
        self.signing_key_file = self.workdir / "dev-signing-key.pem"  # the dev team's batch signer
        self._taken: set[int] = set()
        self.bus: BusSettings | None = None
        self.supervision = Supervision()

    def start(self) -> Endpoints:
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> Endpoints:
        self.workdir.mkdir(parents=True, exist_ok=True)
        kafka_port, redis_port = free_port(), free_port()
        kafka_client_port = self.front("kafka", kafka_port) if self.front else kafka_port
        redis_client_port = self.front("redis", redis_port) if self.front else redis_port
        self.processes.append(start_broker(
            kafka_port, self.log_dir, advertised_port=kafka_client_port, storage=self.broker_storage,
            env=self.broker_env,
        ))  # fmt: skip
        if self.redis_cluster:
            assert self.front is None, "a cluster's clients reach every node directly"
            spare = [p for p in free_ports(2 * self.redis_cluster) if p not in (redis_port, kafka_port)]
            ports = [redis_port, *spare[: self.redis_cluster - 1]]
            replicas = dict(zip(ports, spare[self.redis_cluster - 1 :], strict=False))
            self.cluster = start_redis_cluster(ports, self.log_dir, replicas)
            self.processes += [*self.cluster.primaries, *self.cluster.replicas.values()]
        else:
            self.processes.append(start_redis(redis_port, self.log_dir, persist=self.redis_persist))
        scheme = "rediss" if self.redis_tls else "redis"
        bus = BusSettings(
            kafka_bootstrap=f"127.0.0.1:{kafka_client_port}",
            redis_url=f"{scheme}://127.0.0.1:{redis_client_port}/0",
            redis_cluster=bool(self.redis_cluster),
            prefix=self.prefix,
            config=self.config_path,
            **self.security,  # type: ignore[arg-type]
        )
        self.bus = bus
        api_key = asyncio.run(self._prepare_bus(bus))
        ports = ingress_ports(self.ingress_port, self.ingresses)
        self._taken.update(ports)
        scaler_port = self._spare_port()
        env = self._service_env(bus)
        cli = [sys.executable, "-m", "infra.cli"]
        ingresses = []
        for n, ingress_port in enumerate(ports, start=1):
            name = "ingress" + (f"-{n}" if n > 1 else "")
            ingresses.append(spawn(name, [*cli, "ingress", "--port", str(ingress_port)], self.log_dir, env))
            self.ingress_urls.append(f"http://127.0.0.1:{ingress_port}")
        self.processes += ingresses
        for pool in self.config.pools:
            for n in range(1, self.dispatchers + 1):
                metrics_port = self._spare_port()
                self.metrics_urls.append(f"http://127.0.0.1:{metrics_port}/metrics")
                dispatcher_env = {**env, "SLUICE_METRICS_PORT": str(metrics_port)}
                argv = [*cli, "dispatcher", "--pool", pool.name]
                name = f"dispatcher-{pool.name}" + (f"-{n}" if n > 1 else "")
                self.processes.append(spawn(name, argv, self.log_dir, dispatcher_env))
        # The scaler's local backend starts each pool's workers (and more or fewer later, with load).
        scaler_env = {**env, "SLUICE_BACKEND": "local", "SLUICE_WORKER_LOG_DIR": str(self.log_dir)}
        scaler = spawn("scaler", [*cli, "scaler", "--port", str(scaler_port)], self.log_dir, scaler_env)
        self.processes.append(scaler)
        url = self.ingress_urls[0]
        scaler_url = f"http://127.0.0.1:{scaler_port}"
        self.metrics_urls += [*(f"{u}/metrics" for u in self.ingress_urls), f"{scaler_url}/metrics"]
        # The ingresses load tokenizers and the schema compiler: seconds alone, minutes on two cores
        # shared with engines that are starting.
        for ingress, ingress_url in zip(ingresses, self.ingress_urls, strict=True):
            wait_until(ingress, partial(_http_ok, ingress_url + "/healthz"), ingress.name, SERVICE_START_S)
        wait_until(scaler, lambda: _http_ok(scaler_url + "/healthz"), "scaler", SERVICE_START_S)
        asyncio.run(self._wait_workers_ready(bus, deadline_s=self.workers_ready_s))
        endpoints = Endpoints(url, api_key, bus.kafka_bootstrap, bus.redis_url, scaler_url)
        lines = [*endpoints.env_lines(), f"SLUICE_PREFIX={self.prefix}"]
        if self.redis_cluster:
            lines.append("SLUICE_REDIS_CLUSTER=1")
        lines.append(f"SLUICE_SIGNING_KEY_FILE={self.signing_key_file.resolve()}")
        lines += [f"SLUICE_{name.upper()}={value}" for name, value in self.security.items()]
        if self.config_path is not None:  # so `sluice batch` and `sluice keys` see the same pools
            lines.append(f"SLUICE_CONFIG={self.config_path.resolve()}")
        (self.workdir / "dev.env").write_text("\n".join(lines) + "\n")
        self._write_pids()
        self.supervision.started = dict.fromkeys((p.name for p in self.processes), time.monotonic())
        return endpoints

    def _spare_port(self) -> int:
        """A free port that no process of the stack was given yet (one can be free until it binds)."""
        while (port := free_port()) in self._taken:
            pass
        self._taken.add(port)
        return port

    def _service_env(self, bus: BusSettings) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
        env.update(DEV_KAFKA_ENV)
        env.update(
            SLUICE_KAFKA_BOOTSTRAP=bus.kafka_bootstrap,
            SLUICE_REDIS_URL=bus.redis_url,
            SLUICE_REDIS_CLUSTER="1" if bus.redis_cluster else "0",
            SLUICE_PREFIX=bus.prefix,
            SLUICE_FILES_STORE=str((self.workdir / "files").resolve()),
            PYTHONUNBUFFERED="1",
        )
        if self.config_path is not None:
            env["SLUICE_CONFIG"] = str(self.config_path.resolve())
        env.update({f"SLUICE_{name.upper()}": value for name, value in self.security.items()})
        env.update(self.extra_env)
        return env

    async def _prepare_bus(self, bus: BusSettings) -> str:
        names = bus.names
        await create_topics(bus, replication=1, teams=[DEV_TEAM])
        redis = redis_client(bus)
        try:
            pem, _ = await create_signing_key(redis, names, DEV_TEAM)
            self.signing_key_file.write_text(pem)
            self.signing_key_file.chmod(0o600)
            return await create_key(redis, names, DEV_TEAM)
        finally:
            await redis.aclose()

    async def _wait_workers_ready(self, bus: BusSettings, deadline_s: float) -> None:
        """Each pool's minimum replicas (started by the scaler) have sent a `ready` heartbeat."""
        names = bus.names
        redis = redis_client(bus)
        expected = {
            (p.name, f"{p.name}-w{i}") for p in self.config.pools for i in range(p.scaling.min_replicas)
        }
        deadline = time.monotonic() + deadline_s
        try:
            while time.monotonic() < deadline:
                self._check_alive()
                keys = [names.heartbeat(pool, w) for pool, w in sorted(expected)]
                raws = await mget_any(redis, keys)
                if all(raw is not None and b'"state":"ready"' in raw for raw in raws):
                    return
                failed = [
                    decode(Heartbeat, raw) for raw in raws if raw is not None and b'"state":"failed"' in raw
                ]
                if failed:
                    reasons = "; ".join(f"{hb.worker_id}: {hb.error}" for hb in failed)
                    raise RuntimeError(f"a worker failed to start: {reasons}; logs in {self.log_dir}")
                await asyncio.sleep(0.1)
        finally:
            await redis.aclose()
        raise TimeoutError(f"workers not ready after {deadline_s:.0f}s; logs in {self.log_dir}")

    def _check_alive(self) -> None:
        for proc in self.processes:
            if not proc.alive:
                raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.log_tail()}")

    def dead(self) -> list[ManagedProcess]:
        return [p for p in self.processes if not p.alive]

    def process(self, name: str) -> ManagedProcess:
        (proc,) = [p for p in self.processes if p.name == name]
        return proc

    def halt(self, name: str, *, kill: bool = True) -> None:
        """Stop one process: SIGKILL with `kill`, else SIGTERM and a wait. `resume` starts it again."""
        old = self.process(name)
        if kill:
            with contextlib.suppress(ProcessLookupError):
                os.kill(old.popen.pid, signal.SIGKILL)
            old.popen.wait(10)
        else:
            old.stop()

    def resume(self, name: str) -> ManagedProcess:
        """Start a halted process's command again, as a supervisor would."""
        old = self.process(name)
        new = old.relaunch()
        self.processes[self.processes.index(old)] = new
        return new

    def restart(self, name: str, *, kill: bool = True, down_s: float = 0.0) -> ManagedProcess:
        """Halt one process, leave it down `down_s`, then resume it."""
        self.halt(name, kill=kill)
        time.sleep(down_s)
        return self.resume(name)

    def supervise(self, now: float) -> list[str]:
        """One round of supervision: a service that exited is restarted after its back-off (what happened
        is returned, to print); the broker or Redis exiting raises InfraLost."""
        said = []
        sup = self.supervision
        for proc in self.dead():
            if _is_infra(proc):
                raise InfraLost(f"{proc.name} exited ({proc.popen.returncode}):\n{proc.log_tail()}")
            if proc.name in sup.due:
                continue
            ran = now - sup.started.get(proc.name, now)
            sup.in_a_row[proc.name] = 1 if ran >= STEADY_S else sup.in_a_row[proc.name] + 1
            delay = restart_delay(sup.in_a_row[proc.name])
            sup.due[proc.name] = now + delay
            said.append(f"{proc.name} exited ({proc.popen.returncode}); restarting in {delay:g} s")
        for name, at in sorted(sup.due.items()):
            if at > now:
                continue
            del sup.due[name]
            # What the dead process started in its group (a scaler's draining workers) goes with it, so
            # nothing of it outlives the stack or competes with its replacement.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process(name).popen.pid, signal.SIGKILL)
            self.resume(name)
            sup.started[name] = now
            sup.restarts[name] += 1
            self._record_restart(name)
            said.append(f"{name} restarted ({sup.restarts[name]} so far)")
        if said:
            self._write_pids()
        return said

    def _record_restart(self, name: str) -> None:
        """Counted in Redis, where the scaler's dashboard reads it."""
        if self.bus is None:
            return
        try:
            client = sync_redis_client(self.bus)
            try:
                client.hincrby(self.bus.names.restarts(), name, 1)
            finally:
                client.close()
        except RedisError:
            pass  # the count is for display; the restart itself went ahead

    def _write_pids(self) -> None:
        """`pids`: the live processes of the stack, one `name pid` a line."""
        live = "".join(f"{p.name} {p.popen.pid}\n" for p in self.processes if p.alive)
        partial = self.workdir / "pids.new"
        partial.write_text(live)
        partial.replace(self.workdir / "pids")  # a reader never sees half a file

    def stop(self) -> None:
        """Stop the services together (they drain), then Redis and the broker. The scaler alone is sent
        the signal, not its process group: it stops its workers itself, as it does anywhere, rather than
        seeing them exit under it and starting them again."""
        services = [p for p in self.processes if not _is_infra(p)]
        for proc in services:
            if proc.name == "scaler":
                proc.signal_leader()
            else:
                proc.terminate()
        deadline = time.monotonic() + SERVICE_STOP_TIMEOUT_S
        for proc in services:
            proc.wait_stopped(max(0.0, deadline - time.monotonic()))
        for proc in reversed([p for p in self.processes if _is_infra(p)]):
            proc.stop()
        self.processes.clear()


class InfraLost(RuntimeError):
    """The broker or Redis of the dev stack exited: what they held (topics, keys) is gone with them."""


def restart_delay(exits_in_a_row: int) -> float:
    """How long a service that exited `exits_in_a_row` times in a row waits for its restart. Pure."""
    return min(RESTART_MAX_S, RESTART_FIRST_S * 2.0 ** max(0, exits_in_a_row - 1))


@dataclass
class Supervision:
    """What `DevStack.supervise` keeps between rounds."""

    restarts: Counter[str] = field(default_factory=Counter)
    in_a_row: Counter[str] = field(default_factory=Counter)
    started: dict[str, float] = field(default_factory=dict)  # name -> monotonic time of its last start
    due: dict[str, float] = field(default_factory=dict)  # name -> monotonic time of its restart


def _is_infra(proc: ManagedProcess) -> bool:
    return proc.name in INFRA_PROCESSES or proc.name.startswith("redis-cluster-")


def ingress_ports(first: int | None, count: int) -> list[int]:
    """`count` ports for the ingresses: `first` and the ports after it when all are free (what a user
    asks for with `--port`), else ports chosen by free_port. Never a free port's neighbours: a port
    next to a free one is not held, and the kernel gives it to outgoing connections."""
    if first:  # 0 or None: any
        wanted = list(range(first, first + count))
        if all(port < 65536 and port_is_free(port) for port in wanted):
            return wanted
    return free_ports(count)


def _http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def default_dev_config(workdir: Path, models_dir: Path) -> Path:
    """The dev pools (SmolLM2 on vLLM, and sim), with SmolLM2 prepared in `models_dir` on first use."""
    from infra.models import prepare_smollm2

    smollm2 = prepare_smollm2(models_dir / "smollm2-135m-instruct", models_dir / "downloads")
    template = (Path(__file__).parent / "dev_pools.toml").read_text()
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "pools.toml"
    path.write_text(template.replace("{smollm2_dir}", str(smollm2.resolve())))
    return path
