--[[ settle.lua: replace a reservation by the actual figures and append the ledger entry, once.

KEYS[1]      reservation record (hash)          lbp:{tenant}:resv:<reservation id>
KEYS[2]      lease index (zset)                 lbp:{tenant}:leases
KEYS[3]      tenant ledger (stream)             lbp:{tenant}:ledger
KEYS[4]      run ledger index (list of ids)     lbp:{tenant}:runlog:<run>
KEYS[5..]    the scope hashes named in the reservation, in the same order
ARGV[1]      reservation id
ARGV[2..9]   actual figures: requests, input_tokens, output_tokens, total_tokens, cost_micros,
             cached_input_tokens, reasoning_tokens, cache_creation_input_tokens
ARGV[10]     ledger entry: a JSON object of strings, stored as the stream entry's fields
ARGV[11]     1: a call that went out, settled within its window (billing.bill_if_lost_until_ms),
             billed even without a reservation; 0: anything else (late journal replays, the
             reaper, releases of unforwarded reserves), which does nothing without one
ARGV[12]     seconds the settled marker is kept
ARGV[13]     seconds the run ledger index (KEYS[4]) is kept after this settle (0 = for ever), when
             ARGV[14] names no run scope
ARGV[14]     which of KEYS[5..] is the run's scope key (1-based; 0 = none): the ledger index then
             lives exactly as long as the run's meters
ARGV[15]     1: the call's own settle, from the process that served it, live or replayed from its
             journal (sent again after a reply that came late or was lost: see below); 0: the
             reaper's; any other value: the reaper's, that try's token (r and hex digits), which
             the same try sent again (its reply came late or was lost) finds in the marker
ARGV[16]     seconds the tenant ledger (KEYS[3]) is kept after this settle, at least (0 = for
             ever; -1 = left as it is: a configured tenant's, kept for ever): a pass-through
             caller's tenant's, as long as its runs
ARGV[17]     which of KEYS[5..] is kept as the ledger is (1-based; 0 = none), its TTL below
             unused: a pass-through caller's key's lifetime meters
ARGV[18]     seconds of entries the tenant ledger (KEYS[3]) keeps (0 = every entry, for ever): this
             settle's XADD trims those older than that by the store's clock (MINID ~: whole stream
             nodes, so a few older ones stay; Redis 6.2 or later, an older one trims nothing)
ARGV[19..]   per scope (KEYS[5..], same order): its key's TTL in seconds (0 = none), as reserve.lua
             sets it, set again here: a key this settle writes anew (the reservation was lost, or
             the key expired mid-call) still expires (absent: left as it is)

Idempotent by reservation id: settling replaces the record by a marker {settled = 1} (and
own = the entry's id, for the call's own settle), kept ARGV[12] seconds; a settle that finds the
marker changes nothing (returns {0}), save that the call's own settle (ARGV[15] = 1) finding the
marker its own earlier try left (the reply to that try came late, and a client library sent it
again, or was lost, and its journal replays it) gets that try's answer, {1, its entry id}: taken
for a reaper's, the call would be told it was billed at its reserve, and its spend would never be
counted. There is one own settle per call. A reaper's settle sent with a token gets its entry
again the same way, and only that try (another reaper's, or a later one, gets {0}). The live settle
of a call (ARGV[11] = 1) that finds neither record nor marker bills it all the same: its
reservation was lost (e.g. with writes a failed-over Redis master had not replicated), so the
used meters and the ledger entry go in, with the field reservation = lost, and nothing is
released. Any other settle without a record does nothing: past its window a reaper may have
settled the call and its marker may have expired. Otherwise returns {1, ledger entry id}, and
a third element, the error, when the store refused the trim ARGV[18] asked for (the entry is in).
'concurrent' is released here. A release is made only from the life of a scope key the reserve
landed in (its 'born' stamp, in the record), and never below zero; a scope whose stamp is '-'
held nothing of this call (reserve.lua) and is only counted.
]]
-- One read of the record: whether it is the settled marker, and what it reserved where.
local rec = redis.call('HMGET', KEYS[1], 'settled', 'amounts', 'born', 'own', 'try', 'reaped')
if rec[1] then
  if ARGV[15] == '1' and rec[4] then
    return {1, rec[4]}  -- this call's own settle again: its entry
  end
  if rec[5] and rec[5] == ARGV[15] then
    return {1, rec[6]}  -- a reaper's try again (its reply was lost): the entry it wrote
  end
  return {0}
end
local RESERVED = {'requests', 'input_tokens', 'output_tokens', 'total_tokens', 'cost_micros', 'concurrent'}
local ACTUAL = {'requests', 'input_tokens', 'output_tokens', 'total_tokens', 'cost_micros',
  'cached_input_tokens', 'reasoning_tokens', 'cache_creation_input_tokens'}
local amounts, born = {}, {}
local raw = rec[2]
local lost = not raw  -- nothing reserved to release
if rec[3] then
  for v in string.gmatch(rec[3], '%S+') do born[#born + 1] = v end
end
if lost then
  if ARGV[11] ~= '1' then return {0} end
else
  for v in string.gmatch(raw, '%S+') do amounts[#amounts + 1] = v end
end
-- Check every figure before the first write: a script error after a write is not rolled back.
local marker_ttl = tonumber(ARGV[12])
local runlog_arg = ARGV[13] or '0'
if not string.match(runlog_arg, '^%d+$') or #runlog_arg > 10 then
  return redis.error_reply('settle: the run index TTL is not a whole number of seconds: ' .. runlog_arg)
end
local runlog_ttl = tonumber(runlog_arg)
local ledger_arg = ARGV[16] or '-1'
if ledger_arg ~= '-1' and (not string.match(ledger_arg, '^%d+$') or #ledger_arg > 10) then
  return redis.error_reply('settle: the ledger TTL is not a whole number of seconds: ' .. ledger_arg)
end
local ledger_ttl = tonumber(ledger_arg)
local kept_scope = tonumber(ARGV[17]) or 0
local retention_arg = ARGV[18] or '0'
if not string.match(retention_arg, '^%d+$') or #retention_arg > 10 then
  return redis.error_reply('settle: the ledger retention is not a whole number of seconds: ' .. retention_arg)
end
local retention = tonumber(retention_arg)
if not marker_ttl or marker_ttl < 1 then
  return redis.error_reply('settle: the settled marker needs a time to live in seconds: ' .. tostring(ARGV[12]))
end
for m = 1, #ACTUAL do
  local v = ARGV[1 + m]
  if not string.match(v, '^%d+$') or #v > 15 then
    return redis.error_reply('settle: actual ' .. ACTUAL[m] .. ' is not a whole number of tokens: ' .. v)
  end
end
local entry = cjson.decode(ARGV[2 + #ACTUAL])

-- born, then resv:<meter> in RESERVED order.
local RESV = {'born', 'resv:requests', 'resv:input_tokens', 'resv:output_tokens', 'resv:total_tokens',
  'resv:cost_micros', 'resv:concurrent'}
-- The TTLs here are those of the call's reserve, whose setting a reload may have changed since:
-- a settle never shortens a key's life nor ends a key kept for ever (a later reserve, under
-- the newer setting, decides those), save for a key it writes first. 0 is none.
local function extend(key, ttl, new, left)
  if ttl == 0 then
    redis.call('PERSIST', key)
  elseif new then
    redis.call('EXPIRE', key, ttl)
  else
    left = left or redis.call('PTTL', key)
    if left >= 0 and left < ttl * 1000 then redis.call('EXPIRE', key, ttl) end
  end
end

-- The used meters this settle adds to: the figures above zero, the same in every scope. Each
-- figure and each amount reserved is read as a number once, not once a scope: the Lua side of
-- a script (tonumber, string.format, tables, closures) costs Redis about as much as the
-- commands it sends.
local NR = #RESERVED
local HELD = {}  -- what a scope holding the reserve reads: RESV, then ADD
for i = 1, #RESV do HELD[i] = RESV[i] end
local ADD, ADD_BY, ADD_N, nadd = {}, {}, {}, 0
for m = 1, #ACTUAL do
  local v = ARGV[1 + m]
  if v ~= '0' then
    nadd = nadd + 1
    ADD[nadd], ADD_BY[nadd], ADD_N[nadd] = 'used:' .. ACTUAL[m], v, tonumber(v)
    HELD[NR + 1 + nadd] = ADD[nadd]
  end
end
local RELEASE = {}
for m = 1, NR do RELEASE[m] = tonumber(amounts[m]) or 0 end
-- Below this a sum in Lua's numbers (doubles) is exact; past it (never in practice) HINCRBY adds.
local EXACT = 9007199254740992

-- Per scope, one read of every field this settle changes and one write of them all: one HINCRBY
-- per meter made most of a settle's commands, and a command from a script costs Redis a
-- microsecond or more, more with every field it names (each goes from Lua to Redis and back).
for s = 5, #KEYS do
  local key = KEYS[s]
  local life = born[s - 4]
  local holds = life ~= '-'
  local got, adds_at, writes, n = {}, 0, {}, 0
  if holds then
    got, adds_at = redis.call('HMGET', key, unpack(HELD)), NR + 1
  elseif nadd > 0 then
    got = redis.call('HMGET', key, unpack(ADD))
  end
  local new, left
  if holds then
    new = not got[1]
    -- A key that expired mid-call and was written anew (by a later reserve, or by nothing yet)
    -- does not hold this reserve: releasing it would take other calls' reserves, or go below
    -- zero, and either is room past the ceiling. Records older than 'born': never below zero.
    if not lost and (not life or got[1] == life) then
      for m = 1, NR do
        local have = tonumber(got[m + 1]) or 0
        local release = RELEASE[m]
        if have < release then release = have end
        if release > 0 then
          if have < EXACT then
            local left_s = (have == release) and '0' or string.format('%d', have - release)
            writes[n + 1], writes[n + 2], n = RESV[m + 1], left_s, n + 2
          else
            redis.call('HINCRBY', key, RESV[m + 1], string.format('%d', -release))
          end
        end
      end
    end
  else
    -- The scope held none of this reserve (no ceiling named it): nothing to release there, and
    -- what other calls hold there is theirs.
    left = redis.call('PTTL', key)
    new = left == -2
  end
  for i = 1, nadd do
    local have = tonumber(got[adds_at + i]) or 0
    local sum = have + ADD_N[i]
    if have < EXACT and sum < EXACT then
      writes[n + 1], writes[n + 2], n = ADD[i], string.format('%d', sum), n + 2
    else
      redis.call('HINCRBY', key, ADD[i], ADD_BY[i])
    end
  end
  if n > 0 then redis.call('HSET', key, unpack(writes)) end
  local ttl = tonumber(ARGV[14 + s])
  -- Every settle, not only a lost reservation's: a key that expired mid-call (a run idle longer
  -- than its TTL, a journal replayed after a long outage) is written anew here and must expire.
  if ttl and s - 4 ~= kept_scope then extend(key, ttl, new, left) end
end

local fields, nf = {}, 0
for name, value in pairs(entry) do
  fields[nf + 1], fields[nf + 2], nf = name, tostring(value), nf + 2
end
if lost then
  fields[nf + 1], fields[nf + 2] = 'reservation', 'lost'
end
local id, untrimmed
if retention > 0 then
  local t = redis.call('TIME')
  local min_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) - retention * 1000
  if min_ms > 0 then
    -- pcall: the meters are written, and an error now would leave the call billed without its
    -- entry or marker (every retry billing it again); a Redis before 6.2 knows no MINID.
    local added = redis.pcall('XADD', KEYS[3], 'MINID', '~', string.format('%d', min_ms), '*', unpack(fields))
    if type(added) == 'table' and added.err then untrimmed = added.err else id = added end
  end
end
if not id then id = redis.call('XADD', KEYS[3], '*', unpack(fields)) end
-- Only a settle writes the ledger: no later reserve would set its TTL, so a ledger kept for ever
-- gets it here (so does the scope kept alike: a version before made it persistent), and one a
-- longer setting gave keeps it (calls reserved before a reload).
local function keep(key)
  if ledger_ttl == 0 then
    redis.call('PERSIST', key)
  elseif redis.call('PTTL', key) < ledger_ttl * 1000 then
    redis.call('EXPIRE', key, ledger_ttl)
  end
end
if ledger_ttl >= 0 then
  keep(KEYS[3])
  if kept_scope > 0 and KEYS[4 + kept_scope] then keep(KEYS[4 + kept_scope]) end
end
local first = redis.call('RPUSH', KEYS[4], id) == 1
local run_scope = tonumber(ARGV[14]) or 0
-- PTTL -2: no run key (a settle that wrote no meter, the key gone): the index's own TTL then.
local left = (run_scope > 0 and KEYS[4 + run_scope]) and redis.call('PTTL', KEYS[4 + run_scope]) or -2
if left == -1 then
  redis.call('PERSIST', KEYS[4])
elseif left > 0 then
  redis.call('PEXPIRE', KEYS[4], left)
else
  extend(KEYS[4], runlog_ttl, first)
end
-- The marker takes the record's place in the same key: written over it first, then the record's
-- fields removed (reserve.lua's, shrink.lua's). Never DEL then HSET: between them the key is
-- absent, and while the tenant's slot migrates (a Cluster resharding) its node refuses a
-- script's command on a key it does not hold; the HSET failed after the ledger entry and the
-- meters were written, leaving neither record nor marker, and the retry billed the call again.
if ARGV[15] == '1' then
  redis.call('HSET', KEYS[1], 'settled', '1', 'own', id)  -- the entry the call's own settle wrote
elseif ARGV[15] ~= '0' then
  redis.call('HSET', KEYS[1], 'settled', '1', 'try', ARGV[15], 'reaped', id)  -- a reaper's try
else
  redis.call('HSET', KEYS[1], 'settled', '1')
end
redis.call('HDEL', KEYS[1], 'scopes', 'amounts', 'record', 'reserved_at_ms', 'clamped', 'ttls', 'born')
redis.call('EXPIRE', KEYS[1], marker_ttl)
redis.call('ZREM', KEYS[2], ARGV[1])
if untrimmed then return {1, id, untrimmed} end
return {1, id}
