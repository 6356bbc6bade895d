--[[ owner.lua: the tenant a context the provider keeps (an answer, a conversation) belongs to.

KEYS[1]   lbp:ctxowner:<id>
ARGV[1]   the tenant whose call made or continued it
ARGV[2]   how long it is kept, in seconds (the provider's own retention); 0: for good
The first tenant to use an id keeps it; a later call of its own that marks it again (a call in a
conversation marks the conversation) extends its life. A mark kept for
good (a conversation, what was answered within one: the provider keeps them with no expiry)
stays so, whatever a later call keeps it for (an item of it named by a call outside it).
Returns 1 when the id is the tenant's, 0 when another tenant's.
]]
local owner = redis.call('GET', KEYS[1])
if owner and owner ~= ARGV[1] then
  return 0
end
if ARGV[2] == '0' then
  redis.call('SET', KEYS[1], ARGV[1])
elseif not owner or redis.call('TTL', KEYS[1]) ~= -1 then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
end
return 1
