--[[ shrink.lua: lower a live reservation to smaller amounts (its input counted exactly after a
quick upper bound reserved it), never raise it.

KEYS[1]      reservation record (hash)          lbp:{tenant}:resv:<reservation id>
KEYS[2]      lease index (zset)                 lbp:{tenant}:leases
KEYS[3..]    the scope hashes named in the reservation, in the same order
ARGV[1..6]   the new amounts, in reserve.lua's METERS order
ARGV[7]      reservation id

Returns 1 when the reserve was lowered; 0 when there is nothing to lower: the call is settled
already, its lease has run out (a reaper may have read the amounts it will bill: lowering them
now would release less than it bills), or an amount would grow (then nothing changes).
]]
local rec = redis.call('HMGET', KEYS[1], 'amounts', 'born')
local raw = rec[1]
if not raw then return 0 end
local born = {}
if rec[2] then
  for v in string.gmatch(rec[2], '%S+') do born[#born + 1] = v end
end
local expiry = tonumber(redis.call('ZSCORE', KEYS[2], ARGV[7]))
local t = redis.call('TIME')
if not expiry or expiry <= tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) then return 0 end
local METERS = {'requests', 'input_tokens', 'output_tokens', 'total_tokens', 'cost_micros', 'concurrent'}
local old = {}
for v in string.gmatch(raw, '%S+') do old[#old + 1] = tonumber(v) end
local new, less = {}, {}
for m = 1, #METERS do
  new[m] = tonumber(ARGV[m])
  if not new[m] or not old[m] or new[m] > old[m] or new[m] < 0 then return 0 end
  less[m] = old[m] - new[m]
end
for s = 3, #KEYS do
  -- Only from the life of the key this reserve landed in, never below zero (see settle.lua).
  -- '-': the scope held none of this reserve.
  if born[s - 2] ~= '-' and (not born[s - 2] or redis.call('HGET', KEYS[s], 'born') == born[s - 2]) then
    for m = 1, #METERS do
      if less[m] > 0 then
        local held = tonumber(redis.call('HGET', KEYS[s], 'resv:' .. METERS[m])) or 0
        local release = math.min(less[m], held)
        if release > 0 then
          redis.call('HINCRBY', KEYS[s], 'resv:' .. METERS[m], string.format('%d', -release))
        end
      end
    end
  end
end
local amt = {}
for m = 1, #METERS do amt[m] = string.format('%d', new[m]) end
redis.call('HSET', KEYS[1], 'amounts', table.concat(amt, ' '))
return 1
