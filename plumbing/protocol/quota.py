"""Team quotas in Redis: reserving prompt + max_tokens against the minute buckets and the day's budget,
and settling with what was used (writing the usage event in the same step). Every key is in the
team's slot."""

from __future__ import annotations

import time

from queue_schemas.names import Names

RESERVE_SCRIPT = """
-- KEYS: tokens bucket, requests bucket, day counter, reservation
-- ARGV: now_ms, cost, tpm (0 = none), rpm (0 = none), daily (0 = none), reservation ttl ms, day ttl s
local now = tonumber(ARGV[1])
local cost = tonumber(ARGV[2])
local tpm, rpm, daily = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
-- A request holds one reservation: one read again after a dispatcher died has it already.
if redis.call('EXISTS', KEYS[4]) == 1 then return {0, 0, '-1', '-1', '0'} end

local function level(key, cap)
  local v = redis.call('HMGET', key, 'level', 'ts')
  local lvl = tonumber(v[1]) or cap
  local ts = tonumber(v[2]) or now
  return math.min(cap, lvl + math.max(0, now - ts) * cap / 60000.0)
end

local tokens_left, requests_left, daily_used = -1, -1, 0
if tpm > 0 then
  tokens_left = level(KEYS[1], tpm)
  if cost > tpm then return {4, 0, tostring(tokens_left), '-1', '0'} end
  if tokens_left < cost then
    return {1, math.ceil((cost - tokens_left) * 60000.0 / tpm), tostring(tokens_left), '-1', '0'}
  end
end
if rpm > 0 then
  requests_left = level(KEYS[2], rpm)
  if requests_left < 1 then
    local wait = math.ceil((1 - requests_left) * 60000.0 / rpm)
    return {2, wait, tostring(tokens_left), tostring(requests_left), '0'}
  end
end
if daily > 0 then
  daily_used = tonumber(redis.call('GET', KEYS[3]) or '0')
  if daily_used + cost > daily then
    return {3, 0, tostring(tokens_left), tostring(requests_left), tostring(daily_used)}
  end
end

if tpm > 0 then
  tokens_left = tokens_left - cost
  redis.call('HSET', KEYS[1], 'level', tostring(tokens_left), 'ts', now)
  redis.call('PEXPIRE', KEYS[1], 120000)
end
if rpm > 0 then
  requests_left = requests_left - 1
  redis.call('HSET', KEYS[2], 'level', tostring(requests_left), 'ts', now)
  redis.call('PEXPIRE', KEYS[2], 120000)
end
daily_used = redis.call('INCRBY', KEYS[3], cost)
redis.call('EXPIRE', KEYS[3], tonumber(ARGV[7]))
redis.call('HSET', KEYS[4], 'cost', cost, 'tpm', tpm, 'day_key', KEYS[3])
redis.call('PEXPIRE', KEYS[4], tonumber(ARGV[6]))
return {0, 0, tostring(tokens_left), tostring(requests_left), tostring(daily_used)}
"""

SETTLE_SCRIPT = """
-- KEYS: reservation, tokens bucket, day counters of the day the request was reserved on and of the day
-- before, the request's usage mark, the team's usage outbox (all in the team's slot).
-- ARGV: now_ms, tokens really used, usage event ('' for none), '1' to write the event even when no
-- reservation is held (a request that ended before it reserved anything), usage mark ttl ms.
-- Returns the tokens refunded (-1: nothing to settle). The event goes to the outbox once per request,
-- with what the team was charged (the reservation less the refund; 0 without one).
local r = redis.call('HMGET', KEYS[1], 'cost', 'tpm', 'day_key')
local now = tonumber(ARGV[1])
local refund, charged = -1, 0
if r[1] then
  redis.call('DEL', KEYS[1])
  refund = math.max(0, tonumber(r[1]) - tonumber(ARGV[2]))
  charged = tonumber(r[1]) - refund
  local tpm = tonumber(r[2])
  if refund > 0 and tpm > 0 then
    local v = redis.call('HMGET', KEYS[2], 'level', 'ts')
    local lvl = tonumber(v[1]) or tpm
    local ts = tonumber(v[2]) or now
    lvl = math.min(tpm, lvl + math.max(0, now - ts) * tpm / 60000.0 + refund)
    redis.call('HSET', KEYS[2], 'level', tostring(lvl), 'ts', now)
    redis.call('PEXPIRE', KEYS[2], 120000)
  end
  if refund > 0 then
    for _, day in ipairs({KEYS[3], KEYS[4]}) do
      if r[3] == day and redis.call('EXISTS', day) == 1 then redis.call('DECRBY', day, refund) end
    end
  end
end
if ARGV[3] ~= '' and (r[1] or ARGV[4] == '1') then
  if redis.call('SET', KEYS[5], '1', 'NX', 'PX', tonumber(ARGV[5])) then
    redis.call('XADD', KEYS[6], '*', 'e', ARGV[3], 'charged', charged)
  end
end
return refund
"""


class Verdict:
    """Outcome codes of RESERVE_SCRIPT."""

    ADMITTED = 0
    TOKENS_PER_MINUTE = 1
    REQUESTS_PER_MINUTE = 2
    DAILY_BUDGET = 3
    LARGER_THAN_LIMIT = 4


def utc_day(now: float) -> str:
    return time.strftime("%Y%m%d", time.gmtime(now))


def reserve_keys(names: Names, team: str, request_id: str, now: float) -> list[str]:
    """KEYS of RESERVE_SCRIPT (all in the team's slot)."""
    return [
        names.quota_tokens(team),
        names.quota_requests(team),
        names.quota_day(team, utc_day(now)),
        names.reservation(team, request_id),
    ]


def settle_keys(names: Names, team: str, request_id: str, now: float) -> list[str]:
    """KEYS of SETTLE_SCRIPT: a reservation settles against the day counter it was charged to, today's
    or (for a request that ran past midnight UTC) yesterday's."""
    return [
        names.reservation(team, request_id),
        names.quota_tokens(team),
        names.quota_day(team, utc_day(now)),
        names.quota_day(team, utc_day(now - 86400)),
        names.usage_mark(team, request_id),
        names.usage_outbox(team),
    ]
