#!lua name=capsvc
--[[
capsvc's atomic steps, as one Redis Functions library (FUNCTION LOAD REPLACE at start,
FCALL on the hot path). Functions rather than EVALSHA: the library is persisted in the
AOF/RDB and replicated, so a restarted or promoted Redis has it without a reload, and
redis-py's cluster pipeline accepts FCALL (it refuses evalsha).

Every function touches keys of one hash slot only (they share a {hash tag}):
  ticket record   t:{t:NN}:<channel>/<ticket id>   hash   st, fp, at, sale, body, released
  pending index   p:{t:NN}                          zset   ticket key -> claim time (ms)
  stop-sale       s:{t:NN}:<game>:<draw>            string when an admin stopped the draw
                  (written into every ticket slot, so the claim checks it atomically)
  holds           h:{<game>:<combination>}          hash   <channel>/<ticket>/<grid> -> record
  counters        c:{<game>:<combination>}:<draw>   string cumulative stake (minor units)

Ticket states (field st): p = pending (claimed, decision not written), x = expired (the
janitor is releasing it), f = final (body holds the decision), c = cancelled.

A hold record is the stake a grid took on every draw of the ticket ("500"), or its
rejection ("R<draw offset>:<remaining>"): a re-run returns the recorded outcome and never
counts twice; a release gives back exactly the recorded stake, once.

Instants are milliseconds since the Unix epoch; "now" is always Redis TIME, so the close
of a draw is judged by one clock for every process.
]]

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Push a key's expiry to `at` unless it already lives longer.
local function extend(key, at)
  local cur = redis.call('PEXPIRETIME', key)
  if cur == -1 or cur < at then
    redis.call('PEXPIREAT', key, at)
  end
end

