#!lua name=capsvc
--[[
capsvc's atomic steps, as one Redis Functions library (FUNCTION LOAD REPLACE at start,
FCALL on the hot path). Functions rather than EVALSHA: the library is persisted in the
AOF/RDB and replicated, so a restarted or promoted Redis has it without a reload, and a
cluster pipeline accepts FCALL.

THE KEYS. Every function touches keys of one hash slot only (they share a {hash tag}),
but for the node's count a marked function also writes on a cluster, and `calls` carries
the marked calls of many slots of one node (see MARKS).

  ticket record  a field of a bucket r:{t:NN}:<m> (see TICKET RECORDS); the ticket's name,
                 what the pending index and the callers know it by, is
                 t:{t:NN}:<channel>/<ticket id>
                 fields st, at, sid, sale, body | res, ca, rel
                 kept until: close of the ticket's last draw + retention.
  unjournaled    q:{sales}                        hash   (standalone: sales in one call)
                 <call> -> msgpack {instant, {{bucket, field, sid (8 bytes)}, ...}}: the
                 sales of a call of `sell` that made any (its caller's list of them all,
                 made or not: a sale not made has no record of its sale id), until their
                 process has journaled them (it deletes the field), else the janitor
                 journals those made and deletes it
  halted groups  h:{sales}                        hash   (standalone: sales in one call)
                 <group> -> 1: a request whose sales a call of `sell` stopped judging (one
                 moved on to another draw or day), for the calls after it that carry more
                 of that request's sales; TTL 10 s from the last one
  pending index  p:{t:NN}                         zset   ticket key -> claim instant (hint)
                 every ticket that may need the janitor: claimed, being cancelled, or
                 decided (sold, cancelled, voided) and not known to be journaled yet; the
                 process that journals the decision removes the entry (`journaled_many`:
                 only if the ticket is still in that state), else the janitor journals it
  aggregates     a:{t:NN}:<game>:<draw>            hash   sale id -> accepted stakes
                 (see AGGREGATES)
  counters       c:{<game>:<bucket>}:<draw>        hash   one bucket of one draw:
                   <combination>             -> cumulative stake (minor units)
                   "\0" <sale id> <grid>     -> that grid's record (see RECORDS)
                 TTL: close of <draw> + retention.
  stops          s:{<game>}                        hash   <draw> -> "<instant>:<expiry>"
  stop copies    s:{t:NN}                          hash   <game>:<draw> -> "<instant>:<expiry>"
  draw cap       k:{<game>}:<draw>                 string the cap in force for the draw, fixed
                 by its first sale (SET NX, by the caller); TTL: close + retention
                 (read by cancel only: the claim never depends on a key that may not exist)
  sold-out list  x:{<game>}:<draw>                 set    advisory, filtered on read
  feed           f:{<game>}                        stream the game's events (see FEED)
  feed closes    e:{<game>}                        hash   <draw> -> expiry: closes announced
  budgets        b:{pl:<player>}:<YYYY-MM-DD>      hash   spent, <ref> -> amount | R<room> | X
  self-limit     l:{pl:<player>}                   hash   limit, next, from
  WAIT fence     w:{fence}                         string "1", TTL 10 s; on a cluster one per
                 primary, w:{fence:<n>} in a slot it owns. Written by the transport right
                 before each WAIT of `replicas:N`, never by a function (capsvc/redis/transport.py)

A combination is its sorted numbers, one byte each (1..99: never a zero byte), so a record
field (which starts with a zero byte) can never be taken for a counter.

WHY BUCKETS. Redis spends ~118 bytes on any key (dict entry, key, object, expiry entry),
so a key per counter cannot get below that. A combination is hashed (crc32 of its bytes)
to one of K = 4096 buckets per game and draw; a bucket is a small hash that Redis keeps as
a listpack while it has at most hash-max-listpack-entries fields (two per combination
played: its total and one record per grid sold). Measured on Redis 7.0 (bench/memory.py,
100,000 counters on one draw, ~24 a bucket): ~40 bytes per counter with its record with
Redis's default limit of 128 fields; with 1024 buckets the same volume passes 128 fields a
bucket, turns into real hash tables and costs 136 bytes, so K follows the volume:
4096 buckets stay in listpack up to ~250,000 combinations per draw with the default limit
and ~1,000,000 with deploy/redis.conf's 512, while a listpack scan stays a few hundred
bytes (CPU). Past that a bucket becomes a hash table: memory per counter rises toward the
per-key figure, still bounded by the draws retained. The hash tag {<game>:<bucket>} holds
no draw, so every draw of one combination sits in one slot and a subscription grid is one
atomic call; the draw is in the key name, so what a draw stored expires with it. K is part
of the layout: changing it while a draw is on sale would split that draw's counters in
two, so it is a constant, not a setting.

SALES. The claim mints a sale id (`sid`, 8 bytes of the SHA-1 of the ticket key, the claim
instant and a random nonce from the caller; a sale in one call takes the caller's nonce).
Callers and replies name it in hex, the ticket record keeps its 8 bytes (see TICKET
RECORDS). Every grid record is keyed by sale id and grid index, so a ticket id used again
after its retention is a new sale with new records, and every step that acts for a sale
(reserve, release, finalize, unclaim, settle, cancel) names it and does nothing to another
sale.

Ticket states (field st): p = pending (claimed, decision not written), x = expired (the
janitor is settling it), f = final (body holds the decision; or `res` the grids' results, from
which the body is derived: see sell), k = cancelling (decided at
`ca`, giving back `rel`; a retry or the janitor finishes it), c = cancelled.

RECORDS (one per grid of a sale, in the bucket of the ticket's LAST draw, so a record lives
exactly as long as its ticket record, whatever the subscription's length):
  "<stake>"            accepted: every draw's counter grew by stake
  "R<offset>:<room>"   rejected by the cap on draw first+offset, with its room then
  "X"                  released, or sealed by the janitor before the grid was decided:
                       a late reserve of that sale can no longer count it.
A reserve re-run by the same sale returns the recorded outcome and never counts twice;
a release gives back exactly the recorded stake, once.

Instants are milliseconds since the Unix epoch; "now" is always Redis TIME, so closes,
admin stops, pending deadlines and cancel deadlines are judged by one clock.
]]

-- The library's globals, bound to locals at the first call (a library's code sees none of
-- them while it loads): a local is an upvalue read, a global two table lookups.
local call, sub, byte, char, format, find, match, gmatch, mpack, munpack, munpack_one
local munpack_limit, sunpack, spack, concat, insert, remove, floor, max, min, tonum
local function bind()
  call, sub, byte, char = redis.call, string.sub, string.byte, string.char
  format = string.format
  find, match, gmatch = string.find, string.match, string.gmatch
  mpack, munpack, munpack_one = cmsgpack.pack, cmsgpack.unpack, cmsgpack.unpack_one
  munpack_limit, sunpack, spack = cmsgpack.unpack_limit, struct.unpack, struct.pack
  concat, insert, remove = table.concat, table.insert, table.remove
  floor, max, min, tonum = math.floor, math.max, math.min, tonumber
end

