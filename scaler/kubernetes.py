"""The Kubernetes backend: a Deployment per pool, scaled through its scale subresource.

Worker ids are pod names (a worker's default id is its hostname). Scaling down needs no write access to
pods: the scaler asks the chosen worker, through Redis, to drain; the worker stops taking placements and
its readiness probe fails; once the API server reports the pod not ready, the replica count is lowered,
and the ReplicaSet, which removes not-ready pods before ready ones, removes that pod. Its SIGTERM then
finishes the drain within the termination grace period. The Role needs `get` on pods and `get, patch`
on the pools' `deployments/scale`, nothing more: it cannot change a pod, so it cannot change what runs.

One caveat: a pod that is still starting is not ready either, so a scale-down decided while another pod
starts could remove the starting one; the policy scales down only after a cooldown, when nothing starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import structlog

from queue_schemas.messages import Heartbeat
from scaler.backends import NO_ASKS, DrainAsks, pick_to_drain
from scaler.policy import Verdict

log = structlog.get_logger("sluice.scaler.backend")


PREFILL = "prefill"  # a pool's prefill Deployment is named the workload's name plus "-prefill"


class KubernetesBackend:
    def __init__(self, apps: Any, core: Any, namespace: str, workload: str = "sluice-worker-{pool}") -> None:
        self._apps = apps
        self._core = core
        self._namespace = namespace
        self._workload = workload
        self._wanted: dict[str, int] = {}
        self._asked: dict[str, str] = {}  # pool -> the pod asked to drain, not yet scaled away
        self._removed: set[str] = set()  # pods scaled away, still finishing their drain

    def launching(self, pool: str, known: set[str]) -> int:
        return max(0, self._wanted.get(pool, 0) - len(known))

    def apply(
        self, pool: str, verdict: Verdict, beats: Sequence[Heartbeat], spec_decoding: bool
    ) -> DrainAsks:
        present = {hb.worker_id for hb in beats}
        self._removed &= present
        asked = self._asked.get(pool)
        if asked is not None and asked not in present:
            del self._asked[pool]  # gone (crashed or removed by hand): nothing left to finish
            asked = None
        if verdict.action == "up":
            self._scale(pool, verdict.target)
            if asked is None:
                return NO_ASKS
            del self._asked[pool]
            log.info("drain withdrawn", pool=pool, pod=asked)
            return DrainAsks(withdraw=(asked,))
        if asked is None:
            if verdict.action != "down":
                return NO_ASKS
            victim = pick_to_drain(beats, present - self._removed)
            if victim is None:
                log.warning("no ready pod to drain", pool=pool)
                return NO_ASKS
            self._asked[pool] = victim
            log.info("asking pod to drain", pool=pool, pod=victim, reason=verdict.reason)
            return DrainAsks(drain=(victim,))
        if self._pod_ready(asked):
            return DrainAsks(drain=(asked,))  # the kubelet has not seen the probe fail yet
        self._scale(pool, self._replicas(pool) - 1)
        self._removed.add(asked)
        del self._asked[pool]
        return DrainAsks(drain=(asked,))

    def size_prefill(self, pool: str, target: int, beats: Sequence[Heartbeat]) -> None:
        """The pool's prefill Deployment (the workload's name plus `-prefill`) at `target` replicas. A
        prefill pod is scaled away without a drain: its queued jobs end in a local prefill."""
        if self._wanted.get(f"{pool}/{PREFILL}") != target:
            self._scale(pool, target, PREFILL)

    def _scale(self, pool: str, replicas: int, role: str = "") -> None:
        """Patch the pool's Deployment (for role `prefill`, its prefill Deployment) to `replicas`."""
        name = self._workload.format(pool=pool) + (f"-{role}" if role else "")
        self._apps.patch_namespaced_deployment_scale(name, self._namespace, {"spec": {"replicas": replicas}})
        self._wanted[f"{pool}/{role}" if role else pool] = replicas
        log.info("scaled deployment", pool=pool, deployment=name, replicas=replicas)

    def _replicas(self, pool: str) -> int:
        scale = self._apps.read_namespaced_deployment_scale(self._workload.format(pool=pool), self._namespace)
        return int(scale.spec.replicas or 0)

    def _pod_ready(self, pod: str) -> bool:
        status = self._core.read_namespaced_pod_status(pod, self._namespace).status
        return any(c.type == "Ready" and c.status == "True" for c in status.conditions or ())

    def close(self, timeout_s: float) -> None:
        return None