--[[ claim: KEYS ticket, pending, stop(draw 1), …, stop(draw n);
ARGV fingerprint, sale, close_ms, expire_at, stale_after_ms
The stop keys are the admin stop-sales of the ticket's draws, copied into this slot.
Returns {'new', at} | {'final', body} | {'pending', at, sale, stopped} | {'conflict'}
| {'stale'} | {'closed', offset} (a draw is closed: nothing claimed; offset -1 when the
first draw's close instant has passed, else the offset of the stopped draw). ]]
local function first_stopped(keys)
  for i = 3, #keys do
    if redis.call('EXISTS', keys[i]) == 1 then
      return i - 3
    end
  end
  return nil
end

local function claim(keys, args)
  local ticket, pending = keys[1], keys[2]
  local now = now_ms()
  local rec = redis.call('HMGET', ticket, 'st', 'fp', 'at', 'sale', 'body')
  local st = rec[1]
  if not st then
    if now >= tonumber(args[3]) then
      return {'closed', -1}
    end
    local stopped = first_stopped(keys)
    if stopped then
      return {'closed', stopped}
    end
    local expire_at = tonumber(args[4])
    redis.call('HSET', ticket, 'st', 'p', 'fp', args[1], 'at', now, 'sale', args[2])
    redis.call('PEXPIREAT', ticket, expire_at)
    redis.call('ZADD', pending, now, ticket)
    extend(pending, expire_at)
    return {'new', now}
  end
  if rec[2] ~= args[1] then
    return {'conflict'}
  end
  if st == 'f' or st == 'c' then
    return {'final', rec[5]}
  end
  if st == 'p' and now - tonumber(rec[3]) < tonumber(args[5]) then
    return {'pending', tonumber(rec[3]), rec[4], first_stopped(keys) and 1 or 0}
  end
  return {'stale'}
end

--[[ finalize: KEYS ticket, pending; ARGV at, body
Writes the decision of a pending (or expired) ticket claimed at `at`. Returns 1 if written. ]]
local function finalize(keys, args)
  local rec = redis.call('HMGET', keys[1], 'st', 'at')
  if (rec[1] == 'p' or rec[1] == 'x') and rec[2] == args[1] then
    redis.call('HSET', keys[1], 'st', 'f', 'body', args[2])
    redis.call('ZREM', keys[2], keys[1])
    return 1
  end
  return 0
end

--[[ unclaim: KEYS ticket, pending; ARGV at
Forgets a pending or expired ticket claimed at `at` (its holds must be released first). ]]
local function unclaim(keys, args)
  local rec = redis.call('HMGET', keys[1], 'st', 'at')
  if (rec[1] == 'p' or rec[1] == 'x') and rec[2] == args[1] then
    redis.call('DEL', keys[1])
  end
  redis.call('ZREM', keys[2], keys[1])
  return 1
end

--[[ expire: KEYS ticket, pending; ARGV claimed_before_ms
For the janitor: a ticket pending since before the cutoff becomes expired (no request may
resume it any more). Returns {'x', at, sale} for the janitor to settle, or {} if there is
nothing to do (the index entry is then dropped). ]]
local function expire(keys, args)
  local rec = redis.call('HMGET', keys[1], 'st', 'at', 'sale')
  if rec[1] == 'p' and tonumber(rec[2]) < tonumber(args[1]) then
    redis.call('HSET', keys[1], 'st', 'x')
    rec[1] = 'x'
  end
  if rec[1] == 'x' then
    return {'x', rec[2], rec[3]}
  end
  if rec[1] ~= 'p' then
    redis.call('ZREM', keys[2], keys[1])
  end
  return {}
end

--[[ cancel: KEYS ticket; ARGV close_ms, released
Marks a final ticket cancelled if the first draw is still open.
Returns {'ok', released} (also on a replay) | {'closed'} | {'missing'} | {'undecided'}. ]]
local function cancel(keys, args)
  local rec = redis.call('HMGET', keys[1], 'st', 'released')
  if not rec[1] then
    return {'missing'}
  end
  if rec[1] == 'c' then
    return {'ok', tonumber(rec[2])}
  end
  if rec[1] ~= 'f' then
    return {'undecided'}
  end
  if now_ms() >= tonumber(args[1]) then
    return {'closed'}
  end
  redis.call('HSET', keys[1], 'st', 'c', 'released', args[2])
  return {'ok', tonumber(args[2])}
end

-- Offsets of the counters whose room is now below the smallest stake (sold out).
local function sold_out(counters, cap, min_stake)
  local out = {}
  local values = redis.call('MGET', unpack(counters))
  for i = 1, #counters do
    if cap - (tonumber(values[i]) or 0) < min_stake then
      out[#out + 1] = i - 1
    end
  end
  return out
end

--[[ reserve: KEYS hold, counter(draw 1), …, counter(draw n);
ARGV holder, stake, cap, close_ms, min_stake, expire_at(draw 1), …, expire_at(draw n)
All or nothing over the n draws of one grid. Returns
  {1, near, sold-out offsets…}
                             accepted (now or by an earlier run): every counter grew by stake;
                             `near` counts the counters this call brought to 80 % of the cap
  {0, offset, remaining}     rejected: the draw at `offset` would overflow, with its room
  {-1}                       no record and sales are closed: nothing counted
With close_ms = 0 it only reads the recorded outcome (the janitor's question). ]]
local function reserve(keys, args)
  local hold, holder = keys[1], args[1]
  local stake, cap, min_stake = tonumber(args[2]), tonumber(args[3]), tonumber(args[5])
  local counters = {unpack(keys, 2)}
  local prev = redis.call('HGET', hold, holder)
  if prev then
    if string.sub(prev, 1, 1) == 'R' then
      local off, rem = string.match(prev, '^R(%d+):(%-?%d+)$')
      return {0, tonumber(off), tonumber(rem)}
    end
    local out = sold_out(counters, cap, min_stake)
    table.insert(out, 1, 0)
    table.insert(out, 1, 1)
    return out
  end
  if now_ms() >= tonumber(args[4]) then
    return {-1}
  end
  local values = redis.call('MGET', unpack(counters))
  local last_expiry = 0
  for i = 1, #counters do
    local room = cap - (tonumber(values[i]) or 0)
    if stake > room then
      redis.call('HSET', hold, holder, 'R' .. (i - 1) .. ':' .. room)
      extend(hold, tonumber(args[5 + #counters]))
      return {0, i - 1, room}
    end
  end
  local out = {1, 0}
  local near = cap * 0.8
  for i = 1, #counters do
    local expire_at = tonumber(args[5 + i])
    local total = redis.call('INCRBY', counters[i], stake)
    if total == stake then
      redis.call('PEXPIREAT', counters[i], expire_at)
    end
    if total >= near and total - stake < near then
      out[2] = out[2] + 1
    end
    if cap - total < min_stake then
      out[#out + 1] = i - 1
    end
    if expire_at > last_expiry then
      last_expiry = expire_at
    end
  end
  redis.call('HSET', hold, holder, stake)
  extend(hold, last_expiry)
  return out
end

--[[ release: KEYS hold, counter(draw 1), …, counter(draw n); ARGV holder, cap, min_stake
Gives back what the holder's record took, once. Returns {released stake, offsets that left
the sold-out state…}; {0} when there is nothing (left) to give back. ]]
local function release(keys, args)
  local hold, holder = keys[1], args[1]
  local cap, min_stake = tonumber(args[2]), tonumber(args[3])
  local prev = redis.call('HGET', hold, holder)
  if not prev then
    return {0}
  end
  redis.call('HDEL', hold, holder)
  if string.sub(prev, 1, 1) == 'R' then
    return {0}
  end
  local stake = tonumber(prev)
  local out = {stake}
  for i = 2, #keys do
    if redis.call('EXISTS', keys[i]) == 1 then
      local total = redis.call('DECRBY', keys[i], stake)
      if cap - total >= min_stake and cap - (total + stake) < min_stake then
        out[#out + 1] = i - 2
      end
    end
  end
  return out
end

--[[ Player budgets (games with a daily limit).
  budget          b:{pl:<player>}:<YYYY-MM-DD>       hash   spent, <ref> -> amount | R<room>
  self-limit      l:{pl:<player>}                     hash   limit, next, from
A player's keys share one slot, so a subscription spread over several days is reserved on
all of them atomically. `ref` identifies what took the budget (a ticket, another game's
stake); its amount is recorded, so a re-run never charges twice and a settle adjusts to
exactly what was accepted. The self-limit in force on day D is `next` if `from` <= D (a
raise, or a removal when next is "none", takes effect the next day), else `limit`. ]]

local function self_limit(rec, day)
  local value = rec[1]
  if rec[3] and day >= rec[3] then
    value = rec[2]
  end
  if value == nil or value == false or value == 'none' then
    return nil
  end
  return tonumber(value)
end

local function day_limit(rec, day, regulatory)
  local own = self_limit(rec, day)
  if own and own < regulatory then
    return own
  end
  return regulatory
end

--[[ budget: KEYS limit, day(1), …, day(m);
ARGV ref, regulatory, expire_at, day(1)…day(m), amount(1)…amount(m)
All or nothing over the m days. Returns {1, room left on day 1} | {0, room on the day that
refused}; a re-run returns the recorded outcome. With expire_at = 0 it only reads: {-1}
when `ref` took nothing yet. ]]
local function budget(keys, args)
  local ref, regulatory, expire_at = args[1], tonumber(args[2]), tonumber(args[3])
  local m = #keys - 1
  local rec = redis.call('HMGET', keys[1], 'limit', 'next', 'from')
  local prev = redis.call('HGET', keys[2], ref)
  if prev then
    if string.sub(prev, 1, 1) == 'R' then
      return {0, tonumber(string.sub(prev, 2))}
    end
    local spent = tonumber(redis.call('HGET', keys[2], 'spent') or '0')
    return {1, day_limit(rec, args[4], regulatory) - spent}
  end
  if expire_at == 0 then
    return {-1}
  end
  local rooms = {}
  for i = 1, m do
    local spent = tonumber(redis.call('HGET', keys[1 + i], 'spent') or '0')
    local room = day_limit(rec, args[3 + i], regulatory) - spent
    if tonumber(args[3 + m + i]) > room then
      redis.call('HSET', keys[2], ref, 'R' .. room)
      extend(keys[2], expire_at)
      return {0, room}
    end
    rooms[i] = room
  end
  for i = 1, m do
    local amount = tonumber(args[3 + m + i])
    redis.call('HINCRBY', keys[1 + i], 'spent', amount)
    redis.call('HSET', keys[1 + i], ref, amount)
    extend(keys[1 + i], expire_at)
  end
  return {1, rooms[1] - tonumber(args[4 + m])}
end

--[[ settle: KEYS day(1), …, day(m); ARGV ref, amount(1), …, amount(m)
Sets what `ref` holds on each day to the given amounts (0: give everything back), adjusting
`spent` by the difference. Idempotent. Returns the total given back. ]]
local function settle(keys, args)
  local ref = args[1]
  local given = 0
  for i = 1, #keys do
    local prev = redis.call('HGET', keys[i], ref)
    if prev and string.sub(prev, 1, 1) ~= 'R' then
      local diff = tonumber(args[1 + i]) - tonumber(prev)
      if diff ~= 0 then
        redis.call('HINCRBY', keys[i], 'spent', diff)
        redis.call('HSET', keys[i], ref, args[1 + i])
        given = given - diff
      end
    end
  end
  return given
end

--[[ set_limit: KEYS limit, today's budget; ARGV value ("none": remove), today, tomorrow,
expire_at
Lowering takes effect at once; raising or removing from tomorrow. Returns {limit in force
today or "none", pending value or "", pending from or "", spent today}. ]]
local function set_limit(keys, args)
  local rec = redis.call('HMGET', keys[1], 'limit', 'next', 'from')
  local today, tomorrow = args[2], args[3]
  local current = self_limit(rec, today)
  local wanted = args[1]
  if wanted ~= 'none' and (current == nil or tonumber(wanted) <= current) then
    redis.call('DEL', keys[1])
    redis.call('HSET', keys[1], 'limit', wanted)
  else
    redis.call('DEL', keys[1])
    if current then
      redis.call('HSET', keys[1], 'limit', current)
    end
    if wanted ~= 'none' or current then
      redis.call('HSET', keys[1], 'next', wanted, 'from', tomorrow)
    end
  end
  if redis.call('EXISTS', keys[1]) == 1 then
    redis.call('PEXPIREAT', keys[1], tonumber(args[4]))
  end
  local after = redis.call('HMGET', keys[1], 'limit', 'next', 'from')
  local in_force = self_limit(after, today)
  return {in_force and tostring(in_force) or 'none', after[2] or '', after[3] or '',
          tonumber(redis.call('HGET', keys[2], 'spent') or '0')}
end

--[[ player: KEYS limit, today's budget; ARGV today
Returns {self-limit in force today or "none", pending value or "", from or "", spent}. ]]
local function player(keys, args)
  local rec = redis.call('HMGET', keys[1], 'limit', 'next', 'from')
  local in_force = self_limit(rec, args[1])
  local pending, from = '', ''
  if rec[3] and args[1] < rec[3] then
    pending, from = rec[2], rec[3]
  end
  return {in_force and tostring(in_force) or 'none', pending, from,
          tonumber(redis.call('HGET', keys[2], 'spent') or '0')}
end

redis.register_function('capsvc_budget', budget)
redis.register_function('capsvc_settle', settle)
redis.register_function('capsvc_set_limit', set_limit)
redis.register_function('capsvc_player', player)
redis.register_function('capsvc_claim', claim)
redis.register_function('capsvc_finalize', finalize)
redis.register_function('capsvc_unclaim', unclaim)
redis.register_function('capsvc_expire', expire)
redis.register_function('capsvc_cancel', cancel)
redis.register_function('capsvc_reserve', reserve)
redis.register_function('capsvc_release', release)
