"""What a worker decides about a request before starting it, and facts about its own process.

plumbing.protocol.request.BEGIN_SCRIPT runs atomically when a request is about to start;
`start_refusal` is the pure check that comes first.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from queue_schemas.errors import ErrorCode
from queue_schemas.messages import InferenceRequest

STARTED_MARK_TTL_MS = 24 * 3600 * 1000
FAILED_HEARTBEAT_TTL_MS = 60_000  # a failed worker's last heartbeat stays readable for ops this long


def process_started_at() -> float:
    """When this process started (epoch seconds), so a replica's measured start-up includes its imports."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(
            int(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def start_refusal(request: InferenceRequest, now: float) -> tuple[str, str] | None:
    """Why a request taken from the inbox must not start: (error code, message), or None to run it."""
    if now > request.start_deadline():
        return ErrorCode.TIMEOUT, "no engine could start the request before its queue deadline"
    return None
