"""What a worker decides about a request before starting it, and facts about its own process.

BEGIN_SCRIPT runs atomically when a request is about to start; `start_refusal` is the pure check that
comes first.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from queue_schemas.errors import ErrorCode
from queue_schemas.messages import InferenceRequest
from queue_schemas.names import Names

# KEYS: cancelled mark, placement record, started mark, replay log, stream channel (one request's slot).
# ARGV: this worker's id, mark ttl ms, and optionally the publish command (PUBLISH or SPUBLISH), the
# first chunk, its seq and the log's ttl ms.
# Marks the request started unless it was cancelled, or re-placed on another worker while this one was
# presumed dead (the dispatcher moves a request only once its owner is gone). The first chunk goes out,
# and into the replay log, in the same step, so a request that may not start here publishes nothing,
# and starting costs no round trip of its own.
BEGIN_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 'cancelled' end
local owner = redis.call('GET', KEYS[2])
if owner and owner ~= ARGV[1] then return 'moved' end
redis.call('SET', KEYS[3], ARGV[1], 'PX', ARGV[2])
if ARGV[3] then
  redis.call('HSET', KEYS[4], ARGV[5], ARGV[4])
  redis.call('PEXPIRE', KEYS[4], ARGV[6])
  redis.call(ARGV[3], KEYS[5], ARGV[4])
end
return 'ok'
"""


def begin_keys(names: Names, request_id: str) -> list[str]:
    """KEYS of BEGIN_SCRIPT."""
    return [
        names.cancelled(request_id),
        names.placement(request_id),
        names.started(request_id),
        names.replay(request_id),
        names.stream_channel(request_id),
    ]


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
