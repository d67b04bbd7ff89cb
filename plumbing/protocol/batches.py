"""A /v1/batches batch in Redis (its answered lines and its status) and a team's caps on what it keeps."""

from __future__ import annotations

from queue_schemas.names import Names

COLLECT_SCRIPT = """
-- KEYS: the batch's hash, its lines hash (one slot: the team's).
-- ARGV: line number, output line, '1' when the line succeeded.
-- Stores the line's first answer only; returns how many lines have one (-1: no such batch or line,
-- -2: the batch is past collecting).
local total = tonumber(redis.call('HGET', KEYS[1], 'total') or '-1')
local line = tonumber(ARGV[1])
if total < 0 or line >= total then return -1 end
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'in_progress' and status ~= 'cancelling' and status ~= 'validating' then return -2 end
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) == 1 then
  redis.call('HINCRBY', KEYS[1], ARGV[3] == '1' and 'completed' or 'failed', 1)
end
return redis.call('HLEN', KEYS[2])
"""

TRANSITION_SCRIPT = """
-- KEYS: the batch's hash. ARGV: statuses it may be in (comma-separated), the new status, then field /
-- value pairs to set with it. Returns 1 when moved, 0 when the batch was in another status.
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 0 end
local allowed = false
for s in string.gmatch(ARGV[1], '[^,]+') do if s == status then allowed = true end end
if not allowed then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[2])
for i = 3, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 1
"""


def collect_keys(names: Names, team: str, batch_id: str) -> list[str]:
    return [names.batch_record(team, batch_id), names.batch_lines(team, batch_id)]


def transition_keys(names: Names, team: str, batch_id: str) -> list[str]:
    return [names.batch_record(team, batch_id)]


# KEYS: the team's storage hash. ARGV: triples of (field, amount, cap; cap < 0 means none).
# Adds every amount when each field stays within its cap; else adds nothing and returns the first
# field that would pass its cap. Returns '' when taken.
TAKE_SCRIPT = """
for i = 1, #ARGV, 3 do
  local cap = tonumber(ARGV[i + 2])
  local held = tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '0')
  if cap >= 0 and held + tonumber(ARGV[i + 1]) > cap then return ARGV[i] end
end
for i = 1, #ARGV, 3 do redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1]) end
return ''
"""

# KEYS: the team's storage hash. ARGV: pairs of (field, amount). Gives amounts back, never below 0.
GIVE_SCRIPT = """
for i = 1, #ARGV, 2 do
  local left = tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '0') - tonumber(ARGV[i + 1])
  redis.call('HSET', KEYS[1], ARGV[i], math.max(0, left))
end
return 1
"""

# KEYS: the team's stored responses (sorted by expiry). ARGV: now, cap, response id, its expiry.
# Drops what expired, then adds the response if the team holds fewer than `cap`. Returns 1 if added.
RESPONSE_SCRIPT = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZSCORE', KEYS[1], ARGV[3]) then return 1 end
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[4], ARGV[3])
redis.call('EXPIREAT', KEYS[1], math.ceil(tonumber(ARGV[4])))
return 1
"""


def storage_keys(names: Names, team: str) -> list[str]:
    """KEYS of TAKE_SCRIPT and GIVE_SCRIPT."""
    return [names.team_storage(team)]


def responses_keys(names: Names, team: str) -> list[str]:
    """KEYS of RESPONSE_SCRIPT."""
    return [names.team_responses(team)]
