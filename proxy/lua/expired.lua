--[[ expired.lua: list reservations whose lease has run out.

KEYS[1]  lease index (zset)          lbp:{tenant}:leases
ARGV[1]  at most this many
Returns their ids. The reaper reads each record with lease.lua, which names the record's key.
]]
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now_ms, 'LIMIT', 0, tonumber(ARGV[1]))
