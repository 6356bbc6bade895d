--[[ owner.lua: the tenant a context the provider keeps (an answer, a conversation) belongs to.

KEYS[1]   lbp:ctxowner:<id>
ARGV[1]   the tenant whose call made or continued it
ARGV[2]   how long it is kept, in seconds (the provider's own retention)
The first tenant to use an id keeps it; its own later calls extend its life. Returns 1 when the
id is the tenant's, 0 when another tenant's.
]]
local owner = redis.call('GET', KEYS[1])
if owner and owner ~= ARGV[1] then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return 1