-- Decimal text known to be a number, as one: `+ 0` converts it once, where tonumber checks
-- it, then converts it (two strtod: what the calls' per-call numbers cost most).
local function num(text)
  return text + 0
end

-- list[from + 1 .. from + n] (n: to the end) as a new table: unpack for the usual few, a
-- loop past what Lua's stack takes (a sale of many grids and draws names thousands of keys).
local function slice(list, from, n)
  n = n or #list - from
  if n <= 4000 then
    return {unpack(list, from + 1, from + n)}
  end
  local out = {}
  for i = 1, n do
    out[i] = list[from + i]
  end
  return out
end

local function now_ms()
  local t = call('TIME')
  return num(t[1]) * 1000 + floor(num(t[2]) / 1000)
end

-- Push a key's expiry to `at` (and `slack` ms beyond) unless it already lives to `at`;
-- returns the instant it is known to live to. `seen` (optional): key -> the instant its
-- TTL is known to reach in this call, so that a call naming a key many times (a batch of
-- sales, a restore) reads its expiry once.
local function extend(key, at, slack, seen)
  if seen then
    local known = seen[key]
    if known and known >= at then
      return known
    end
    seen[key] = at
  end
  local cur = call('PEXPIRETIME', key)
  if cur == -1 or cur < at then
    cur = at + (slack or 0)
    call('PEXPIREAT', key, cur)
  end
  return cur
end

--[[ MARKS. What lets a process know, in the very call that judges or reports a decision,
whether Redis went back in time behind it (a failover that lost writes, a restart from an
older file, a backup put back, a rollback in place, FLUSHALL).

  mark   m:{<tag>}   hash, TTL MARK_TTL_MS (pushed on by every process's watch)
           "*"      -> G, the count of marked writes this node (standalone) or slot
                       (cluster: one mark per slot, its tag chosen to hash to it) has run
           <life>   -> the G of the newest write of process lifetime <life>
           "#<life>" -> the number of lifetime <life>'s newest write through this mark (its
                       process numbers its writes through a mark 1, 2, 3, … as it sends them)
           "!"      -> an announcement: until when (Redis TIME, ms) a process is putting its
                       journal back into this Redis; every marked call refuses meanwhile
           "!<life>" -> that lifetime's own announcement, which it ends at once when its
                       restore is done ("!" is the latest of them)
           "^<life>" -> the token of that lifetime's restore under way
           "%<token>" -> how many writes through this mark that restore has made (each
                       counts itself): what it checks at its end (mark_restored)
  node   n:{<tag>}   hash, TTL MARK_TTL_MS; on a cluster only, one per primary, in the
                     highest slot it serves (capsvc/redis/cluster.py)
           "*"      -> N, the count of the marked writes' calls the primary has run (`calls`),
                       whatever their slots
           "!"      -> an announcement, as in a mark

A slot's mark moves with the slot's data (a reshard), so it covers exactly what the slot
holds: each journal record is stamped with it, and a restore compares stamps with it. But a
process judges on a slot it never used against nothing it saw there; so on a cluster each
call also checks and counts in its PRIMARY's count N, which the process saw through its
calls on any slot of that primary and its watch (which reads every primary's): a primary
that goes back in time goes back as a whole, and refuses every process that saw it ahead,
whatever the slots that process used.

The marked functions run only through `calls`: the marked calls a process sends a node in
one turn of its event loop go as one FCALL (one a node and a turn, on a cluster as on one
Redis), which checks the node's N once and counts it once. `calls` is registered
`allow-cross-slot-keys` and names every call's keys and the node's key in ARGV (the cluster
refuses declared keys of several slots); Redis lets a script reach an undeclared key of
another slot of its own node, and refuses one of another node ("non local key": that call
ran nothing, the caller's slot map is out of date, capsvc/redis/marks.py sends it again).

Every marked call names the mark as its LAST key, and what the caller knows of it,
"<G seen>:<G of its own newest write answered>:<lo>:<q>"; `calls` names the node ("" on one
Redis: its one mark is the node's), the caller's life and the N it saw (life "": a tool,
neither checked nor counted): q is the call's number among the caller's writes through this mark
(1, 2, 3, … as they are sent: a call sent again takes a new one), lo the number of the
newest of those sent before it that the caller expects to have run (answered, or still on
its way; 0: none) — not those that failed, nor those whose outcome is unknown (a timeout, a
lost connection: they may have run or not). The call is refused with BEHIND (nothing run)
when the mark is behind what the caller knows: G lower than the G it last saw (any
process's writes lost), or its own field lower than its newest write answered; or when the
node's N is lower than the N it saw. It is refused with UNSETTLED (nothing run) when the
number of the caller's newest write that ran here ("#<life>") is below lo, or not below q:
a write it expects has not run here yet (a cluster's slot moving reorders a process's calls:
one sent back with TRYAGAIN runs after one sent behind it), or ran and was lost (a rollback
in place) before its answer was read; or one sent after it ran first. The caller sends it
again (a new q) once those answers are read: a write lost then reads as its own field lower
than its newest write answered (BEHIND), and the call never writes the lost write's G again
over the rollback, which would hide the loss. Numbers, not a count: a write whose outcome
the caller does not know that ran adds to any count, and a count then passes over a lost
write it expects; a number at least lo can only have been written by a call that itself
found lo there, so every write the caller expects ran before it, and is still there.
A write then counts itself (G + 1, its field set to it, "#<life>" to q; N + 1 once a
`calls`) and answers {G, reply}, the call {N, …} — a look-up too: a decision reported is a write of the reporter's, so that
losing the decision loses the write, and the reporter sees it. The mark is written by the
same call as the data it covers, so replication and the AOF keep them together: it can never
be ahead of that data, and whatever Redis keeps of a node's history is a prefix of it. A
journal record carries the G of the calls that made it: Redis holds it exactly when the mark
of its process's life is not below. ]]
local MARK_TTL_MS = 8 * 86400000

local function restoring(h)
  return h and tonum(h) > now_ms()
end

-- nil when the caller may go on; else the error reply that refuses the call.
local function mark_refusal(mark, life, seen)
  local last = '#' .. life
  local m = call('HMGET', mark, '*', '!', life, last)
  if restoring(m[2]) then
    return redis.error_reply('RESTORING a process is putting its journal back into Redis')
  end
  local c1 = find(seen, ':', 1, true)
  local c2 = find(seen, ':', c1 + 1, true)
  local c3 = find(seen, ':', c2 + 1, true)
  local g, own, ran = tonum(m[1]) or 0, tonum(m[3]) or 0, tonum(m[4]) or 0
  if g < num(sub(seen, 1, c1 - 1)) or own < num(sub(seen, c1 + 1, c2 - 1)) then
    return redis.error_reply('BEHIND ' .. g .. ':' .. own .. ':' .. ran)
  end
  local q = num(sub(seen, c3 + 1))
  if ran < num(sub(seen, c2 + 1, c3 - 1)) or ran >= q then
    return redis.error_reply('UNSETTLED ' .. ran)
  end
  return nil, g, last, q
end

-- The functions that judge or report a decision, by name: each runs through `calls`.
local MARKED = {}

-- One call of `calls`: its reply {G, function's reply} and whether it counted itself, or
-- the error reply that refused it (nothing ran).
local function run_marked(fn, keys, args, life, seen, cluster)
  if cluster then  -- its keys checked first, as Redis checks a call's declared keys
    call('EXISTS', unpack(keys))
  end
  local mark = remove(keys)
  if life == '' then
    return {0, fn(keys, args)}, false
  end
  if sub(life, 1, 1) == '%' then  -- a restore's write: counted, not checked
    local reply = fn(keys, args)
    call('HINCRBY', mark, life, 1)
    return {0, reply}, false
  end
  local refused, g, last, q = mark_refusal(mark, life, seen)
  if refused then
    return refused, false
  end
  local reply = fn(keys, args)
  g = g + 1
  call('HSET', mark, '*', g, life, g, last, q)
  if g == 1 then
    call('PEXPIRE', mark, MARK_TTL_MS)
  end
  return {g, reply}, true
end

--[[ calls: KEYS the first call's first key (it routes the call); ARGV node, life, N seen,
then each call: function, #keys, its keys (its mark last), #args, its args, seen
"<G seen>:<G of its own newest write answered>:<lo>:<q>".
The marked calls a process sends one node in one turn of its event loop, as one FCALL, in
order; each judged and counted in its mark as if sent alone (MARKS), the node's N checked
once and counted once for them all. Refused as a whole, nothing run, when the node's count
is behind what the caller saw, or a restore is announced on it. A call that fails (a key
another node serves: "non local key"; a refusal) fails alone; those before it stay run. On
a cluster a call's keys are undeclared: each call first reads them all at once (EXISTS), so
that Redis checks them as it checks a call's declared keys before it runs — a slot being
moved, a key of it moved already, refuses the call before it writes any (else it could
write part of its keys and fail on the next).
Returns {N, each call's {G, reply} or its error}. ]]
local function calls(keys, args)
  local node, life = args[1], args[2]
  local checked = life ~= '' and sub(life, 1, 1) ~= '%'
  local ng = 0
  if node ~= '' and checked then
    local n = call('HMGET', node, '*', '!')
    if restoring(n[2]) then
      return redis.error_reply('RESTORING a process is putting its journal back into Redis')
    end
    ng = tonum(n[1]) or 0
    if ng < num(args[3]) then
      return redis.error_reply('BEHIND node ' .. ng)
    end
  end
  local out, wrote = {0}, false
  local i, na = 4, #args
  while i <= na do
    local fn, nk = MARKED[args[i]], num(args[i + 1])
    local ck = slice(args, i + 1, nk)
    i = i + 2 + nk
    local nc = num(args[i])
    local ca = slice(args, i, nc)
    local ok, reply, counted = pcall(run_marked, fn, ck, ca, life, args[i + nc + 1],
                                     node ~= '')
    i = i + nc + 2
    if not ok then
      reply = redis.error_reply(type(reply) == 'table' and reply.err or tostring(reply))
    end
    wrote = wrote or counted
    out[#out + 1] = reply
  end
  if wrote and node ~= '' then
    ng = call('HINCRBY', node, '*', 1)
    if ng == 1 then
      call('PEXPIRE', node, MARK_TTL_MS)
    end
  end
  out[1] = ng
  return out
end

--[[ marks: KEYS mark; ARGV lives... (read only; each mark of `marks_of`)
Returns {G, announced until (or false), the G of each life (false when none)}. ]]
local function marks(keys, args)
  local m = call('HMGET', keys[1], '*', '!', unpack(args))
  return m
end

--[[ marks_of: KEYS a mark; ARGV n, n lives, then more marks of the same node (read only).
Returns each mark as `marks` reads it, in order (KEYS[1]'s first): what a process's watch
reads of every slot's mark on a cluster, one call a node rather than one a mark. The other marks are not declared (the
cluster refuses declared keys of several slots): a mark the node does not serve fails the
call ("non local key"), and the caller reads that node's marks one by one. ]]
local function marks_of(keys, args)
  local n = tonum(args[1])
  local lives = {unpack(args, 2, n + 1)}
  local out = {marks(keys, lives)}
  for i = n + 2, #args do
    out[#out + 1] = marks({args[i]}, lives)
  end
  return out
end

--[[ mark_restored: KEYS mark; ARGV restorer, token, counter, writes, (life, G of its newest
write)...
After a restore put lifetimes' records back: their fields and G raised to at least those G
(never lowered; a field "#<life>", the number of a lifetime's newest write, raises only
itself), the mark's TTL
renewed. Only if the restore's token (`announce`) is still there (token "": a mark it wrote
through without announcing there, its count alone is checked), and the count of the
restore's writes through this mark (field `counter`, "%<token>", counted by each of them:
`counted`, and the marked functions called with it as life) is `writes`: else
Redis went back in time (or was emptied) while the restore ran — to before it began, or to
a snapshot taken while it ran, which holds its token but not what it wrote after — and what
it put back may be gone with it: error LOST, nothing written (the restore runs again).
Returns the mark's G. ]]
local function mark_restored(keys, args)
  local mark = keys[1]
  if args[2] ~= '' and call('HGET', mark, '^' .. args[1]) ~= args[2] then
    return redis.error_reply('LOST the restore\'s token is gone: Redis went back in time')
  end
  local counter = args[3]
  if (tonum(call('HGET', mark, counter)) or 0) ~= tonum(args[4]) then
    return redis.error_reply('LOST the restore\'s writes are not all there: Redis went back '
                             .. 'in time')
  end
  call('HDEL', mark, counter)
  local g = tonum(call('HGET', mark, '*')) or 0
  for i = 5, #args, 2 do
    local made = tonum(args[i + 1])
    if (tonum(call('HGET', mark, args[i])) or 0) < made then
      call('HSET', mark, args[i], made)
    end
    if g < made and sub(args[i], 1, 1) ~= '#' then
      g = made
    end
  end
  call('HSET', mark, '*', g)
  call('HDEL', mark, '^' .. args[1])
  call('PEXPIRE', mark, MARK_TTL_MS)
  return g
end

--[[ announce: KEYS mark; ARGV for_ms, restorer[, token]
A restore under way: every marked call refuses until now + for_ms (at least; only its
restorer shortens it, with announce_end). The restorer's own end ("!<restorer>") set too.
When it begins (and only then: a renewal must not put back a token that Redis lost), the
restore's token ("^<restorer>"), for mark_restored to find. Returns the announcement's
end. ]]
local function announce(keys, args)
  local mark = keys[1]
  local till = now_ms() + tonum(args[1])
  call('HSET', mark, '!' .. args[2], till)
  local cur = tonum(call('HGET', mark, '!')) or 0
  if cur < till then
    call('HSET', mark, '!', till)
  else
    till = cur
  end
  if args[3] then
    call('HSET', mark, '^' .. args[2], args[3])
  end
  if call('PTTL', mark) < 0 then
    call('PEXPIRE', mark, MARK_TTL_MS)
  end
  return till
end

--[[ announce_end: KEYS mark; ARGV restorer
The restorer's restore is done: its own announcement removed at once, and "!" brought back
to the latest of the others still holding (removed when none is). An end in "!" that no
restorer's own field reaches is left as it is (it ends by itself). Returns "!" as left
(0: none). ]]
local function announce_end(keys, args)
  local mark, now = keys[1], now_ms()
  local own = tonum(call('HGET', mark, '!' .. args[1]))
  call('HDEL', mark, '!' .. args[1])
  local cur = tonum(call('HGET', mark, '!'))
  if not own or not cur or cur > own then
    return cur or 0
  end
  local latest = 0
  local fields = call('HGETALL', mark)
  for i = 1, #fields, 2 do
    local f = fields[i]
    if #f > 1 and sub(f, 1, 1) == '!' then
      local till = tonum(fields[i + 1])
      if till > latest then
        latest = till
      end
    end
  end
  if latest > now then
    call('HSET', mark, '!', latest)
    return latest
  end
  call('HDEL', mark, '!')
  return 0
end

--[[ mark_keep: KEYS mark; ARGV life (each process's watch, once in a while)
The mark's TTL renewed, an announcement past its end removed, the counts of restores no
longer under way ("%<token>" without its "^<restorer>" token) removed, the caller's
lifetime noted alive ("@<life>" -> now), and the fields of lifetimes not alive for
MARK_TTL_MS removed: their records are past their retention by then (a lifetime without its
field has all of its records restored, which is never wrong). ]]
local function mark_keep(keys, args)
  local mark, now = keys[1], now_ms()
  if call('EXISTS', mark) == 0 then
    return 0
  end
  call('PEXPIRE', mark, MARK_TTL_MS)
  call('HSET', mark, '@' .. args[1], now)
  local till = call('HGET', mark, '!')
  if till and tonum(till) <= now then
    call('HDEL', mark, '!')
  end
  local fields = call('HGETALL', mark)
  local gone, tokens = 0, {}
  for i = 1, #fields, 2 do
    if sub(fields[i], 1, 1) == '^' then
      tokens[fields[i + 1]] = true
    end
  end
  for i = 1, #fields, 2 do
    local f = fields[i]
    if sub(f, 1, 1) == '%' and not tokens[sub(f, 2)] then
      call('HDEL', mark, f)  -- the count of a restore that ended or failed
    elseif sub(f, 1, 1) == '@' and tonum(fields[i + 1]) < now - MARK_TTL_MS then
      call('HDEL', mark, f, sub(f, 2), '#' .. sub(f, 2))
      gone = gone + 1
    elseif #f > 1 and sub(f, 1, 1) == '!' and tonum(fields[i + 1]) <= now then
      call('HDEL', mark, f)
    end
  end
  return gone
end

--[[ TICKET RECORDS. r:{t:NN}:<m>  field <channel>/<ticket id>: a hash shared by the records
of many tickets (m: the ticket's second hash, see capsvc/redis/store.py). The value is
MessagePack: expiry, then st, at (an integer), sid (its 8 bytes; hex to every reader of
ticket_read), sale, body, res, ca, rel (nil when absent). No fingerprint: the sale's own,
recomputed from `sale` by the caller that compares a request with it. A record past its
expiry (by Redis TIME) is absent to every reader, as an expired key is; the janitor's
`sweep` deletes it, and the bucket itself has a TTL past its newest record's expiry (by a
day at most: BUCKET_SLACK_MS). Its field "!" (no ticket's: a ticket's field has a "/") is
the instant a sale last made sure the bucket lives to, which the sale after it reads with
its record instead of the bucket's TTL (`bucket_lives`). ~165 bytes a ticket in a listpack
bucket at 100,000 tickets, against ~280 for a key, its expiry entry and a hash of its own
(bench/memory.py).
A ticket's functions name its record by KEYS[1], its bucket (`KEYS ticket` below), and
ARGV[1], its field, before the call's own ARGV. ]]
local FIELD = {st = 1, at = 2, sid = 3, sale = 4, body = 5, res = 6, ca = 7, rel = 8}

-- A sale id's 8 bytes, from its hex.
local function raw_sid(sid)
  return spack('>I4I4', tonum(sub(sid, 1, 8), 16), tonum(sub(sid, 9, 16), 16))
end

-- A sale id's hex, from its 8 bytes.
local function sid_hex(raw)
  return format('%02x%02x%02x%02x%02x%02x%02x%02x', byte(raw, 1, 8))
end

-- The ticket a call is about (KEYS[1] its bucket); its field is taken out of ARGV, in place,
-- so that the call's own ARGV come first.
local function ticket_of(keys, args)
  local bucket, field = keys[1], remove(args, 1)
  return {bucket = bucket, field = field,
          name = 't:' .. sub(bucket, 3, find(bucket, '}', 3, true)) .. ':'
                 .. field}
end

-- A record's value `v` (or nil) and its expiry, if it is live at `now` (past its expiry, a
-- record is absent, as an expired key is); nil otherwise.
local function live(v, now)
  if v then
    local _, exp = munpack_one(v)
    if exp > now then
      return v, exp
    end
  end
end

-- The bucket's value of the record and its expiry, if it is live at `now`.
local function live_value(T, now)
  return live(call('HGET', T.bucket, T.field), now)
end

-- A record's value as st, at, sid, sale, body, res, ca, rel (false when absent), and its
-- expiry and sid's bytes.
local function ticket_decode(v)
  local exp, a, b, c, d, e, f, g, h = munpack(v)
  return {a or false, b or false, c and sid_hex(c) or false, d or false, e or false,
          f or false, g or false, h or false}, exp, c
end

-- The record as st, at, sid, sale, body, res, ca, rel (false when absent: rec[1] false
-- for no ticket), read at `now`.
local function ticket_read(T, now)
  T.now = now
  local v, exp = live_value(T, now)
  if v then
    T.rec, T.exp, T.sid_raw = ticket_decode(v)
    T.held = exp
    return T.rec
  end
  T.rec = {false, false, false, false, false, false, false, false}
  return T.rec
end

-- The record's st and sid only (false when there is none), read at `now`: what a journal
-- batch's release looks at, without decoding the rest.
local function ticket_state(T, now)
  local v = live_value(T, now)
  if v then
    local _, _, st, _, sid = munpack_limit(v, 4)
    return st, sid and sid_hex(sid)
  end
  return false, false
end

-- How much longer than its newest record a bucket is given to live, so that the records of
-- the next draws (later by minutes) seldom push its TTL again: one PEXPIREAT a bucket a day
-- rather than one a sale. The sweep deletes every record on time; this only lets an empty
-- bucket that nobody sweeps (every process stopped) linger a day at most.
local BUCKET_SLACK_MS = 86400000

-- A sale's record bucket made to live to `at` at least. `known`: its "!" (read with the
-- record), the instant the bucket is known to live to: a lower bound of its expiry, set
-- only to what a write of it made sure of, and nothing shortens a bucket's TTL (a bucket
-- that is deleted or expires takes its "!" with it). So a sale reads no TTL when "!" says
-- enough; else the TTL is read (pushed a day past `at` when short) and "!" set to it.
local function bucket_lives(bucket, at, at_text, known)
  -- Instants as decimal text of one length (13 digits until 2286) compare as numbers.
  if known and #known == #at_text and known >= at_text then
    return
  end
  call('HSET', bucket, '!', format('%d', extend(bucket, at, BUCKET_SLACK_MS)))
end

-- The record written back (or deleted, past its expiry). Its bucket's TTL is looked at only
-- when the record's expiry is not the one it was read with (`T.held`): a bucket lives past
-- the expiry of every record it holds (each write pushes it there, nothing shortens it), so
-- a record read live keeps its bucket to its expiry; a decision, a cancel, the janitor's
-- expiry rewrite the record without a read of the bucket's TTL.
local function ticket_store(T)
  local r = T.rec
  if T.exp > T.now then
    local sid = r[3] and (T.sid_raw or raw_sid(r[3]))  -- no ticket_set changes a sid
    call('HSET', T.bucket, T.field, mpack(T.exp, r[1] or nil, r[2] or nil, sid or nil,
         r[4] or nil, r[5] or nil, r[6] or nil, r[7] or nil, r[8] or nil))
    if T.exp ~= T.held then
      extend(T.bucket, T.exp, BUCKET_SLACK_MS, T.seen)
    end
  else
    call('HDEL', T.bucket, T.field)
    if T.seen then
      T.seen[T.bucket] = nil  -- the bucket may be gone: its TTL is set again when it is not
    end
  end
end

-- Set fields (name, value, …) of the record read by ticket_read.
local function ticket_set(T, ...)
  local set = {...}
  for i = 1, #set, 2 do
    local v = set[i + 1]
    T.rec[FIELD[set[i]]] = type(v) == 'number' and format('%d', v) or v
  end
  ticket_store(T)
end

-- A new record (none was read), kept until `expire_at`: st, at (ms), sid (hex), sale, then
-- body, res, ca, rel or false (none).
local function ticket_new(T, expire_at, st, at, sid, sale, body, res, ca, rel)
  T.rec = {st, at, sid, sale, body or false, res or false, ca or false, rel or false}
  T.sid_raw = raw_sid(sid)
  T.exp = expire_at
  ticket_store(T)
end

local function ticket_delete(T)
  call('HDEL', T.bucket, T.field)
end

--[[ claim: KEYS ticket, pending index; ARGV sale, close_ms, expire_at, stale_after_ms, nonce
First registers the ticket in its slot's pending index for the janitor (at Redis TIME, if
it is not there yet; the index kept until `expire_at` at least), in the same atomic call as
the claim, so that no claimed ticket is ever missing from the index. At Redis TIME: a
draw's report waits for the entries made before its close, judged by the clock that judged
the close. Returns {'new', at, sid} | {'final', body or false, at, sid, sale, res or false, st,
cancelled at or false, released or false} (a decision of `sell` has results, not a body;
st: f, k or c) | {'pending', at, sid, sale}
| {'stale', sale} | {'closed'} (the first draw's close has passed: nothing claimed). The
sale of a ticket id already recorded comes back with the answer: the caller compares its
request with it (another request's: a conflict, nothing done). A decided ticket replays at
any time. Admin stops live in another slot: the caller reads them with its first step
after the claim and voids a sale claimed once a draw of it was stopped. ]]
-- The answer of a claim (or a sale) for a ticket id already recorded: `rec` is its
-- st, at, sid, sale, body, res, ca, rel.
local function known_ticket(rec, now, stale_after_ms)
  local st = rec[1]
  if st == 'f' or st == 'k' or st == 'c' then
    return {'final', rec[5], tonum(rec[2]), rec[3], rec[4], rec[6], st, rec[7], rec[8]}
  end
  if st == 'p' and now - tonum(rec[2]) < stale_after_ms then
    return {'pending', tonum(rec[2]), rec[3], rec[4]}
  end
  return {'stale', rec[4]}
end

local function claim(keys, args)
  local T = ticket_of(keys, args)
  local t = call('TIME')
  local now = tonum(t[1]) * 1000 + floor(tonum(t[2]) / 1000)
  call('ZADD', keys[2], 'NX', now, T.name)
  extend(keys[2], tonum(args[3]))
  local rec = ticket_read(T, now)
  local st = rec[1]
  if not st then
    if now >= tonum(args[2]) then
      return {'closed'}
    end
    -- The caller's random nonce keeps the id new even if TIME repeats (a clock stepped
    -- back after an unclaim): a sale never meets another sale's records.
    local sid = sub(redis.sha1hex(T.name .. '\n' .. t[1] .. '.' .. t[2] .. '\n'
                                  .. args[5]), 1, 16)
    ticket_new(T, tonum(args[3]), 'p', now, sid, args[1])
    return {'new', now, sid}
  end
  return known_ticket(rec, now, tonum(args[4]))
end

--[[ ticket: KEYS ticket (see TICKET RECORDS) (read only)
Returns the record's st, body, sale, sid, at, ca, rel, res (false when absent). ]]
local function ticket(keys, args)
  local T = ticket_of(keys, args)
  local r = ticket_read(T, now_ms())
  return {r[1], r[5], r[4], r[3], r[2], r[7], r[8], r[6]}
end

--[[ sweep: KEYS bucket; ARGV cursor, count
For the janitor: deletes the records of one bucket past their expiry, HSCAN from `cursor`
by `count`. Returns {next cursor ("0": the bucket is done), records deleted}. ]]
local function sweep(keys, args)
  local now = now_ms()
  local page = call('HSCAN', keys[1], args[1], 'COUNT', tonum(args[2]))
  local fields, gone = page[2], {}
  for i = 1, #fields, 2 do
    if fields[i] ~= '!' then  -- the bucket's known expiry (TICKET RECORDS), not a record
      local _, exp = munpack_one(fields[i + 1])
      if exp <= now then
        gone[#gone + 1] = fields[i]
      end
    end
  end
  if #gone > 0 then
    call('HDEL', keys[1], unpack(gone))
  end
  return {page[1], #gone}
end

--[[ AGGREGATES. a:{t:NN}:<game>:<draw> (hash, in the slot of the tickets it counts): the
base stake accepted on that draw by grids of the sizes the game does not cap (the capped
sizes' are in the counters), by number of picks; a draw's exposure adds the 64 ticket
slots up. Two kinds of fields:
  <picks>     -> stake   added by `sell` (one atomic call: counted once), taken back by
                         `cancelled` when the ticket was sold so
  <sale id>   -> "<picks>:<stake>,…"  a sale in steps: written whole (`aggregate`, before
                         its decision) and removed whole (`aggregate` with no value: given
                         back or cancelled), so a step run again never counts twice; one key
                         per call, as the ticket's own steps
TTL: the draw's close + retention.

aggregate: KEYS the aggregate, the ticket's record bucket (the same slot); ARGV sale id,
value ("" removes the sale's share), expire_at, the ticket's field. A share is written only
while the ticket is that sale's and not cancelled (k, c): a duplicate request of the sale
still running after a cancel must not put the cancelled stake back. Returns 1 if written
(or removed), 0 if not. ]]
local function aggregate(keys, args)
  if args[2] == '' then
    call('HDEL', keys[1], args[1])
    return 1
  end
  local rec = ticket_read({bucket = keys[2], field = args[4]}, now_ms())
  if rec[3] ~= args[1] or rec[1] == 'k' or rec[1] == 'c' then
    return 0
  end
  call('HSET', keys[1], args[1], args[2])
  extend(keys[1], tonum(args[3]))
  return 1
end

--[[ aggregate_sum: KEYS an aggregate (read only). Returns {picks, stake, …}: its totals
and its sales' shares added up. ]]
local function aggregate_sum(keys, args)
  local sums = {}
  local all = call('HGETALL', keys[1])
  for i = 1, #all, 2 do
    if #all[i] <= 2 then  -- a total by number of picks
      sums[all[i]] = (sums[all[i]] or 0) + tonum(all[i + 1])
    else
      for picks, stake in gmatch(all[i + 1], '(%d+):(%-?%d+)') do
        sums[picks] = (sums[picks] or 0) + tonum(stake)
      end
    end
  end
  local out = {}
  for picks, stake in pairs(sums) do
    out[#out + 1] = picks
    out[#out + 1] = stake
  end
  return out
end

--[[ finalize: KEYS ticket; ARGV sid, body
Writes the decision of sale `sid` if it is still pending (or being settled).
Returns 1 if written: of the requests of one sale, the one whose finalize writes answers
the decision first (and counts it); the others find it written (0) and replay it. ]]
local function finalize(keys, args)
  local T = ticket_of(keys, args)
  local rec = ticket_read(T, now_ms())
  if (rec[1] == 'p' or rec[1] == 'x') and rec[3] == args[1] then
    ticket_set(T, 'st', 'f', 'body', args[2])
    return 1
  end
  return 0
end

--[[ journaled_many: KEYS the first ticket's index (and, when every ticket is in its index,
their buckets); ARGV index 1, bucket 1, field 1, sid 1, state 1, …, index n, bucket n,
field n, sid n, state n
The decisions of sales `sid` in states `state` (f: sold, c: cancelled; '': voided, the
ticket forgotten) are journaled (a batch of the journal, made durable together): each
ticket's index entry goes, unless the ticket has moved on since (a cancel decided
meanwhile, another sale of the id): the janitor then journals what it holds now. One call,
and one ZREM per index. On a cluster, one call a node: the tickets of several indexes are
not declared (the cluster refuses declared keys of several slots; the function is
registered `allow-cross-slot-keys`), only the first index, which routes the call. A name
the node does not serve fails the call ("non local key"; every name is read before the
first ZREM, and an index's entries are removed only after its tickets were read), and the
caller sends each index's entries on their own, declaring them. Such a call is never sent
with ASKING (capsvc/redis/cluster.py): on the node importing a slot, a ticket of it not
moved yet would read as absent, as if forgotten. Returns how many entries went. ]]
local function journaled_many(keys, args)
  local gone, order = {}, {}
  local now = now_ms()
  for j = 1, #args, 5 do
    local T = ticket_of({args[j + 1]}, {args[j + 2]})
    local st, sid = ticket_state(T, now)
    if not st or (st == args[j + 4] and sid == args[j + 3]) then
      local index = args[j]
      if not gone[index] then
        gone[index] = {}
        order[#order + 1] = index
      end
      local members = gone[index]
      members[#members + 1] = T.name
    end
  end
  local removed = 0
  for _, index in ipairs(order) do
    removed = removed + call('ZREM', index, unpack(gone[index]))
  end
  return removed
end

--[[ unclaim: KEYS ticket; ARGV sid
Forgets sale `sid` while it is pending or being settled (what it took must be released
first). Returns 1 if forgotten. ]]
local function unclaim(keys, args)
  local T = ticket_of(keys, args)
  local rec = ticket_read(T, now_ms())
  if (rec[1] == 'p' or rec[1] == 'x') and rec[3] == args[1] then
    ticket_delete(T)
    return 1
  end
  return 0
end

--[[ expire: KEYS ticket; ARGV deadline_ms
For the janitor. A ticket pending for deadline_ms or more becomes expired (no request
resumes it any more); a cancel left unfinished for deadline_ms is handed over too; a
decision (sold, cancelled) still indexed deadline_ms after it was made was maybe never
journaled (its request died before): handed over to be.
Returns {'x', at, sid, sale} | {'k' or 'c', at, sid, sale, body, cancelled at, released,
res} | {'f', at, sid, sale, body, false, false, res} to settle, {'wait'} when the ticket is
not due yet, {} when the janitor has nothing to do with it (drop the entry). ]]
local function expire(keys, args)
  local T = ticket_of(keys, args)
  local now, deadline = now_ms(), tonum(args[1])
  local rec = ticket_read(T, now)
  local st = rec[1]
  if st == 'p' then
    if now - tonum(rec[2]) < deadline then
      return {'wait'}
    end
    ticket_set(T, 'st', 'x')
    st = 'x'
  end
  if st == 'x' then
    return {'x', rec[2], rec[3], rec[4]}
  end
  if st == 'k' or st == 'c' or st == 'f' then
    if now - tonum(st == 'f' and rec[2] or rec[7]) < deadline then
      return {'wait'}
    end
    return {st, rec[2], rec[3], rec[4], rec[5], rec[7], rec[8], rec[6]}
  end
  return {}
end

--[[ cancel: KEYS ticket, stop copy, pending index; ARGV close_ms, stop field
("<game>:<first draw>"), released, expire_at (the ticket's)
Decides the cancellation of a final ticket while its first draw is open (by Redis TIME) and
not stopped by an admin (the stop copy in this slot, written before the admin's stop was
answered): the ticket becomes `k` (cancelling) with the instant and the amount given back;
the caller then releases the sale's records and calls `cancelled`. Returns {'k', at,
released, sid} (also when an earlier cancel was interrupted) | {'c', at, released}
| {'closed'} | {'missing'} | {'undecided'}. ]]
local function cancel(keys, args)
  local T = ticket_of(keys, args)
  local now = now_ms()
  local rec = ticket_read(T, now)
  local st = rec[1]
  if not st then
    return {'missing'}
  end
  if st == 'c' then
    return {'c', tonum(rec[7]), tonum(rec[8])}
  end
  if st == 'k' then
    call('ZADD', keys[3], 'NX', now, T.name)
    extend(keys[3], tonum(args[4]))
    return {'k', tonum(rec[7]), tonum(rec[8]), rec[3]}
  end
  if st ~= 'f' then
    return {'undecided'}
  end
  if now >= tonum(args[1]) or call('HEXISTS', keys[2], args[2]) == 1 then
    return {'closed'}
  end
  ticket_set(T, 'st', 'k', 'ca', now, 'rel', args[3])
  -- Indexed with the decision (not in a call before it, which a removal of the sale's
  -- entry could follow): the janitor finishes the cancel if its request dies.
  call('ZADD', keys[3], 'NX', now, T.name)
  extend(keys[3], tonum(args[4]))
  return {'k', now, tonum(args[3]), rec[3]}
end

--[[ cancelled: KEYS ticket, then (a ticket sold in one call, on one node) the aggregates
of its draws; ARGV sid, then picks, stake pairs
Marks the cancel of sale `sid` complete (every record released), and takes a ticket sold in
one call out of its draws' aggregates (see AGGREGATES). ]]
local function cancelled(keys, args)
  local T = ticket_of(keys, args)
  local rec = ticket_read(T, now_ms())
  if rec[1] == 'k' and rec[3] == args[1] then
    ticket_set(T, 'st', 'c')
    for k = 2, #keys do
      for j = 2, #args, 2 do
        call('HINCRBY', keys[k], args[j], -tonum(args[j + 1]))
      end
    end
    return 1
  end
  return 0
end

--[[ exposure: KEYS counter buckets of one draw (one on a cluster, many on one node);
ARGV cap, min_stake, floor (read only)
What a draw's exposure needs of those buckets: {stats, top} where stats is, per number of
picks, picks, combinations played, at their cap, at 80 % of it or more, their stake; and
top the 20 largest counters above `floor`, combo, total, largest first (the caller passes
the 20th largest it already has, so that replies stay small). ]]
local function exposure(keys, args)
  local cap, min_stake, floor = tonum(args[1]), tonum(args[2]), tonum(args[3])
  local near = cap * 0.8
  local stats, top = {}, {}
  for k = 1, #keys do
    local all = call('HGETALL', keys[k])
    for i = 1, #all, 2 do
      local field = all[i]
      if byte(field, 1) ~= 0 then
        local total = tonum(all[i + 1])
        if total > 0 then
          local s = stats[#field]
          if not s then
            s = {0, 0, 0, 0}
            stats[#field] = s
          end
          s[1] = s[1] + 1
          s[4] = s[4] + total
          if cap - total < min_stake then
            s[2] = s[2] + 1
          end
          if total >= near then
            s[3] = s[3] + 1
          end
          if total > floor then
            top[#top + 1] = {field, total}
          end
        end
      end
    end
  end
  table.sort(top, function(x, y) return x[2] > y[2] or (x[2] == y[2] and x[1] < y[1]) end)
  local flat_stats, flat_top = {}, {}
  for picks, s in pairs(stats) do
    for _, v in ipairs({picks, s[1], s[2], s[3], s[4]}) do
      flat_stats[#flat_stats + 1] = v
    end
  end
  for i = 1, min(20, #top) do
    flat_top[#flat_top + 1] = top[i][1]
    flat_top[#flat_top + 1] = top[i][2]
  end
  return {flat_stats, flat_top}
end

--[[ CAPS. A draw's cap is fixed when the draw is first sold (k:{<game>}:<draw>: by `sell`
itself, or by the caller of `reserve` once the sale's claim and stops are checked), so the
draws of one subscription may have different caps. The caller passes them
as one argument: "<cap>" for every draw, or "<cap 1>,<cap 2>,…" one per draw, optionally
followed by "/<shadow cap>": a lower cap evaluated on every grid and never enforced. ]]
local function caps_of(arg, n)
  local single = tonum(arg)
  local caps = {}
  if single then
    for i = 1, n do
      caps[i] = single
    end
    return caps, nil
  end
  local list, shadow = match(arg, '^([%d,]+)/?(%d*)$')
  for c in gmatch(list, '%d+') do
    caps[#caps + 1] = tonum(c)
  end
  for i = #caps + 1, n do
    caps[i] = caps[#caps]
  end
  return caps, tonum(shadow)
end

-- Offsets of the draws whose room for `combo` is now below the smallest stake.
local function sold_out(buckets, combo, caps, min_stake)
  local out = {}
  for i = 1, #buckets do
    local total = tonum(call('HGET', buckets[i], combo) or '0')
    if caps[i] - total < min_stake then
      out[#out + 1] = i - 1
    end
  end
  return out
end

-- The reply for an existing record of a grid.
local function recorded(buckets, combo, rec, caps, min_stake)
  local kind = sub(rec, 1, 1)
  if kind == 'X' then
    return {-2}
  end
  if kind == 'R' then
    local off, room = match(rec, '^R(%d+):(%-?%d+)$')
    return {0, tonum(off), tonum(room)}
  end
  local out = sold_out(buckets, combo, caps, min_stake)
  insert(out, 1, 0)
  insert(out, 1, 1)
  return out
end

-- Take back `stake` from `combo` on the first `n` buckets after `kb` in `keys`: a counter
-- back at zero goes (its bucket with it when that was its only field: its TTL is looked at
-- again by the next write of the call, `seen`), as if never counted.
local function uncount(keys, kb, n, combo, stake, seen)
  for i = kb + 1, kb + n do
    if call('HINCRBY', keys[i], combo, -stake) == 0 then
      call('HDEL', keys[i], combo)
      if seen then
        seen[keys[i]] = nil
      end
    end
  end
end

local NONE = {}  -- an empty list, never written

-- Count `stake` for a grid with no record yet on every draw (the `n` buckets after `kb` in
-- `keys`, `expiries`), or none: record what it took, or why it was refused, in the last
-- draw's bucket. Returns 1 (2: the shadow cap would have refused it), the counters it
-- brought to 80 % of their cap and the offsets of the draws it brought to their cap (a
-- list, or nil: none) when counted; 0, the offset of the draw that would overflow and its
-- room when refused (`reserve`'s reply, as values: no table a grid). Each counter is
-- increased first and taken back if that passed its cap (with the draws before it): one
-- command a draw for a grid accepted, the usual case, the call being atomic. A TTL is
-- written only when it grows (`extend`: a read is not propagated to the AOF and the
-- replicas, a write is).
local function count(keys, kb, n, field, combo, stake, caps, min_stake, expiries, shadow,
                     seen)
  local last = keys[kb + n]
  local shadowed = false
  local totals = n > 1 and {}  -- a grid of one draw: its total is `total`
  local total
  for i = 1, n do
    total = call('HINCRBY', keys[kb + i], combo, stake)
    if total > caps[i] then
      uncount(keys, kb, i, combo, stake, seen)
      local room = caps[i] - (total - stake)
      call('HSET', last, field, 'R' .. (i - 1) .. ':' .. room)
      extend(last, tonum(expiries[n]), 0, seen)
      return 0, i - 1, room
    end
    if shadow and total > shadow then
      shadowed = true
    end
    if totals then
      totals[i] = total
    end
  end
  local brought, sold = 0, nil
  for i = 1, n do
    local cap = caps[i]
    total = totals and totals[i] or total
    local near = cap * 0.8
    extend(keys[kb + i], tonum(expiries[i]), 0, seen)
    if total >= near and total - stake < near then
      brought = brought + 1
    end
    if cap - total < min_stake then
      sold = sold or {}
      sold[#sold + 1] = i - 1
    end
  end
  call('HSET', last, field, stake)
  return shadowed and 2 or 1, brought, sold
end

--[[ reserve: KEYS bucket(draw 1), …, bucket(draw n);
ARGV record, combo, stake, caps (see CAPS), close_ms, min_stake, expire_at(draw 1), …,
expire_at(draw n)
All or nothing over the n draws of one grid of one sale. Returns
  {1, near, sold-out offsets…}  accepted (now or by an earlier run of the same sale): every
                                counter grew by stake; `near` counts the counters this call
                                brought to 80 % of the cap
  {2, near, sold-out offsets…}  accepted, and the shadow cap would have refused it
  {0, offset, room}             rejected: the draw at `offset` would overflow
  {-1}                          no record and sales are closed: nothing counted
  {-2}                          the sale's record was released or sealed: nothing counted
With close_ms = 0 it seals instead (the janitor): a grid with no record gets "X" and {-2}. ]]
local function reserve(keys, args)
  local last, field, combo = keys[#keys], args[1], args[2]
  local stake, min_stake = tonum(args[3]), tonum(args[6])
  local caps, shadow = caps_of(args[4], #keys)
  local close_ms = tonum(args[5])
  local last_expiry = tonum(args[6 + #keys])
  local rec = call('HGET', last, field)
  if rec then
    return recorded(keys, combo, rec, caps, min_stake)
  end
  if close_ms == 0 then
    call('HSET', last, field, 'X')
    call('PEXPIREAT', last, last_expiry)
    return {-2}
  end
  if now_ms() >= close_ms then
    return {-1}
  end
  local status, x, y = count(keys, 0, #keys, field, combo, stake, caps, min_stake,
                             slice(args, 6), shadow)
  if status == 0 then
    return {0, x, y}
  end
  local out = {status, x}
  for _, offset in ipairs(y or NONE) do
    out[#out + 1] = offset
  end
  return out
end

--[[ release: KEYS bucket(draw 1), …, bucket(draw n);
ARGV record, combo, caps (see CAPS), min_stake, expire_at(draw n)
Gives back what the sale's grid took, once, and leaves "X" so that a late reserve of the
same sale cannot count it again (a grid never reserved is sealed the same way). Returns
{released stake, offsets that left the sold-out state…}; {0} when nothing is given back. ]]
local function release(keys, args)
  local last, field, combo = keys[#keys], args[1], args[2]
  local caps, min_stake = caps_of(args[3], #keys), tonum(args[4])
  local rec = call('HGET', last, field)
  if not rec then
    call('HSET', last, field, 'X')
    call('PEXPIREAT', last, tonum(args[5]))
    return {0}
  end
  local kind = sub(rec, 1, 1)
  if kind == 'X' or kind == 'R' then
    return {0}
  end
  local stake = tonum(rec)
  call('HSET', last, field, 'X')
  local out = {stake}
  for i = 1, #keys do
    -- The counter exists while its draw is retained (it holds at least this stake).
    if call('HEXISTS', keys[i], combo) == 1 then
      local total = call('HINCRBY', keys[i], combo, -stake)
      if total <= 0 then
        call('HDEL', keys[i], combo)
      end
      if caps[i] - total >= min_stake and caps[i] - (total + stake) < min_stake then
        out[#out + 1] = i - 1
      end
    end
  end
  return out
end

--[[ FEED. Each game has a stream of events (f:{<game>}): `capped` (a combination reached
its cap on a draw), `reopened` (a cancellation gave room back below the smallest stake),
`closed` (a draw stopped selling). Entries: type, draw, combo (capped, reopened), at (Redis
TIME, ms). Written in the same call as what they report, so an answered sale's event is
never lost; trimmed to ~100,000 entries, and the stream expires with the last draw it
reported. ]]
local function feed_add(stream, kind, draw, combo, expire_at)
  if combo then
    call('XADD', stream, 'MAXLEN', '~', 100000, '*', 'type', kind, 'draw', draw,
         'combo', combo, 'at', now_ms())
  else
    call('XADD', stream, 'MAXLEN', '~', 100000, '*', 'type', kind, 'draw', draw, 'at',
         now_ms())
  end
  extend(stream, tonum(expire_at))
end

--[[ sold_out: KEYS sold-out list, feed stream (optional); ARGV combo, expire_at, draw
Adds a combination to a draw's sold-out list with the draw's expiry, in one step (a list
without its TTL would outlive its draw), and its `capped` event to the game's feed. ]]
local function sold_out_add(keys, args)
  call('SADD', keys[1], args[1])
  call('PEXPIREAT', keys[1], tonum(args[2]))
  if keys[2] then
    feed_add(keys[2], 'capped', args[3], args[1], args[2])
  end
  return 1
end

--[[ feed_event: KEYS feed stream; ARGV type, draw, combo, expire_at ]]
local function feed_event(keys, args)
  feed_add(keys[1], args[1], args[2], args[3], args[4])
  return 1
end

--[[ feed_closed: KEYS feed stream, announced closes (hash draw -> expiry); ARGV draw,
expire_at. Announces that a draw closed, once whoever calls (every process notices the
calendar's closes; an admin's stop calls it too). Entries whose expiry passed are pruned.
Returns 1 when this call announced it. ]]
local function feed_closed(keys, args)
  local now = now_ms()
  if call('HSETNX', keys[2], args[1], args[2]) == 0 then
    return 0
  end
  local all = call('HGETALL', keys[2])
  for i = 1, #all, 2 do
    if tonum(all[i + 1]) <= now then
      call('HDEL', keys[2], all[i])
    end
  end
  extend(keys[2], tonum(args[2]))
  feed_add(keys[1], 'closed', args[1], nil, args[2])
  return 1
end

--[[ stop: KEYS stops; ARGV field, expire_at[, instant]
An admin stops sales of a draw now (the first stop wins; a journal's restore passes the
instant the stop was answered at): from the millisecond after Redis TIME, so that every
sale Redis ran before this call, stamped with this millisecond or an earlier one, was
claimed before the stop and stands, and every one-call sale after it sees the stop
(a claim in steps made later in this same millisecond is before the instant, and stands,
as the instant says). In the game's stops
hash (field: the draw), and in a copy per ticket slot (field "<game>:<draw>") that the
cancel function checks atomically. Stops of draws whose retention has passed are pruned
here, so a hash holds only draws still retained. Returns the instant sales stopped. ]]
local function stop(keys, args)
  local now = now_ms()
  local existing = call('HGET', keys[1], args[1])
  if existing then
    return tonum(match(existing, '^(%d+)'))
  end
  local all = call('HGETALL', keys[1])
  for i = 1, #all, 2 do
    local expiry = tonum(match(all[i + 1], ':(%d+)$'))
    if expiry <= now then
      call('HDEL', keys[1], all[i])
    end
  end
  local instant = tonum(args[3]) or now + 1
  call('HSET', keys[1], args[1], instant .. ':' .. args[2])
  extend(keys[1], tonum(args[2]))
  return instant
end

--[[ Player budgets (games with a daily limit).
A player's keys share one slot, so a subscription spread over several days is reserved on
all of them atomically. `ref` identifies what took the budget (a sale: channel, ticket and
sale id; another game's stake: channel and ref); its amount is recorded in the first day's
hash, so a re-run never charges twice and a settle adjusts to exactly what was accepted.
The self-limit in force on day D is `next` if `from` <= D (a raise, or a removal when next
is "none", takes effect the next day), else `limit`. ]]

local function self_limit(rec, day)
  local value = rec[1]
  if rec[3] and day >= rec[3] then
    value = rec[2]
  end
  if value == nil or value == false or value == 'none' then
    return nil
  end
  return tonum(value)
end

local function day_limit(rec, day, regulatory)
  local own = self_limit(rec, day)
  if own and own < regulatory then
    return own
  end
  return regulatory
end

-- The reply for what `ref` already holds in a day's hash (nil when nothing).
local function budget_recorded(limit_rec, day_key, day, ref, regulatory)
  local prev = call('HGET', day_key, ref)
  if not prev then
    return nil
  end
  local kind = sub(prev, 1, 1)
  if kind == 'X' then
    return {-2}
  end
  if kind == 'R' then
    return {0, tonum(sub(prev, 2))}
  end
  local spent = tonum(call('HGET', day_key, 'spent') or '0')
  return {1, day_limit(limit_rec, day, regulatory) - spent}
end

-- What is left of a day's budget (`rec`: the player's self-limit, `day` its date).
local function day_room(rec, day_key, day, regulatory)
  return day_limit(rec, day, regulatory)
         - tonum(call('HGET', day_key, 'spent') or '0')
end

-- Take `amount` into a day's `spent`, recorded under `ref`.
local function charge_day(day_key, ref, amount, expire_at, seen)
  call('HINCRBY', day_key, 'spent', amount)
  call('HSET', day_key, ref, amount)
  extend(day_key, expire_at, 0, seen)
end

-- Take each day's amount (budget's ARGV) into its `spent`, recorded under `ref`.
local function charge(keys, args, m, ref, expire_at)
  for i = 1, m do
    charge_day(keys[1 + i], ref, tonum(args[4 + m + i]), expire_at)
  end
end

--[[ budget: KEYS limit, day(1), …, day(m);
ARGV ref, regulatory, expire_at, mode, day(1)…day(m), amount(1)…amount(m)
mode "take": all or nothing over the m days. Returns {1, room left on day 1} | {0, room on
the day that refused}; a re-run returns the recorded outcome; {-2} when the janitor sealed
`ref`. mode "seal" (the janitor): when `ref` took nothing yet, records "X" so that a late
take cannot charge, and returns {-2}. mode "restore" (a journal's restore): when `ref` is not
recorded, takes the amounts without checking the limit (they were sold) and returns {1, 0,
1} (the third element: taken by this call, which a recorded take at no room left, {1, 0},
is not). ]]
local function budget(keys, args)
  local ref, regulatory, expire_at = args[1], tonum(args[2]), tonum(args[3])
  local m = #keys - 1
  local rec = call('HMGET', keys[1], 'limit', 'next', 'from')
  local prev = budget_recorded(rec, keys[2], args[5], ref, regulatory)
  if prev then
    return prev
  end
  if args[4] == 'seal' then
    call('HSET', keys[2], ref, 'X')
    extend(keys[2], expire_at)
    return {-2}
  end
  if args[4] == 'restore' then
    charge(keys, args, m, ref, expire_at)
    return {1, 0, 1}
  end
  local rooms = {}
  for i = 1, m do
    local room = day_room(rec, keys[1 + i], args[4 + i], regulatory)
    if tonum(args[4 + m + i]) > room then
      call('HSET', keys[2], ref, 'R' .. room)
      extend(keys[2], expire_at)
      return {0, room}
    end
    rooms[i] = room
  end
  charge(keys, args, m, ref, expire_at)
  return {1, rooms[1] - tonum(args[5 + m])}
end

--[[ stake: KEYS limit, today, yesterday, the day before; ARGV ref, regulatory, expire_at,
today, amount
A stake played on another game, idempotent by `ref` for at least 48 hours across
midnight: a ref recorded on one of the two days before answers as recorded. ]]
local function stake(keys, args)
  local rec = call('HMGET', keys[1], 'limit', 'next', 'from')
  for i = 3, 4 do
    local prev = budget_recorded(rec, keys[i], args[4], args[1], tonum(args[2]))
    if prev then
      if prev[1] == 1 then  -- the room is today's
        local spent = tonum(call('HGET', keys[2], 'spent') or '0')
        return {1, day_limit(rec, args[4], tonum(args[2])) - spent}
      end
      return prev
    end
  end
  return budget({keys[1], keys[2]}, {args[1], args[2], args[3], 'take', args[4], args[5]})
end

--[[ settle: KEYS day(1), …, day(m); ARGV ref, final, amount(1), …, amount(m)
Sets what `ref` holds on each day to the given amounts (0: give everything back), adjusting
`spent` by the difference. Idempotent. `final` = 1 (everything given back: a cancel, a
released sale) leaves "X", so that a late settle of the same ref (a duplicate request's,
delayed) can never charge it again. Returns the total given back. ]]
local function settle(keys, args)
  local ref, final = args[1], args[2] == '1'
  local given = 0
  for i = 1, #keys do
    local prev = call('HGET', keys[i], ref)
    local kind = prev and sub(prev, 1, 1)
    if prev and kind ~= 'R' and kind ~= 'X' then
      local diff = tonum(args[2 + i]) - tonum(prev)
      if diff ~= 0 then
        call('HINCRBY', keys[i], 'spent', diff)
        given = given - diff
      end
      call('HSET', keys[i], ref, final and 'X' or args[2 + i])
    end
  end
  return given
end

--[[ set_limit: KEYS limit, today's budget; ARGV value ("none": remove), today, tomorrow,
expire_at, at
Lowering takes effect at once; raising or removing from tomorrow. The record keeps the
instant it was set: `at` (the caller's, for which it planned `today`), or just after the
instant of the change before if that is not earlier, so that one player's changes have
instants in the order Redis made them, whichever processes made them (a journal's restore
never puts an older state over a newer one). Returns {limit in force today or "none",
pending value or "", pending from or "", spent today, the instant}, which the caller
journals. ]]
local function set_limit(keys, args)
  local rec = call('HMGET', keys[1], 'limit', 'next', 'from', 'at')
  local at = max(tonum(args[5]), tonum(rec[4] or '-1') + 1)
  local today, tomorrow = args[2], args[3]
  local current = self_limit(rec, today)
  local wanted = args[1]
  if wanted ~= 'none' and (current == nil or tonum(wanted) <= current) then
    call('DEL', keys[1])
    call('HSET', keys[1], 'limit', wanted)
  else
    call('DEL', keys[1])
    if current then
      call('HSET', keys[1], 'limit', current)
    end
    if wanted ~= 'none' or current then
      call('HSET', keys[1], 'next', wanted, 'from', tomorrow)
    end
  end
  call('HSET', keys[1], 'at', format('%d', at))
  call('PEXPIREAT', keys[1], tonum(args[4]))
  local after = call('HMGET', keys[1], 'limit', 'next', 'from')
  local in_force = self_limit(after, today)
  return {in_force and tostring(in_force) or 'none', after[2] or '', after[3] or '',
          tonum(call('HGET', keys[2], 'spent') or '0'), at}
end

--[[ player: KEYS limit, today's budget; ARGV today
Returns {self-limit in force today or "none", pending value or "", from or "", spent}. ]]
local function player(keys, args)
  local rec = call('HMGET', keys[1], 'limit', 'next', 'from')
  local in_force = self_limit(rec, args[1])
  local pending, from = '', ''
  if rec[3] and args[1] < rec[3] then
    pending, from = rec[2], rec[3]
  end
  return {in_force and tostring(in_force) or 'none', pending, from,
          tonum(call('HGET', keys[2], 'spent') or '0')}
end

--[[ A sale's player budget in its one call (see `sell`): KEYS (the sale's last) the player's
limit, then each day's budget; ARGV from `i`: m (the days), the ref's prefix (the sale id
completes it), regulatory, until, from and to (ms: the purchase day the caller planned for;
a sale judged at another instant answers {'day'} and is planned again), Joker+'s cost a
draw, m × (day, draws on that day), then each grid's cost a draw. What a sale takes is
what the ledger's steps leave (`budget`, then `settle`): under the ref, on each day, the
accepted grids' cost (and Joker+'s, when one is), or "X" when none is; "R<room>" on the first
day for a ticket refused by the limit. `last`: the index of the sale's last key. ]]
local function budget_of(keys, last, args, i, grids, sid)
  local m = tonum(args[i])
  local B = {ref = args[i + 1] .. sid, regulatory = tonum(args[i + 2]),
             expire_at = tonum(args[i + 3]), from = tonum(args[i + 4]),
             to = tonum(args[i + 5]), joker = tonum(args[i + 6]),
             limit_key = keys[last - m], days = {}, names = {}, draws = {}, costs = {}}
  for d = 1, m do
    B.days[d] = keys[last - m + d]
    B.names[d] = args[i + 5 + 2 * d]
    B.draws[d] = tonum(args[i + 6 + 2 * d])
  end
  local requested = B.joker
  for g = 1, grids do
    B.costs[g] = tonum(args[i + 6 + 2 * m + g])
    requested = requested + B.costs[g]
  end
  B.requested = requested
  return B
end

-- The room on the first day that cannot take `per_draw` a draw, or nil when every day can.
local function budget_room(B, per_draw)
  local rec = call('HMGET', B.limit_key, 'limit', 'next', 'from')
  for d = 1, #B.days do
    local room = day_room(rec, B.days[d], B.names[d], B.regulatory)
    if B.draws[d] * per_draw > room then
      return room
    end
  end
  return nil
end

-- Charge each day what the accepted grids cost (`per_draw`, a draw; nothing accepted: "X").
local function budget_charge(B, per_draw, took, seen)
  for d = 1, #B.days do
    if took then
      charge_day(B.days[d], B.ref, B.draws[d] * per_draw, B.expire_at, seen)
    else
      call('HSET', B.days[d], B.ref, 'X')
      extend(B.days[d], B.expire_at, 0, seen)
    end
  end
end

--[[ sell: a batch of sales, each judged as if it were a call of its own, in order.

ARGV[1] the number of shapes (what the sales of one game on the same draws share), then
for each shape the number of its KEYS and of its ARGV; then the number of sales, then their
frames, one string: for each sale (struct '>HHHHd', 16 bytes) the number of its KEYS and
of its ARGV, its number of grids, its shape (1-based) and its tag (2 × its group + 1 when
its first draw was not asked: a group is one request's sales, 0 none); then each shape's
KEYS (in KEYS) and ARGV (in ARGV), then each sale's, in the same order; then the keys of
the unjournaled sales and of the halted groups (see THE KEYS), and in ARGV "1" when the
call carries sales of a request an earlier call carried too (else ""), this call's field
in the unjournaled sales (any string no other call uses) and its value's list (MessagePack:
the record bucket, field and sale id of each of its sales). One Redis TIME, one mark, one
expiry read per key, one read of a shape's admin stops and one entry of the unjournaled
sales serve the whole batch (a batch is judged at one instant): the call's instant and the
list, written when the call made a sale, which the caller deletes once their decisions are
journaled (else the janitor journals those made: a sale not made, a replay, has no record
of its sale id). A sale whose first draw was not asked and is closed or stopped moves on to
the next draw, which its caller sells alone: the later sales of its group are not judged
here nor in the calls after it ({'later'}: the group is noted in the halted groups), so
that the caller judges them after it, in order, as a new group. Returns the call's
instant, then one reply per sale, in order.

A shape: KEYS the game's stops, its feed stream, the sold-out list of each draw (1..n),
then with "fix" the cap key of each draw (see CAPS: fixed by the first sale that stands);
ARGV close_ms, expire_at (the tickets'), stale_after_ms, first_draw, n, the configured cap
(and shadow cap, see CAPS), min_stake, the game's time zone (kept with the results: the
receipt's time is rendered in the zone of the sale, whatever the configuration says
later), "fix" when the caller does not know the draws' caps (the reply then gives the caps
the sale was judged by), then expire_at of each draw.

A sale: KEYS its ticket's bucket, the buckets (draw 1..n) of each capped grid, the
aggregate of each draw (see AGGREGATES) when a grid is not capped, then for a game with
player limits the player's keys (`budget_of`); ARGV its field in the bucket, its sale id
and sale as its record packs them (MessagePack: the id's 8 bytes, then the sale: the
caller's nonce is the sale id, nothing else is needed to keep it new; its bytes key the
grids' records), then combo ("\0<picks>" if not capped) and stake of each grid, then for a
game with player limits its budget's (`budget_of`).

The whole sale in one atomic call, on a standalone Redis (whose keys are all on one node):
the claim's answers for a known ticket id, else the close and the admin stops (nothing is
written if a draw is stopped), then the player's limit (the whole ticket refused, `res`
"<time zone>|P", when its requested cost does not fit a day), then every capped grid is
counted as `reserve` counts it, the combinations it brought to their cap go on the sold-out
lists, and the ticket is written decided, its decision kept as the grids' results (`res`:
"<time zone>|" then "-" not capped, "1" accepted, "0:<offset>:<room>" rejected, joined by
";"; the body is a function of them, the sale, sid and at). No pending state; the sale is
in its call's entry of the unjournaled sales until the caller has journaled its decision.
Each reply is res (a sale made, at the call's instant, with the caller's sale id, judged
by its shape's caps as sent: no counter reached 80 % of its cap or its cap, the shadow cap
refused nothing, and the caps were known)
| {'new', res, near, sold, shadowed (grids the shadow cap would refuse), caps or false}
(caps: the draws' caps it was judged by, fixed or found fixed by it when it was to fix
them; false when it was judged by no cap, refused by the player's limit before any grid was
judged)
| {'final', body or false, at, sid, sale, res or false, st, cancelled at or false,
  released or false}
| {'pending', at, sid, sale} | {'stale', sale} | {'closed'} | {'stopped', offset}
| {'day', at} (judged on another day than its budget was planned for: nothing written; the
later sales of its group are not judged either). The player's budget is charged what the
accepted grids cost once they are judged. ]]
-- A shape of `sell`: what the sales of one game on the same draws share (see `sell`),
-- from KEYS after `k` and ARGV after `a`.
local function shape_of(keys, k, args, a)
  local n = num(args[a + 5])
  local caps, shadow = caps_of(args[a + 6], n)
  local S = {close = num(args[a + 1]), expire_at = num(args[a + 2]),
             stale = num(args[a + 3]), first = num(args[a + 4]), n = n,
             caps = caps, shadow = shadow, min_stake = num(args[a + 7]),
             zone = args[a + 8] .. '|', fix = args[a + 9] == 'fix', stops_key = keys[k + 1],
             feed = keys[k + 2], expiries = {}, lists = {}, cap_keys = {}}
  S.head = mpack(S.expire_at, 'f')  -- a decided record's first two values
  S.tails = {}  -- results -> a decided record's last values, packed (see `decided`)
  S.expire_text = args[a + 2]  -- as `bucket_lives` compares it: the caller's decimal text
  for i = 1, n do
    S.expiries[i] = num(args[a + 9 + i])
    S.lists[i] = keys[k + 2 + i]
    if S.fix then
      S.cap_keys[i] = keys[k + 2 + n + i]
    end
  end
  return S
end

-- A sale of `sell` decided (`results`): its ticket written (in its bucket, kept to the
-- shape's expiry: `known`, the bucket's "!" read with the record), and kept in the call's
-- entry of the unjournaled sales until the caller has journaled the decision (else the
-- janitor journals it). The record is packed as `ticket_new` packs it, from the pieces
-- the call and the caller packed once.
local function decided(S, bucket, field, known, packed, results, batch)
  local tail = S.tails[results]  -- the same few results a shape: packed once
  if not tail then
    tail = '\192' .. mpack(results) .. '\192\192'
    S.tails[results] = tail
  end
  call('HSET', bucket, field, S.head .. batch.at .. packed .. tail)
  bucket_lives(bucket, S.expire_at, S.expire_text, known)
  batch.made = true
end

-- One sale of `sell`: its KEYS after `k` (`nk` of them) and ARGV after `a` (`na`), its
-- `grids`, on shape `S`.
local function sell_one(keys, k, nk, args, a, na, grids, S, now, batch)
  local bucket, field = keys[k + 1], args[a + 1]
  local found = call('HMGET', bucket, field, '!')
  if live(found[1], now) then
    return known_ticket(ticket_decode(found[1]), now, S.stale)
  end
  if now >= S.close then
    return {'closed'}
  end
  local first, n = S.first, S.n
  local stops = S.stops
  if not stops then
    local draws = {}
    for i = 1, n do
      draws[i] = first + i - 1
    end
    stops = call('HMGET', S.stops_key, unpack(draws))
    S.stops = stops
  end
  for i = 1, n do
    if stops[i] then
      return {'stopped', i - 1}
    end
  end
  local packed = args[a + 2]
  local sid_bytes = sub(packed, 2, 9)
  local B = na > 2 + 2 * grids and budget_of(keys, k + nk, args, a + 3 + 2 * grids, grids,
                                             sid_hex(sid_bytes))
  if B then
    if now < B.from or now >= B.to then
      return {'day', now}
    end
    local room = budget_room(B, B.requested)
    if room then  -- the whole ticket refused, nothing counted (see PLAYER LIMITS)
      call('HSET', B.days[1], B.ref, 'R' .. room)
      extend(B.days[1], B.expire_at, 0, batch.seen)
      local results = S.zone .. 'P'
      decided(S, bucket, field, found[2], packed, results, batch)
      return {'new', results, 0, 0, 0, false}  -- judged by no cap: none fixed, none given
    end
  end
  local caps, expiries = S.caps, S.expiries
  local capped = false
  for g = 1, grids do
    if byte(args[a + 1 + 2 * g], 1) ~= 0 then
      capped = true
      break
    end
  end
  local fixing = S.fix and capped
  if fixing then
    -- Capped grids, and nothing refused the sale: its draws' caps are fixed by it if no
    -- sale fixed them before (see CAPS); a draw is judged by its own.
    for i = 1, n do
      local cap = call('SET', S.cap_keys[i], caps[i], 'NX', 'GET', 'PXAT', expiries[i])
      if cap then
        caps[i] = tonum(cap)
      end
    end
  end
  local res = grids > 1 and {}  -- the grids' results (one grid: `result`)
  local result, near, sold, shadowed = nil, 0, 0, 0
  local accepted  -- picks -> base stake of the grids not capped (always accepted)
  local charged, took = 0, false  -- a draw's cost of the accepted grids; whether any is
  local kb = k + 1  -- before the next capped grid's buckets
  for g = 1, grids do
    local combo, stake = args[a + 1 + 2 * g], args[a + 2 + 2 * g]
    if byte(combo, 1) == 0 then  -- not capped: "\0<picks>" (a combo has no zero byte)
      result = '-'
      took = true
      if B then
        charged = charged + B.costs[g]
      end
      local picks = tonum(sub(combo, 2))
      accepted = accepted or {}
      accepted[picks] = (accepted[picks] or 0) + tonum(stake)
    else
      -- No record can exist for a sale claimed in this call, and the close was checked:
      -- straight to counting (the stake as sent: a number only where a sum needs it).
      local status, x, y = count(keys, kb, n, '\0' .. sid_bytes .. char(g - 1), combo,
                                 stake, caps, S.min_stake, expiries, S.shadow, batch.seen)
      kb = kb + n
      if status >= 1 then
        result = '1'
        took = true
        if B then
          charged = charged + B.costs[g]
        end
        near = near + x
        if status == 2 then
          shadowed = shadowed + 1
        end
        for _, offset in ipairs(y or NONE) do
          sold_out_add({S.lists[offset + 1], S.feed}, {combo, expiries[offset + 1],
                                                      first + offset})
          sold = sold + 1
        end
      else
        result = '0:' .. x .. ':' .. y
      end
    end
    if res then
      res[g] = result
    end
  end
  if B then  -- Joker+ costs the player only with a grid accepted
    budget_charge(B, charged + B.joker, took, batch.seen)
  end
  local results = S.zone .. (res and concat(res, ';') or result)
  decided(S, bucket, field, found[2], packed, results, batch)
  -- The capped sizes' stakes are in the counters; the others' add up here (see
  -- AGGREGATES), in the draws' aggregates that follow the buckets.
  if accepted then
    for i = 1, n do
      local key = keys[kb + i]
      for picks, amount in pairs(accepted) do
        call('HINCRBY', key, picks, amount)
      end
      extend(key, expiries[i], 0, batch.seen)
    end
  end
  if near == 0 and sold == 0 and shadowed == 0 and not fixing then
    return results
  end
  return {'new', results, near, sold, shadowed, concat(caps, ',')}
end


local HALTS_TTL_MS = 10000

local function sell(keys, args)
  local now = now_ms()
  local batch = {seen = {}, made = false, at = mpack(now)}
  local halts = keys[#keys]
  local halted = {}
  if args[#args - 2] == '1' then  -- sales of requests an earlier call carried too
    for _, group in ipairs(call('HKEYS', halts)) do
      halted[tonum(group)] = true
    end
  end
  local count_shapes = num(args[1])
  local f = 2 + 2 * count_shapes  -- ARGV[f]: the number of sales, ARGV[f + 1] their frames
  local sales, frames = num(args[f]), args[f + 1]
  local k, a = 0, f + 1  -- before the next shape's (then sale's) first key and arg
  local shapes = {}
  for s = 1, count_shapes do
    shapes[s] = shape_of(keys, k, args, a)
    k, a = k + num(args[2 * s]), a + num(args[2 * s + 1])
  end
  local replies = {now}
  local at = 1
  for i = 1, sales do
    local nk, na, grids, shape, tag
    nk, na, grids, shape, tag, at = sunpack('>HHHHd', frames, at)
    local group = floor(tag / 2)
    local reply
    if group > 0 and halted[group] then
      reply = {'later'}
    else
      reply = sell_one(keys, k, nk, args, a, na, grids, shapes[shape], now, batch)
      local kind = type(reply) == 'table' and reply[1]
      if group > 0 and (kind == 'day'
                        or (tag % 2 == 1 and (kind == 'stopped' or kind == 'closed'))) then
        halted[group] = true
        call('HSET', halts, format('%d', group), 1)
        call('PEXPIRE', halts, HALTS_TTL_MS)
      end
    end
    replies[i + 1] = reply
    k, a = k + nk, a + na
  end
  if batch.made then
    call('HSET', keys[#keys - 1], args[#args - 1], '\146' .. batch.at .. args[#args])
  end
  return replies
end

--[[ RESTORE (capsvc/recovery/restore.py). A decision answered and journaled that Redis
lost (a failover, a restart from an older file, a restored backup) is put back. Each
function writes only what is missing, fenced by the sale id, so that restoring twice
changes nothing; nothing is judged against the cap: the decision was answered. ]]

--[[ restore_ticket: KEYS ticket; ARGV sid, at, sale, body, expire_at, cancelled at ("" for
a decision not cancelled), released, results (optional)
The decision is its body, or ("" body) its results (sold in one call). Writes a journaled
decision: when the ticket is unknown, or this sale is still pending (Redis kept the claim,
lost the decision), as decided, or when the journal says it was cancelled, as cancelling
(`k`: the caller releases, then calls `cancelled`). A decided ticket of this sale that the
journal says was cancelled becomes cancelling too. Returns {'written', has res} |
{'cancelling', has res} | {'present'} (decided, nothing to do) | {'cancelled'} (a decision
whose ticket Redis has cancelled since: nothing to do) | {'other'} (the ticket id holds
another sale: nothing written). `has res`: 1 when the decision is kept as results (sold in
one call: its aggregates are by number of picks). ]]
local function restore_ticket(keys, args)
  local T = ticket_of(keys, args)
  local rec = ticket_read(T, now_ms())
  local st = rec[1]
  local cancel = args[6] ~= ''
  if st and rec[3] ~= args[1] then
    return {'other'}
  end
  local has_res = rec[6] and 1 or 0
  if not st or st == 'p' or st == 'x' then
    local body, res = args[4], args[8]
    ticket_new(T, tonum(args[5]), cancel and 'k' or 'f', tonum(args[2]), args[1],
               args[3], body ~= '' and body, res ~= '' and res, cancel and args[6],
               cancel and args[7])
    return {cancel and 'cancelling' or 'written', has_res}
  end
  if cancel and st == 'f' then
    ticket_set(T, 'st', 'k', 'ca', args[6], 'rel', args[7])
    return {'cancelling', has_res}
  end
  if cancel and st == 'k' then
    return {'cancelling', has_res}
  end
  if not cancel and (st == 'k' or st == 'c') then
    return {'cancelled'}
  end
  return {'present'}
end

--[[ restore_grid: KEYS bucket(draw 1), …, bucket(draw n); ARGV record, combo, stake, caps
(see CAPS), min_stake, expire_at(draw 1), …, expire_at(draw n)
A journaled accepted grid whose record Redis lost: its stake counted on every draw, past the
cap if need be (it was sold), and recorded. Nothing when the grid has a record (counted,
refused, or released: a cancel's release is never undone). Returns {1, over, sold-out
offsets…} when counted (`over`: draws whose counter is now above its cap; the offsets: draws
this brought to their cap), {0} when the record was there. ]]
-- Count a journaled grid's stake back on its draws' buckets (`restore_grid`), past the cap
-- if need be, unless the grid has a record: nil then; else the draws now above their cap and
-- the offsets of those this brought to it (nil: none). `seen`: extend()'s of this call.
local function count_back(buckets, field, combo, stake, caps, min_stake, expiries, seen)
  local n = #buckets
  -- The record is the fence; the last draw's counter is read with it and written with it
  -- (one write for both: a write costs Redis more than a read).
  local last = call('HMGET', buckets[n], field, combo)
  if last[1] then
    return nil
  end
  local over, sold = 0, nil
  for i = 1, n do
    local total
    if i < n then
      total = call('HINCRBY', buckets[i], combo, stake)
    else
      total = (tonum(last[2]) or 0) + stake
      call('HSET', buckets[n], field, stake, combo, total)
    end
    extend(buckets[i], tonum(expiries[i]), 0, seen)
    if total > caps[i] then
      over = over + 1
    end
    if caps[i] - total < min_stake and caps[i] - (total - stake) >= min_stake then
      sold = sold or {}
      sold[#sold + 1] = i - 1
    end
  end
  return over, sold
end

local function restore_grid(keys, args)
  local over, sold = count_back(keys, args[1], args[2], tonum(args[3]),
                                caps_of(args[4], #keys), tonum(args[5]),
                                slice(args, 5), {})
  if not over then
    return {0}
  end
  local out = {1, over}
  for _, offset in ipairs(sold or {}) do
    out[#out + 1] = offset
  end
  return out
end

--[[ restore_limit: KEYS limit; ARGV at, limit ("" none), next ("" none), from, expire_at
A player's self-limit as journaled when it was set at `at`, unless Redis holds one set at
that instant or later. Returns 1 when written. ]]
local function restore_limit(keys, args)
  local at = tonum(call('HGET', keys[1], 'at') or '-1')
  if at >= tonum(args[1]) then
    return 0
  end
  call('DEL', keys[1])
  call('HSET', keys[1], 'at', args[1])
  if args[2] ~= '' then
    call('HSET', keys[1], 'limit', args[2])
  end
  if args[3] ~= '' then
    call('HSET', keys[1], 'next', args[3], 'from', args[4])
  end
  call('PEXPIREAT', keys[1], tonum(args[5]))
  return 1
end

--[[ THE BULK RESTORE. A Redis that lost everything takes back a journal of millions of
decisions: hundreds of ops per FCALL (on a cluster, a call per slot: a call touches one
slot), and as few commands per decision as can be (a command costs Redis about a
microsecond, a write more than a read: the new records of a ticket bucket are one HMGET and
one HSET, a grid's record and its last draw's counter one HMGET and one HSET, a key's TTL
is looked at once per call). Each op does what the single function above does, compared and
fenced the same way. The caller never puts two records of one ticket in one call (the next
waits for this one's answer), so the ops of a call need no order among them but the order
of the ops on one key, which the caller keeps (the journal's). Each op takes its keys from
KEYS in turn (KEYS: the ops' keys, one op after another) and its fields from ARGV, after
its letter. ]]

local RESTORED = {written = 'w', present = 'p', other = 'o', cancelled = 'c'}

-- A sale's ticket as `restore_ticket` puts it back (the fields from its packed record):
-- the reply's letter (see restore_tickets).
local function sale_back(bucket, field, exp, record)
  local _, _, at, sid, sale, body, res = munpack(record)
  return RESTORED[restore_ticket({bucket}, {field, sid_hex(sid), at, sale, body or '', exp,
                                            '', 0, res or ''})[1]]
end

-- Record what a sale accepted of the sizes not capped on each of its draws (`aggregate`),
-- or with `give_back`, remove it: `n` aggregates from KEYS[k], values and expiries from
-- ARGV[i] (value, expiry pairs; none to give back). `by_picks`: its decision kept as
-- results, whose stakes add to the totals by number of picks (see AGGREGATES), taking the
-- place of the share its claim wrote if it was `claimed` (sold in steps: the share goes
-- before its decision).
local function aggregates_back(keys, k, n, args, i, sid, give_back, seen, by_picks, claimed)
  for j = 0, n - 1 do
    local key = keys[k + j]
    if give_back or claimed then
      call('HDEL', key, sid)
    end
    if not give_back then
      local value = args[i + 2 * j]
      if by_picks then
        for picks, stake in gmatch(value, '(%d+):(%d+)') do
          call('HINCRBY', key, picks, stake)
        end
      else
        call('HSET', key, sid, value)
      end
      extend(key, tonum(args[i + 2 * j + 1]), 0, seen)
    end
  end
end

--[[ restore_tickets: KEYS and ARGV of ops on ticket records (one slot on a cluster):
  s  a sale: KEYS the record's bucket (see TICKET RECORDS), its aggregates; ARGV field,
     expire_at, record, sid, n aggregates, then value, expire_at of each aggregate
  S  a sale made in one call: as s, its record kept as results, its aggregates by number
     of picks
  c  a cancel: KEYS the bucket, the pending index, its aggregates; ARGV field, expire_at,
     record, sid, n aggregates
  v  a void: KEYS the bucket, its aggregates; ARGV field, sid, n aggregates
`record` is the ticket record as ticket_new packs it: expire_at, st, at, sid, sale, body,
res, ca, rel (st f for a sale; k with ca and rel for a cancel).
A sale is `restore_ticket`'s: a ticket unknown (or of this sale and pending) is written
decided; the aggregates of its grids not capped are written with it (only then: an S
sale's totals by number of picks have no fence of their own). A cancel: a ticket of
this sale (or unknown) not cancelled yet is indexed and written cancelling (the caller
releases, then calls `cancelled`), and its aggregates are given back. A void: a ticket
unknown or this sale's claim (pending, expired) gives its aggregates back (the caller
releases, then unclaims). Returns one letter per op, in order:
  s  w written, p present (decided), o another sale holds the ticket id, c cancelled since
  c  k cancelling (K: decided in one call: its aggregates are by number of picks), c
     cancelled already, n another sale holds the ticket id
  v  g unknown, u this sale's claim, n decided or another sale's: nothing to give back ]]
local function restore_tickets(keys, args)
  local now = now_ms()
  local codes, seen = {}, {}
  -- Sales that may go straight into their bucket, by bucket (`order`: the buckets).
  local fresh, order = {}, {}
  local i, k, n = 1, 1, 0
  while i <= #args do
    n = n + 1
    local op, bucket = args[i], keys[k]
    if op == 's' or op == 'S' then
      local aggs = tonum(args[i + 5])
      if tonum(args[i + 2]) > now then
        -- A record that lives: below, with the others of its bucket.
        local group = fresh[bucket]
        if not group then
          group = {}
          fresh[bucket] = group
          order[#order + 1] = bucket
        end
        group[#group + 1] = {n, i, k}
      else
        codes[n] = sale_back(bucket, args[i + 1], tonum(args[i + 2]), args[i + 3])
        if codes[n] == 'w' then
          aggregates_back(keys, k + 1, aggs, args, i + 6, args[i + 4], false, seen, op == 'S',
                          op == 'S')
        end
      end
      k, i = k + 1 + aggs, i + 6 + 2 * aggs
    elseif op == 'c' then
      local aggs, sid = tonum(args[i + 5]), args[i + 4]
      local T = ticket_of({bucket}, {args[i + 1]})
      local st, held = ticket_state(T, now)
      if not st or held == sid then
        if st ~= 'c' then
          local index, exp = keys[k + 1], tonum(args[i + 2])
          call('ZADD', index, 'NX', now, T.name)
          extend(index, exp, 0, seen)
          local _, _, at, _, sale, body, _, ca, rel = munpack(args[i + 3])
          local reply = restore_ticket({bucket}, {args[i + 1], sid, at, sale, body, exp,
                                                  ca, rel})
          codes[n] = reply[2] == 1 and 'K' or 'k'
        else
          codes[n] = 'c'
        end
      else
        codes[n] = 'n'
      end
      aggregates_back(keys, k + 2, aggs, args, i, sid, true, seen)
      k, i = k + 2 + aggs, i + 6
    elseif op == 'v' then
      local aggs, sid = tonum(args[i + 3]), args[i + 2]
      local st, held = ticket_state(ticket_of({bucket}, {args[i + 1]}), now)
      if st and (held ~= sid or (st ~= 'p' and st ~= 'x')) then
        codes[n] = 'n'
      else
        codes[n] = st and 'u' or 'g'
        aggregates_back(keys, k + 1, aggs, args, i, sid, true, seen)
      end
      k, i = k + 1 + aggs, i + 4
    else
      return redis.error_reply('restore_tickets: unknown op ' .. tostring(op))
    end
  end
  for _, bucket in ipairs(order) do
    local group = fresh[bucket]
    -- The bucket's records of these tickets: one HSETNX for one, else one HMGET and one HSET
    -- for all (a write costs Redis more than a read, and a command more than a field).
    local held = {false}
    if #group > 1 then
      local fields = {}
      for j, sale in ipairs(group) do
        fields[j] = args[sale[2] + 1]
      end
      held = call('HMGET', bucket, unpack(fields))
    end
    local new, latest = {}, 0
    for j, sale in ipairs(group) do
      local at, kk = sale[2], sale[3]
      local field, record = args[at + 1], args[at + 3]
      local exp = tonum(args[at + 2])
      local code, claimed
      if held[j] or (#group == 1 and call('HSETNX', bucket, field, record) == 0) then
        -- A record of the ticket, live or not: compared as restore_ticket compares it.
        code, claimed = sale_back(bucket, field, exp, record), true
      else
        code = 'w'
        if #group > 1 then
          new[#new + 1] = field
          new[#new + 1] = record
        end
        latest = max(latest, exp)
      end
      codes[sale[1]] = code
      if code == 'w' then
        local by_picks = args[at] == 'S'
        aggregates_back(keys, kk + 1, tonum(args[at + 5]), args, at + 6, args[at + 4],
                        false, seen, by_picks, by_picks and claimed)
      end
    end
    if #new > 0 then
      call('HSET', bucket, unpack(new))
    end
    if latest > 0 then
      extend(bucket, latest, BUCKET_SLACK_MS, seen)
    end
  end
  return concat(codes)
end

--[[ restore_counts: KEYS and ARGV of ops on counter buckets (one slot on a cluster):
  g  an accepted grid: KEYS its buckets (draw 1..n); ARGV n, record, combo, stake, caps
     (see CAPS), min_stake, expire_at of each draw: `restore_grid`
  r  a grid given back: KEYS its buckets; ARGV n, record, combo, caps, min_stake,
     expire_at (draw n): `release`
Returns {letters, details}: one letter per op, in order: g 1 counted, 0 recorded already
(nothing done), x counted and past the cap or to it; r 0 nothing given back, x given back.
Details, for each x in turn: g's draws now above the cap, then how many offsets follow, the
offsets of the draws it brought to the cap; r's stake given back, how many offsets follow,
the offsets of the draws that left the cap. ]]
local function restore_counts(keys, args)
  local codes, details, seen = {}, {}, {}
  local i, k = 1, 1
  while i <= #args do
    local op, n = args[i], tonum(args[i + 1])
    local buckets = {}
    for j = 1, n do
      buckets[j] = keys[k + j - 1]
    end
    local found, offsets
    if op == 'g' then
      local over, sold = count_back(buckets, args[i + 2], args[i + 3], tonum(args[i + 4]),
                                    caps_of(args[i + 5], n), tonum(args[i + 6]),
                                    {unpack(args, i + 7, i + 6 + n)}, seen)
      if not over then
        found = '0'
      elseif over == 0 and not sold then
        found = '1'
      else
        found, offsets = 'x', sold or {}
        details[#details + 1] = over
      end
      i = i + 7 + n
    elseif op == 'r' then
      local out = release(buckets, {args[i + 2], args[i + 3], args[i + 4], args[i + 5],
                                    args[i + 6]})
      if out[1] == 0 then
        found = '0'
      else
        found, offsets = 'x', slice(out, 1)
        details[#details + 1] = out[1]
      end
      i = i + 7
    else
      return redis.error_reply('restore_counts: unknown op ' .. tostring(op))
    end
    codes[#codes + 1] = found
    if offsets then
      details[#details + 1] = #offsets
      for _, o in ipairs(offsets) do
        details[#details + 1] = o
      end
    end
    k = k + n
  end
  return {concat(codes), details}
end

--[[ restore_budgets: KEYS and ARGV of ops on player budgets (one slot on a cluster):
  b  KEYS the player's self-limit, the budget of each of m days; ARGV m, ref, regulatory,
     expire_at, take, settle, then the m days, the m amounts taken, the m amounts settled
`take` 1: the amounts are taken unchecked unless `ref` is recorded (`budget`, mode
"restore"); s (a cancel, a void: everything given back): `ref` sealed first when it took
nothing yet (`budget`, mode "seal"), so that the sale's take, put back later (another
process's journal, restored after), charges nothing; 0 neither. `settle` "" nothing, 0 or
1 (final): `settle` to the amounts settled, after.
Returns, per op in order, whether the take put the amounts back (`budget`'s {1, 0}) and
what the settle gave back. ]]
local function restore_budgets(keys, args)
  local out = {}
  local i, k = 1, 1
  while i <= #args do
    local m = tonum(args[i + 1])
    local ref = args[i + 2]
    local days = {}
    for j = 1, m do
      days[j] = keys[k + j]
    end
    local taken, given = 0, 0
    if args[i + 5] == '1' then
      local reply = budget({keys[k], unpack(days)},
                           {ref, args[i + 3], args[i + 4], 'restore',
                            unpack(args, i + 7, i + 6 + 2 * m)})
      taken = reply[3] or 0
    elseif args[i + 5] == 's' then
      budget({keys[k], unpack(days)}, {ref, args[i + 3], args[i + 4], 'seal',
                                       unpack(args, i + 7, i + 6 + 2 * m)})
    end
    if args[i + 6] ~= '' then
      given = settle(days, {ref, args[i + 6], unpack(args, i + 7 + 2 * m, i + 6 + 3 * m)})
    end
    out[#out + 1] = taken
    out[#out + 1] = given
    k, i = k + 1 + m, i + 7 + 3 * m
  end
  return out
end

-- A marked function: its node's count sits in another slot of the node (see MARKS).
-- A bulk restore function whose calls count themselves, as a restore's marked calls do: the
-- mark of the call's slot as its last key, the restore's counter ("%<token>", or "" for a
-- tool's restore, not counted) as its last ARGV.
local function counted(fn)
  return function(keys, args)
    local mark = remove(keys)
    local counter = remove(args)
    local reply = fn(keys, args)
    if counter ~= '' then
      call('HINCRBY', mark, counter, 1)
    end
    return reply
  end
end

-- Every function binds the library's locals first (see `bind`).
local function register(name, fn, flags)
  redis.register_function{function_name = name, flags = flags, callback = function(keys, args)
    if not call then
      bind()
    end
    return fn(keys, args)
  end}
end

local CROSS_SLOT = {'allow-cross-slot-keys'}
local READ_ONLY = {'no-writes'}

local function register_marked(name, fn)
  MARKED[name] = fn
end

register_marked('capsvc_claim', claim)
register_marked('capsvc_ticket', ticket)
register('capsvc_sweep', sweep)
register_marked('capsvc_finalize', finalize)
register_marked('capsvc_unclaim', unclaim)
register('capsvc_journaled_many', journaled_many, CROSS_SLOT)
register_marked('capsvc_expire', expire)
register_marked('capsvc_cancel', cancel)
register_marked('capsvc_cancelled', cancelled)
register_marked('capsvc_reserve', reserve)
register_marked('capsvc_release', release)
register_marked('capsvc_stop', stop)
register('capsvc_sold_out', sold_out_add)
register('capsvc_feed_event', feed_event)
register('capsvc_feed_closed', feed_closed)
register('capsvc_exposure', exposure, READ_ONLY)
register('capsvc_aggregate', aggregate)
register('capsvc_aggregate_sum', aggregate_sum, READ_ONLY)
register_marked('capsvc_budget', budget)
register_marked('capsvc_stake', stake)
register_marked('capsvc_settle', settle)
register_marked('capsvc_set_limit', set_limit)
register_marked('capsvc_player', player)
register_marked('capsvc_sell', sell)
register('capsvc_calls', calls, CROSS_SLOT)
register('capsvc_restore_ticket', restore_ticket)
register('capsvc_restore_grid', restore_grid)
register('capsvc_restore_limit', restore_limit)
register('capsvc_marks_of', marks_of, {'no-writes', 'allow-cross-slot-keys'})
register('capsvc_mark_restored', mark_restored)
register('capsvc_announce', announce)
register('capsvc_announce_end', announce_end)
register('capsvc_mark_keep', mark_keep)
register('capsvc_restore_tickets', counted(restore_tickets))
register('capsvc_restore_counts', counted(restore_counts))
register('capsvc_restore_budgets', counted(restore_budgets))
