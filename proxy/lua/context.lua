--[[ context.lua: keep the size of a context the provider keeps (an answer, a conversation).

KEYS[1..] lbp:{tenant}:ctx:<id>, one per id the context is kept under
ARGV[1]   its size in tokens (what the proxy billed the call that made it, input and output)
ARGV[2]   how long it is kept, in seconds
A size kept is never lowered, only its life extended: a conversation grows, and a call on it that
ends late (a stream whose upstream is slow to close, continued at its response.completed; calls
on one conversation at once) must not write its older, smaller figure over a later call's. A
stream's size written before its last event goes out is raised by its settle, never lowered.
]]
local size = tonumber(ARGV[1])
for _, key in ipairs(KEYS) do
  local kept = tonumber(redis.call('GET', key))
  if kept and kept >= size then
    redis.call('EXPIRE', key, ARGV[2])
  else
    redis.call('SET', key, ARGV[1], 'EX', ARGV[2])
  end
end
return 1
