--[[ view.lua: scopes' meters as one atomic read, with what the calls in flight reserved there
without holding it (reserve.lua's '-' scopes), so a call is never seen both in flight and used.

KEYS[1]        lease index (zset)              lbp:{tenant}:leases
KEYS[2..n+1]   the scope hashes to read        (n = ARGV[1])
KEYS[n+2..]    the records of the calls in flight, as the caller last read the lease index
ARGV[1]        n
ARGV[2..]      the ids of those records, in the same order
Returns {0} when the lease index holds an id the caller did not pass (a call reserved since it
read the index: it reads again); else {1, per scope its fields as HGETALL gives them, per scope
the unheld amounts in reserve.lua's METERS order}.
]]
local n = tonumber(ARGV[1])
local passed = {}
for i = 2, #ARGV do passed[ARGV[i]] = true end
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if not passed[id] then return {0} end
end
local index = {}
for s = 1, n do index[KEYS[1 + s]] = s end
local unheld = {}
for s = 1, n do unheld[s] = {0, 0, 0, 0, 0, 0} end
for r = n + 2, #KEYS do
  local rec = redis.call('HMGET', KEYS[r], 'scopes', 'amounts', 'born')
  -- Settled since (its figures are in the used meters now), or written before a scope could
  -- hold nothing (no born: it held everywhere).
  if rec[1] and rec[2] and rec[3] then
    local amounts, lives, k = {}, {}, 0
    for v in string.gmatch(rec[2], '%S+') do amounts[#amounts + 1] = tonumber(v) or 0 end
    for v in string.gmatch(rec[3], '%S+') do lives[#lives + 1] = v end
    for key in string.gmatch(rec[1], '[^\n]+') do
      k = k + 1
      local s = index[key]
      if s and lives[k] == '-' then
        for m = 1, 6 do unheld[s][m] = unheld[s][m] + (amounts[m] or 0) end
      end
    end
  end
end
local out = {1}
for s = 1, n do out[#out + 1] = redis.call('HGETALL', KEYS[1 + s]) end
for s = 1, n do out[#out + 1] = unheld[s] end
return out
