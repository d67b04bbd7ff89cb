"""Teams' claims on reply-topic prefixes: no two teams' prefixes overlap."""

from __future__ import annotations

from queue_schemas.names import Names

# KEYS: the reply-prefix owners hash (prefix -> team). ARGV: the team, then the prefixes it wants.
# Returns the first wanted prefix that overlaps (one a prefix of the other) a prefix another team holds,
# changing nothing; else releases every prefix the team holds, claims the wanted ones and returns ''.
CLAIM_SCRIPT = """
local team = ARGV[1]
local held = redis.call('HGETALL', KEYS[1])
for i = 2, #ARGV do
  local want = ARGV[i]
  for j = 1, #held, 2 do
    local other = held[j]
    if held[j + 1] ~= team
      and (string.sub(want, 1, #other) == other or string.sub(other, 1, #want) == want) then
      return want
    end
  end
end
for j = 1, #held, 2 do
  if held[j + 1] == team then redis.call('HDEL', KEYS[1], held[j]) end
end
for i = 2, #ARGV do redis.call('HSET', KEYS[1], ARGV[i], team) end
return ''
"""


def claim_keys(names: Names) -> list[str]:
    """KEYS of CLAIM_SCRIPT."""
    return [names.reply_prefix_owners()]
