--[[ reserve.lua: reserve the worst case of one call against every scope, all or nothing.

KEYS[1]      reservation record (hash)              lbp:{tenant}:resv:<reservation id>
KEYS[2]      lease index (zset: id -> expiry ms)    lbp:{tenant}:leases
KEYS[3..]    scope meters (hash), one per scope     lbp:{tenant}:run:<run> / :key:... / :tenant:...
KEYS[last]   the run's ledger index (list), when ARGV[last] names the run's scope: it then lives
             as long as the run's meters (a call reserved late in their life outlives the old TTL)
ARGV[1]      reservation id
ARGV[2]      lease length in ms
ARGV[3]      record: opaque JSON kept for the reaper
ARGV[4..9]   amounts for the meters, in METERS order
ARGV[10]     clamp: smallest output per choice worth keeping (0 = never clamp, refuse instead)
ARGV[11]     clamp: choices (n); the output reserve is per-choice cap * n
ARGV[12]     clamp: exact input cost (input tokens * micro-units per million input tokens), an
             integer in decimal: read as millions and the rest, exact past 2^53
ARGV[13]     clamp: micro-units per million output tokens (an integer, read the same way)
ARGV[14]     1: tentative (the input amount is a quick upper bound the caller can refine): amounts
             that do not fit on a token or cost meter write nothing, not even the refusal
             count, and return {2}; the caller counts exactly and reserves again. 0: final
ARGV[15]     when the first of the scopes' windows ends (seconds since 1970; 0 = no window): the
             caller picked them by its measure of this server's clock (TIME) before it sent the
             script; one that runs at or after that end (a server slow to run it: a stall, a
             pause) writes nothing and returns {3, TIME's seconds}: the caller picks them again
ARGV[16]     when the last of the scopes' windows begins (seconds since 1970; 0 = no window): one
             that runs before it (the caller's measure ahead of TIME: this server's clock stepped
             back, a failover to a replica whose clock is behind) writes nothing and returns
             {3, TIME's seconds} too
then per scope (KEYS[3+i]):  ttl_s (0 = none: the key is made persistent), hold (1: the scope holds
             the reserve, see below; the run's always does), then 6 ceilings in METERS order
             (-1 = unlimited)
ARGV[last]   which scope is the run's (1-based; 0 = none, and no ledger index among KEYS)

Every key carries the same {tenant} hash tag, so one Redis Cluster slot holds them all.
Scope hash fields: used:<meter>, resv:<meter>, peak:concurrent, refused:<meter>, born (the id of
the reserve that wrote the key first: a key that expired and was written anew is another life).
A scope holds a call's reserve (resv:*, peak:concurrent, born) only when it is the run's or its
hold argument is 1 (the caller's rule, Scope.holds: the key's lifetime, a scope with a ceiling
for this call, a tenant window another tier of the tenant limits) or a ceiling is set there;
the record's 'born' says '-' for the others, where only the settle writes (the used figures).
A ceiling a reload adds there counts the calls then in flight when they settle, not before.
The record keeps the scopes' keys and TTLs: renew.lua's caller and the reaper's settle set
those TTLs again, so a scope key never expires under a live reserve nor is written anew for good.
Landing exactly on a ceiling is allowed: used + reserved + amount <= ceiling.
A reservation id that already exists is a retry: success, nothing changes, and the clamp the
first try made is returned again (the caller must send the lowered cap Redis holds the call to).
Returns on success {1, clamped output per choice (0 = not clamped), rooms: for each limited
meter of each scope, in scope order, its index in METERS (1-based), its room (ceiling - used -
reserved, this call's reserve aside) and its ceiling, flat}; on refusal
{0, scope index (1-based), meter, ceiling, used, reserved, amount, clears (1: every limited meter
of every scope would fit once the calls in flight end: their reserves gone, save requests, which
all count when they settle; under a clamp, at the least output it keeps; the client may try again
soon), the indices of the scopes that would still refuse then (space-separated)}; {2} as ARGV[14]
says; {3, seconds} as ARGV[15] and ARGV[16] say.
]]
-- Idempotent by reservation id: a client retry after a lost reply must not reserve twice.
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {1, tonumber(redis.call('HGET', KEYS[1], 'clamped')) or 0, {}}
end
-- Held to a window that has ended, the call would be refused by a ceiling that has reset, or
-- counted in a window that is over (the next one's ceiling passed by it); held to one that has
-- not begun, counted where the current window's ceiling does not see it.
local t = redis.call('TIME')
local secs, ends = tonumber(t[1]), tonumber(ARGV[15])
if (ends > 0 and secs >= ends) or secs < tonumber(ARGV[16]) then return {3, t[1]} end

-- The TTL this call's config gives a scope key, which an operator's reload may have changed:
-- 0 is none (runs kept for ever, a key's all-time scope), so a TTL an earlier setting gave the
-- key goes. The reserve's setting is the newest a key sees (settle.lua only lengthens), save a
-- shorter one on a run with calls in flight (busy): a non-streaming call never renews its run's
-- keys, which the setting it was reserved under made outlive its lease, and a reload may shorten
-- the timeouts and the setting together. Set then, the run's keys would expire under that call
-- (its reserve and the run's past spend with them); the first reserve of an idle run sets it.
local function set_ttl(key, ttl, busy)
  if ttl <= 0 then
    redis.call('PERSIST', key)
    return
  end
  if busy then
    local left = redis.call('PTTL', key)
    if left == -1 or left > ttl * 1000 then return end
  end
  redis.call('EXPIRE', key, ttl)
end

local METERS = {'requests', 'input_tokens', 'output_tokens', 'total_tokens', 'cost_micros', 'concurrent'}
local NM = #METERS
local OUTPUT, TOTAL, COST, INPUT = 3, 4, 5, 2
local run_scope = tonumber(ARGV[#ARGV]) or 0
local nscopes = #KEYS - 2 - ((run_scope > 0) and 1 or 0)
-- The run's ledger index lives as long as the run's meters, whatever a reserve or a refusal
-- (which writes the run key too) did to their TTL.
local function index_follows_run()
  if run_scope == 0 then return end
  local left = redis.call('PTTL', KEYS[2 + run_scope])
  if left == -1 then
    redis.call('PERSIST', KEYS[#KEYS])
  elseif left > 0 then
    redis.call('PEXPIRE', KEYS[#KEYS], left)
  end
end
local base = 17
local stride = 2 + NM

local amounts = {}
for m = 1, NM do amounts[m] = tonumber(ARGV[3 + m]) end

-- used:<meter> then resv:<meter>, in METERS order, then born and peak:concurrent: written out,
-- as building them from METERS took a dozen string concatenations every call.
local FIELDS = {'used:requests', 'used:input_tokens', 'used:output_tokens', 'used:total_tokens',
  'used:cost_micros', 'used:concurrent', 'resv:requests', 'resv:input_tokens', 'resv:output_tokens',
  'resv:total_tokens', 'resv:cost_micros', 'resv:concurrent', 'born', 'peak:concurrent'}
-- A meter's field as a number (absent: 0). A field at 0 (the resv:* fields of a scope with no
-- call in flight) skips tonumber: a C string-to-double conversion, several times the cost of
-- the comparison, and a reserve makes dozens.
local function num(v)
  if v == nil or v == '0' then return 0 end
  return tonumber(v) or 0
end
-- Whether a scope's fields, as read before this reserve wrote, hold calls in flight (each holds
-- a request until it settles). at: where resv:requests is in vals, less one (FIELDS: NM).
local function holds_calls(vals, at)
  return vals ~= nil and num(vals[at + 1]) > 0
end
local state = {}   -- state[s][m] = {ceiling, used, reserved} for limited meters
local held = {}    -- held[s]: the scope holds this call's reserve
local seen = {}    -- seen[s]: the scope's FIELDS, when its check read them
for s = 1, nscopes do
  state[s] = {}
  local off = base + (s - 1) * stride
  held[s] = (s == run_scope) or ARGV[off + 1] == '1'
  local vals = nil
  for m = 1, NM do
    -- Most ceilings are unlimited: comparing the string is far cheaper than tonumber.
    local arg, ceiling = ARGV[off + 1 + m], -1
    if arg ~= '-1' then ceiling = tonumber(arg) end
    if ceiling >= 0 then
      held[s] = true  -- whatever the caller said: a ceiling checks what is held
      -- One read per limited scope (a call costs more than the fields it names).
      vals = vals or redis.call('HMGET', KEYS[2 + s], unpack(FIELDS))
      seen[s] = vals
      state[s][m] = {ceiling, tonumber(vals[m]) or 0, num(vals[NM + m])}
    end
  end
end

local function check(amt)
  for s = 1, nscopes do
    for m = 1, NM do
      local st = state[s][m]
      if st and amt[m] > 0 and st[2] + st[3] + amt[m] > st[1] then
        return {0, s, METERS[m], st[1], st[2], st[3], amt[m]}
      end
    end
  end
  return nil
end

local clamped = 0
local refusal = check(amounts)
if refusal and ARGV[14] == '1' and refusal[3] ~= 'requests' and refusal[3] ~= 'concurrent' then
  return {2}
end
local clamp_min = tonumber(ARGV[10])
local n = tonumber(ARGV[11])
local out_rate = tonumber(ARGV[13])
-- Costs in millionths of a micro-unit pass 2^53 (a double's exact integers) with a large room
-- and a large price: a clamped output's cost is worked out in parts that stay exact.
local function millions(digits)
  local len = #digits
  if len <= 6 then return 0, tonumber(digits) end
  return tonumber(string.sub(digits, 1, len - 6)), tonumber(string.sub(digits, len - 5))
end
local function cost_of(output)  -- ceil((input cost + output * out_rate) / 10^6), exactly
  local in_q, in_r = millions(ARGV[12])
  local out_q, out_r = millions(ARGV[13])
  local hi = math.floor(output / 1000000)
  local rest = in_r + (output - hi * 1000000) * out_r
  local rest_q = math.floor(rest / 1000000)
  return in_q + output * out_q + hi * out_r + rest_q + ((rest > rest_q * 1000000) and 1 or 0)
end
local function with_output(output)  -- the amounts with this output: its total and cost follow
  local trial = {}
  for m = 1, NM do trial[m] = amounts[m] end
  trial[OUTPUT] = output
  trial[TOTAL] = amounts[INPUT] + output
  if amounts[COST] > 0 or out_rate > 0 then trial[COST] = cost_of(output) end
  return trial
end
if refusal and clamp_min > 0 and (refusal[3] == 'output_tokens' or refusal[3] == 'total_tokens'
    or refusal[3] == 'cost_micros') then
  -- The largest output the tightest scope can still pay for, below the output refused (a k at
  -- or above it would try nothing).
  local k = amounts[OUTPUT] - 1
  local in_q, in_r = millions(ARGV[12])
  for s = 1, nscopes do
    local st = state[s]
    if st[OUTPUT] then k = math.min(k, st[OUTPUT][1] - st[OUTPUT][2] - st[OUTPUT][3]) end
    if st[TOTAL] then k = math.min(k, st[TOTAL][1] - st[TOTAL][2] - st[TOTAL][3] - amounts[INPUT]) end
    if st[COST] and out_rate > 0 then
      -- The input's cost taken from the room in whole micro-units first: room * 10^6 less the
      -- input's cost, two doubles near 10^21 at the dearest prices, was off by tens of thousands
      -- of tokens. What is left, in millionths of a micro-unit, is exact below 2^53; past it the
      -- quotient is off by less than one (each figure below 2^53, three roundings): k starts
      -- one above it.
      local left = (st[COST][1] - st[COST][2] - st[COST][3] - in_q) * 1000000 - in_r
      local fits = math.floor(left / out_rate)
      if left >= 9007199254740992 then fits = fits + 1 end
      k = math.min(k, fits)
    end
  end
  local per_choice = math.floor(k / n)
  -- Each trial is checked exactly against every ceiling, one step lower at a time: the cost's
  -- k is at most two above what fits.
  local steps = 3
  local blocked = nil  -- what refused the clamped output, when a clamp was tried
  while steps > 0 and per_choice >= clamp_min and per_choice * n < amounts[OUTPUT] do
    local trial = with_output(per_choice * n)
    blocked = check(trial)
    if not blocked then
      amounts = trial
      clamped = per_choice
      refusal = nil
      break
    end
    steps = steps - 1
    per_choice = per_choice - 1
  end
  -- The output was affordable: what refuses the call is what refused the clamped output (calls
  -- in flight, requests, the input), not the output the clamp would have lowered.
  if refusal and blocked and blocked[3] ~= 'output_tokens' and blocked[3] ~= 'total_tokens'
      and blocked[3] ~= 'cost_micros' then
    refusal = blocked
  end
end

if refusal then
  -- Would the call fit once the calls in flight end (their reserves gone, save requests, which
  -- all count when they settle)? Under a clamp, at the least output the clamp keeps.
  local least = amounts
  if clamp_min > 0 then least = with_output(math.min(amounts[OUTPUT], clamp_min * n)) end
  local clears, tokens_wait, waits = 1, false, {}
  for s = 1, nscopes do
    for m = 1, NM do
      local st = state[s][m]
      if st and least[m] > 0 then
        local in_flight = (METERS[m] == 'requests') and st[3] or 0
        if st[2] + in_flight + least[m] > st[1] then
          clears = 0
          if METERS[m] ~= 'requests' and METERS[m] ~= 'concurrent' then tokens_wait = true end
          if waits[#waits] ~= s then waits[#waits + 1] = s end
        end
      end
    end
  end
  -- A tentative input is an upper bound: a token or cost ceiling it passes may take the exact
  -- count, which then decides what clears and which windows are in the way.
  if ARGV[14] == '1' and tokens_wait then return {2} end
  refusal[8] = clears
  refusal[9] = table.concat(waits, ' ')
  local key = KEYS[2 + refusal[2]]
  redis.call('HINCRBY', key, 'refused:' .. refusal[3], 1)
  -- A refusal may write the key first (a run's first call): it expires as a reserve's would.
  local ttl = tonumber(ARGV[base + (refusal[2] - 1) * stride])
  set_ttl(key, ttl, refusal[2] == run_scope and holds_calls(seen[refusal[2]], NM))
  if refusal[2] == run_scope then index_follows_run() end
  return refusal
end

-- Below this a sum in Lua's numbers (doubles) is exact; past it (never in practice) HINCRBY adds.
local EXACT = 9007199254740992
-- The amounts as written (the record's, and a meter's new value where it held nothing).
local amt = {}
for m = 1, NM do amt[m] = string.format('%d', amounts[m]) end

-- Writes this call's reserve on scope s; returns which life of the key it landed in: one that
-- expired and was written anew holds other calls' reserves, never this one's (settle.lua and
-- shrink.lua release only from it). One read of the scope's fields (the check's, where it read
-- them, else only the resv:* ones, born and peak) and one write of them all: one HINCRBY per
-- meter made most of a reserve's commands, and every field a command names costs Redis too.
local function hold(s)
  local key = KEYS[2 + s]
  local vals, at = seen[s], NM  -- at: where resv:requests is in vals, less one
  if not vals then
    vals, at = redis.call('HMGET', key, unpack(FIELDS, NM + 1)), 0
  end
  local life, peak, writes, n = vals[at + NM + 1], num(vals[at + NM + 2]), {}, 0
  if not life then
    life = ARGV[1]
    writes[1], writes[2], n = 'born', ARGV[1], 2
  end
  for m = 1, NM do
    if amounts[m] ~= 0 then
      local have = num(vals[at + m])
      local now = have + amounts[m]
      local now_s = nil
      if have < EXACT and now < EXACT then
        now_s = (have == 0) and amt[m] or string.format('%d', now)
        writes[n + 1], writes[n + 2], n = FIELDS[NM + m], now_s, n + 2
      else
        now = redis.call('HINCRBY', key, FIELDS[NM + m], amt[m])
      end
      if m == NM and now > peak then  -- concurrent, METERS' last
        writes[n + 1], writes[n + 2], n = 'peak:concurrent', now_s or string.format('%d', now), n + 2
      end
    end
  end
  if n > 0 then redis.call('HSET', key, unpack(writes)) end
  set_ttl(key, tonumber(ARGV[base + (s - 1) * stride]), s == run_scope and holds_calls(vals, at))
  return life
end

-- The room of each limited meter, this call aside: its caller names the tightest once the call
-- is settled, at its real figures (at its worst case here, a large output cap or the call's own
-- concurrency slot would name a meter that is not tight).
local rooms = {}
local born = {}
for s = 1, nscopes do
  -- A scope that does not hold (a window nobody limits) is only counted by the settle: most of
  -- a call's scopes are such windows, and holding and releasing there was most of what Redis
  -- spent on a call.
  born[s] = held[s] and hold(s) or '-'
  for m = 1, NM do
    local st = state[s][m]
    if st then
      rooms[#rooms + 1] = m
      rooms[#rooms + 1] = st[1] - st[2] - st[3]
      rooms[#rooms + 1] = st[1]
    end
  end
end

local now_ms = secs * 1000 + math.floor(tonumber(t[2]) / 1000)
local scopes, ttls = {}, {}
for s = 1, nscopes do
  scopes[s] = KEYS[2 + s]
  ttls[s] = ARGV[base + (s - 1) * stride]
end
redis.call('HSET', KEYS[1], 'scopes', table.concat(scopes, '\n'), 'amounts', table.concat(amt, ' '),
  'record', ARGV[3], 'reserved_at_ms', now_ms, 'clamped', clamped, 'ttls', table.concat(ttls, ' '), 'born', table.concat(born, ' '))
redis.call('ZADD', KEYS[2], now_ms + tonumber(ARGV[2]), ARGV[1])
index_follows_run()
return {1, clamped, rooms}
