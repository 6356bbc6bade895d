--[[ forget.lua: drop from the tenant registry tenants whose registration ran out.

KEYS[1]   tenant registry (zset)      lbp:tenants:until
ARGV      pairs: a tenant, and its score as the reaper read it (ms)
A tenant goes only while its score is still the one read (no call registered it again since the
reaper found it holding no lease: that call's lease may be on its way) and has passed by this
server's clock. Returns the tenants dropped.
]]
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local dropped = {}
for i = 1, #ARGV - 1, 2 do
  local kept = tonumber(redis.call('ZSCORE', KEYS[1], ARGV[i]))
  if kept and kept == tonumber(ARGV[i + 1]) and kept <= now_ms then
    redis.call('ZREM', KEYS[1], ARGV[i])
    dropped[#dropped + 1] = ARGV[i]
  end
end
return dropped
