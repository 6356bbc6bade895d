--[[ register.lua: keep tenants in the registry the lease reapers read.

KEYS[1]   tenant registry (zset)      lbp:tenants:until
ARGV[1]   for how many ms from now
ARGV[2..] the tenants
Each tenant's score is until when (ms, by this server's clock) a registration keeps it there; one
kept until later already (another instance's, registered for longer) keeps its time. Returns now
plus ARGV[1], in ms. A tenant whose registration ran out and that holds no lease is dropped by a
reaper (forget.lua): the clock of both is this server's, whatever the instances' own.
]]
local t = redis.call('TIME')
local until_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
for i = 2, #ARGV do
  local kept = tonumber(redis.call('ZSCORE', KEYS[1], ARGV[i]))
  if not kept or kept < until_ms then
    redis.call('ZADD', KEYS[1], until_ms, ARGV[i])
  end
end
return until_ms
