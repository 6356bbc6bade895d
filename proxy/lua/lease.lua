--[[ lease.lua: what the reaper needs of one reservation.

KEYS[1]  reservation record (hash)   lbp:{tenant}:resv:<reservation id>
KEYS[2]  lease index (zset)          lbp:{tenant}:leases
ARGV[1]  reservation id
Returns {scopes, amounts, record, scope TTLs (nil in records written before they were kept),
clamped output per choice (0: not clamped)},
or {} when the record is gone (settled meanwhile), in which case the id is dropped from the
index.
]]
local rec = redis.call('HMGET', KEYS[1], 'scopes', 'amounts', 'record', 'ttls', 'clamped')
if not rec[1] then
  redis.call('ZREM', KEYS[2], ARGV[1])
  return {}
end
return rec
