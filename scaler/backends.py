"""Where scaling decisions are carried out: `dry-run` logs them; `local` starts and drains worker processes;
`kubernetes` (scaler/kubernetes.py) sets a Deployment's replica count and picks which pod drains.

The local backend starts `python -m gpu_workers` children in its own process group (so stopping the
scaler's group stops them too) and scales down by SIGTERM, which makes a worker drain: it announces
`draining`, takes no new placements, finishes what it has, and exits.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import structlog

from plumbing.processes import die_with_parent
from queue_schemas.messages import Heartbeat, WorkerState
from scaler.policy import Verdict

log = structlog.get_logger("sluice.scaler.backend")


@dataclass(frozen=True)
class DrainAsks:
    """Drain requests for the scaler to set (`drain`) or withdraw (`withdraw`), by worker id."""

    drain: tuple[str, ...] = ()
    withdraw: tuple[str, ...] = ()


NO_ASKS = DrainAsks()


class Backend(Protocol):
    def launching(self, pool: str, known: set[str]) -> int:
        """Replicas this backend started that have not sent a heartbeat yet."""
        ...

    def apply(
        self, pool: str, verdict: Verdict, beats: Sequence[Heartbeat], spec_decoding: bool
    ) -> DrainAsks: ...

    def size_prefill(self, pool: str, target: int, beats: Sequence[Heartbeat]) -> None:
        """Bring the pool's prefill workers (`beats`: theirs) to `target`."""
        ...

    def close(self, timeout_s: float) -> None: ...


PREFILL = "/prefill"  # a pool's prefill workers are kept under "<pool>/prefill"


def prefill_to_stop(beats: Sequence[Heartbeat], owned: set[str]) -> str | None:
    """The prefill worker we own with the least queued, to stop first. Pure."""
    ready = [hb for hb in beats if hb.worker_id in owned]
    if not ready:
        return next(iter(sorted(owned)), None)
    return min(ready, key=lambda hb: (hb.prefill_backlog, hb.worker_id)).worker_id


class DryRunBackend:
    def launching(self, pool: str, known: set[str]) -> int:
        return 0

    def apply(
        self, pool: str, verdict: Verdict, beats: Sequence[Heartbeat], spec_decoding: bool
    ) -> DrainAsks:
        if verdict.action != "hold":
            log.info(
                "would scale", pool=pool, action=verdict.action, target=verdict.target, reason=verdict.reason
            )
        return NO_ASKS

    def size_prefill(self, pool: str, target: int, beats: Sequence[Heartbeat]) -> None:
        if target != len(beats):
            log.info("would size prefill workers", pool=pool, target=target, now=len(beats))

    def close(self, timeout_s: float) -> None:
        return None


def pick_to_drain(beats: Sequence[Heartbeat], owned: set[str]) -> str | None:
    """The ready replica we own with the least work, so draining it finishes soonest. Pure."""
    ready = [hb for hb in beats if hb.state is WorkerState.READY and hb.worker_id in owned]
    if not ready:
        return None
    return min(ready, key=lambda hb: (hb.running + hb.waiting + hb.inbox_pending, hb.worker_id)).worker_id


def next_worker_id(pool: str, taken: set[str], kind: str = "w") -> str:
    n = 0
    while f"{pool}-{kind}{n}" in taken:
        n += 1
    return f"{pool}-{kind}{n}"


class LocalBackend:
    def __init__(self, log_dir: Path, env: Mapping[str, str]) -> None:
        self._log_dir = log_dir
        self._env = dict(env)
        self._procs: dict[str, tuple[str, subprocess.Popen[bytes]]] = {}  # worker id -> (pool, process)
        self._stopping: set[str] = set()  # workers told to drain or stop: their exit is expected
        # Workers that exited unasked, by pool (or pool/prefill): the scaler starts others in their place.
        self.exits: Counter[str] = Counter()

    def _alive(self, pool: str) -> dict[str, subprocess.Popen[bytes]]:
        for worker_id, (_, proc) in list(self._procs.items()):
            if proc.poll() is not None:
                owner = self._procs.pop(worker_id)[0]
                if worker_id in self._stopping:
                    self._stopping.discard(worker_id)
                    log.info("worker exited", worker=worker_id, code=proc.returncode)
                else:
                    self.exits[owner] += 1
                    log.warning("worker exited unasked; another takes its place", worker=worker_id,
                                code=proc.returncode)  # fmt: skip
        return {w: p for w, (owner, p) in self._procs.items() if owner == pool}

    def launching(self, pool: str, known: set[str]) -> int:
        return sum(1 for worker_id in self._alive(pool) if worker_id not in known)

    def apply(
        self, pool: str, verdict: Verdict, beats: Sequence[Heartbeat], spec_decoding: bool
    ) -> DrainAsks:
        owned = self._alive(pool)
        if verdict.action == "up":
            leaving = (WorkerState.DRAINING, WorkerState.FAILED)
            known = {hb.worker_id for hb in beats if hb.state not in leaving}
            current = len(known | set(owned))
            for _ in range(max(0, verdict.target - current)):
                self._start(
                    pool,
                    next_worker_id(pool, {hb.worker_id for hb in beats} | set(self._procs)),
                    spec_decoding,
                )
        elif verdict.action == "down":
            victim = pick_to_drain(beats, set(owned))
            if victim is None:
                log.warning("no replica of ours to drain", pool=pool)
                return NO_ASKS
            log.info("draining worker", pool=pool, worker=victim, reason=verdict.reason)
            self._stopping.add(victim)
            owned[victim].send_signal(signal.SIGTERM)
        return NO_ASKS

    def size_prefill(self, pool: str, target: int, beats: Sequence[Heartbeat]) -> None:
        """Start prefill workers (SLUICE_ROLE=prefill) up to `target`, or stop the least busy one above
        it (its queued jobs end in a local prefill at their decode workers)."""
        owner = pool + PREFILL
        owned = self._alive(owner)
        if len(owned) < target:
            for _ in range(target - len(owned)):
                taken = {hb.worker_id for hb in beats} | set(self._procs)
                self._start(pool, next_worker_id(pool, taken, "p"), False, owner, "prefill")
        elif len(owned) > target:
            victim = prefill_to_stop(beats, set(owned))
            if victim is not None:
                log.info("stopping prefill worker", pool=pool, worker=victim)
                self._stopping.add(victim)
                owned[victim].send_signal(signal.SIGTERM)

    def _start(
        self,
        pool: str,
        worker_id: str,
        spec_decoding: bool,
        owner: str | None = None,
        role: str | None = None,
    ) -> None:
        self._log_dir.mkdir(parents=True, exist_ok=True)
        env = {**self._env, "SLUICE_SPEC_DECODING": "true" if spec_decoding else "false"}
        if role is not None:
            env["SLUICE_ROLE"] = role
        argv = [sys.executable, "-m", "gpu_workers", "--pool", pool, "--worker-id", worker_id]
        with (self._log_dir / f"worker-{worker_id}.log").open("ab") as out:
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                preexec_fn=die_with_parent,
            )  # fmt: skip
        self._procs[worker_id] = (owner or pool, proc)
        log.info("started worker", pool=pool, worker=worker_id, pid=proc.pid, role=role or "default")

    def close(self, timeout_s: float) -> None:
        """Drain every worker we started, then kill what is left after `timeout_s`."""
        for _, proc in self._procs.values():
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for worker_id, (_, proc) in self._procs.items():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("worker did not drain in time; killing", worker=worker_id)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.wait(5)
        self._procs.clear()
