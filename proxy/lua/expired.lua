--[[ expired.lua: list reservations whose lease has run out.

KEYS[1]  lease index (zset)          lbp:{tenant}:leases
ARGV[1]  at most this many
ARGV[2]  only those that ran out at least this many ms ago (absent: 0)
Returns their ids. The reaper reads each record with lease.lua, which names the record's key.
]]
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local grace_ms = tonumber(ARGV[2]) or 0
return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now_ms - grace_ms, 'LIMIT', 0, tonumber(ARGV[1]))
