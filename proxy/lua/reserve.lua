--[[ reserve.lua: reserve the worst case of one call against every scope, all or nothing.

KEYS[1]      reservation record (hash)              lbp:{tenant}:resv:<reservation id>
KEYS[2]      lease index (zset: id -> expiry ms)    lbp:{tenant}:leases
KEYS[3..]    scope meters (hash), one per scope     lbp:{tenant}:run:<run> / :key:... / :tenant:...
ARGV[1]      reservation id
ARGV[2]      lease length in ms
ARGV[3]      record: opaque JSON kept for the reaper
ARGV[4..9]   amounts for the meters, in METERS order
then per scope (KEYS[3+i]):  ttl_s (0 = none), then 6 ceilings in METERS order (-1 = unlimited)

Every key carries the same {tenant} hash tag, so one Redis Cluster slot holds them all.
Scope hash fields: used:<meter>, resv:<meter>, peak:concurrent.
Returns {1, now_ms} on success, or {0, scope index (1-based), meter, ceiling, used, reserved, amount}.
Landing exactly on a ceiling is allowed: used + reserved + amount <= ceiling.
]]
local METERS = {'requests', 'input_tokens', 'output_tokens', 'total_tokens', 'cost_micros', 'concurrent'}
local NM = #METERS
local nscopes = #KEYS - 2
local amounts = {}
for m = 1, NM do amounts[m] = tonumber(ARGV[3 + m]) end

local base = 4 + NM
local stride = 1 + NM
for s = 1, nscopes do
  local key = KEYS[2 + s]
  local off = base + (s - 1) * stride
  for m = 1, NM do
    local ceiling = tonumber(ARGV[off + m])
    if ceiling >= 0 and amounts[m] > 0 then
      local vals = redis.call('HMGET', key, 'used:' .. METERS[m], 'resv:' .. METERS[m])
      local used = tonumber(vals[1]) or 0
      local resv = tonumber(vals[2]) or 0
      if used + resv + amounts[m] > ceiling then
        return {0, s, METERS[m], ceiling, used, resv, amounts[m]}
      end
    end
  end
end

for s = 1, nscopes do
  local key = KEYS[2 + s]
  for m = 1, NM do
    if amounts[m] ~= 0 then
      local now = redis.call('HINCRBY', key, 'resv:' .. METERS[m], amounts[m])
      if METERS[m] == 'concurrent' then
        local peak = tonumber(redis.call('HGET', key, 'peak:concurrent')) or 0
        if now > peak then redis.call('HSET', key, 'peak:concurrent', now) end
      end
    end
  end
  local ttl = tonumber(ARGV[base + (s - 1) * stride])
  if ttl > 0 then redis.call('EXPIRE', key, ttl) end
end

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local scopes = {}
for s = 1, nscopes do scopes[s] = KEYS[2 + s] end
local amt = {}
for m = 1, NM do amt[m] = ARGV[3 + m] end
redis.call('HSET', KEYS[1], 'scopes', table.concat(scopes, '\n'), 'amounts', table.concat(amt, ' '),
  'record', ARGV[3], 'reserved_at_ms', now_ms)
redis.call('ZADD', KEYS[2], now_ms + tonumber(ARGV[2]), ARGV[1])
return {1, now_ms}
