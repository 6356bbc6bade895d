--[[ renew.lua: extend the lease of a live reservation, and the life of its scope keys.

KEYS[1]   reservation record (hash)   lbp:{tenant}:resv:<reservation id>
KEYS[2]   lease index (zset)          lbp:{tenant}:leases
KEYS[3..] the scope hashes named in the reservation (optional)
KEYS[last] the run's ledger index (list), when ARGV[3] names the run's scope
ARGV[1]   reservation id
ARGV[2]   lease length in ms from now
ARGV[3]   which scope is the run's (1-based; 0 = none, and no ledger index among KEYS): the index
          then lives as long as the run's meters (a stream longer than their TTL)
ARGV[4..] per scope (KEYS[3..], same order): its key's TTL in seconds (0 = none)
Returns 1 when renewed, 0 when the reservation is already settled (gone, or its settled marker)
or its lease has run out: from then on it is the reapers' (one may have read the amounts it will
bill), and a renewal must not make it live again under them.
A scope key outlived by a live reserve (a stream longer than its run's TTL) would lose the
reserve it holds: the next calls would not see it, and its settle would find nothing to release.
]]
if redis.call('HEXISTS', KEYS[1], 'amounts') == 0 then return 0 end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expiry = tonumber(redis.call('ZSCORE', KEYS[2], ARGV[1]))
if not expiry or expiry <= now_ms then return 0 end
redis.call('ZADD', KEYS[2], 'XX', now_ms + tonumber(ARGV[2]), ARGV[1])
local run_scope = tonumber(ARGV[3]) or 0
local last_scope = #KEYS - ((run_scope > 0) and 1 or 0)
-- As settle.lua: TTLs of the reserve's setting never shorten a key nor end one kept for ever.
for s = 3, last_scope do
  local ttl = tonumber(ARGV[s + 1])
  if ttl == 0 then
    redis.call('PERSIST', KEYS[s])
  elseif ttl then
    local left = redis.call('PTTL', KEYS[s])
    if left >= 0 and left < ttl * 1000 then redis.call('EXPIRE', KEYS[s], ttl) end
  end
end
if run_scope > 0 then
  local left = redis.call('PTTL', KEYS[2 + run_scope])
  if left == -1 then
    redis.call('PERSIST', KEYS[#KEYS])
  elseif left > 0 then
    redis.call('PEXPIRE', KEYS[#KEYS], left)
  end
end
return 1
