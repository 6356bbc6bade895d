--[[ renew.lua: extend the lease of a live reservation.

KEYS[1]  reservation record (hash)   lbp:{tenant}:resv:<reservation id>
KEYS[2]  lease index (zset)          lbp:{tenant}:leases
ARGV[1]  reservation id
ARGV[2]  lease length in ms from now
Returns 1 when renewed, 0 when the reservation is already settled (gone, or its settled marker)
or its lease has run out: from then on it is the reapers' (one may have read the amounts it will
bill), and a renewal must not make it live again under them.
]]
if redis.call('HEXISTS', KEYS[1], 'amounts') == 0 then return 0 end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expiry = tonumber(redis.call('ZSCORE', KEYS[2], ARGV[1]))
if not expiry or expiry <= now_ms then return 0 end
redis.call('ZADD', KEYS[2], 'XX', now_ms + tonumber(ARGV[2]), ARGV[1])
return 1
