"""Dispatchers' membership of a pool and their leases on its partitions, by the server's clock."""

from __future__ import annotations

# KEYS: members zset. ARGV: this dispatcher, lease ms. Registers it until now + lease and returns the
# live members, by the server's clock (so hosts' clocks never matter).
MEMBERS_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]) * 10)
return redis.call('ZRANGE', KEYS[1], 0, -1)
"""
# KEYS: lease keys. ARGV: this dispatcher, lease ms, then one action per key: 'renew', 'claim' or
# 'release'. Returns, per key, 1 if this dispatcher holds it afterwards, else 0.
LEASE_SCRIPT = """
local out = {}
for i, key in ipairs(KEYS) do
  local action = ARGV[i + 2]
  local owner = redis.call('GET', key)
  if action == 'release' then
    if owner == ARGV[1] then redis.call('DEL', key) end
    out[i] = 0
  elseif owner == ARGV[1] or (action == 'claim' and not owner) then
    redis.call('SET', key, ARGV[1], 'PX', ARGV[2])
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
"""
