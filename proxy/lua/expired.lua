--[[ expired.lua: list reservations whose lease has run out.

KEYS[1]  lease index (zset)          lbp:{tenant}:leases
ARGV[1]  at most this many
ARGV[2]  only those that ran out at least this many ms ago (absent: 0)
ARGV[3]  past this many of them, oldest first (absent: 0): those a round left in the index (a
         record it cannot read, a settle the store refuses) do not hide the ones after them
Returns their ids. The reaper reads each record with lease.lua, which names the record's key.
]]
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local grace_ms = tonumber(ARGV[2]) or 0
local skip = tonumber(ARGV[3]) or 0
return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now_ms - grace_ms, 'LIMIT', skip, tonumber(ARGV[1]))
