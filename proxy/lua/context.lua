--[[ context.lua: keep the size of a context the provider keeps (an answer, a conversation).

KEYS[1..] lbp:{tenant}:ctx:<id>, one per id the context is kept under
ARGV[1]   its size in tokens (what the proxy billed the call that made it, input and output)
ARGV[2]   how long it is kept, in seconds
ARGV[3]   1: the size is the provider's figures (or the count of a whole answer); 0: it is the
          call's reserve, a bound (an answer cut or timed out before the proxy saw it whole)
ARGV[4]   the size of the context that call continued (0: none known)
A value is the size in digits; a bound's is followed by '~' and the size it continued.

A size is never lowered by another real size, only its life extended: a conversation grows, and
a call on it that ends late (a stream whose upstream is slow to close, continued at its
response.completed; calls on one conversation at once) must not write its older, smaller figure
over a later call's. A bound gives way to a real size above the one it continued from a call
that continued at least as much (a later call's figures, which hold what the cut call added), so
a cut call's reserve does not stay on its conversation; an older call's figures, ending late (it
continued less, or an unknown size), do not replace it.
]]
local size, ttl = tonumber(ARGV[1]), tonumber(ARGV[2])
-- A TTL of 0 (prior contexts turned off by a reload while a write was on its way) keeps nothing:
-- not EXPIRE 0, which deletes a size kept, nor SET EX 0, which fails half-way through the keys.
if not size or not ttl or ttl <= 0 then
  return 0
end
local real = ARGV[3] == '1'
local value = real and ARGV[1] or (ARGV[1] .. '~' .. (ARGV[4] or '0'))
for _, key in ipairs(KEYS) do
  local raw = redis.call('GET', key)
  -- Parsed as the proxy reads it (digits only): anything else is replaced.
  local digits, mark, base = nil, '', ''
  if raw then
    digits, mark, base = string.match(raw, '^(%d+)(~?)(%d*)$')
  end
  local kept = tonumber(digits)
  local replace
  if not kept then
    replace = true
  elseif mark == '~' and real then
    local continued = tonumber(base) or 0
    replace = size > continued and (tonumber(ARGV[4]) or 0) >= continued
  else
    replace = size > kept
  end
  if replace then
    redis.call('SET', key, value, 'EX', ARGV[2])
  else
    redis.call('EXPIRE', key, ARGV[2])
  end
end
return 1
