--[[ expired.lua: list reservations whose lease has run out, with what the reaper needs.

KEYS[1]  lease index (zset)          lbp:{tenant}:leases
ARGV[1]  key prefix of reservation records, lbp:{tenant}:resv:
ARGV[2]  at most this many
Returns a flat list: id, scopes, amounts, record, for each expired reservation. Ids whose
record is gone (settled between the lease check and now) are dropped from the index.
]]
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now_ms, 'LIMIT', 0, tonumber(ARGV[2]))
local out = {}
for _, id in ipairs(ids) do
  local rec = redis.call('HMGET', ARGV[1] .. id, 'scopes', 'amounts', 'record')
  if rec[1] then
    out[#out + 1] = id
    out[#out + 1] = rec[1]
    out[#out + 1] = rec[2]
    out[#out + 1] = rec[3]
  else
    redis.call('ZREM', KEYS[1], id)
  end
end
return out
