-- What bench/tickets.lua, bench/one_grid.lua and bench/batch.lua share (loaded with dofile):
-- the tickets they send, pacing (args[4]: the mean ms a connection waits after an answer)
-- and the percentiles line that bench/run.py reads.

pause = 0

-- `picks` distinct numbers of 1..70, comma-separated (a grid's, in JSON).
function numbers(picks)
  local chosen, nums = {}, {}
  while #nums < picks do
    local n = math.random(1, 70)
    if not chosen[n] then
      chosen[n] = true
      nums[#nums + 1] = n
    end
  end
  return table.concat(nums, ",")
end

local stakes = {100, 200, 300, 500, 1000}
local hot = {}

-- The hot set of the mix: 20 popular combinations of 8-10 numbers (call once, seeded).
function choose_hot()
  for i = 1, 20 do
    hot[i] = numbers(math.random(8, 10))
  end
end

-- A new ticket of one capped grid (8-10 numbers, an allowed stake, one draw), in JSON.
function one_grid_ticket(id)
  return string.format(
    '{"ticket_id":"%s","game":"fdj-keno","grids":[{"numbers":[%s],"stake":%d}]}',
    id, numbers(math.random(8, 10)), stakes[math.random(1, #stakes)])
end

local lnm_stakes = {250, 500, 1000, 2500}

-- A new LNM ticket (a game with player limits) of one capped grid, one draw, for one of
-- 100,000 players (each far from the daily limit during a run).
function lnm_ticket(id)
  return string.format(
    '{"ticket_id":"%s","game":"lnm-keno","player_id":"P-%d","grids":[{"numbers":[%s],"stake":%d}]}',
    id, math.random(1, 100000), numbers(math.random(8, 10)),
    lnm_stakes[math.random(1, #lnm_stakes)])
end

local function mix_grid()
  local nums
  if math.random() < 0.2 then
    nums = hot[math.random(1, #hot)]
  else
    nums = numbers(math.random(2, 10))
  end
  return string.format('{"numbers":[%s],"stake":%d}', nums, stakes[math.random(1, #stakes)])
end

-- A new ticket of the realistic mix: 1-5 grids of 2-10 numbers with allowed stakes, a fifth
-- of the grids from the hot set (they reach their cap during a run), some subscriptions
-- (2, 5 or 10 draws).
function mix_ticket(id)
  local grids = {}
  for g = 1, math.random(1, 5) do
    grids[g] = mix_grid()
  end
  local draws = 1
  local r = math.random()
  if r < 0.05 then draws = 10 elseif r < 0.10 then draws = 5 elseif r < 0.15 then draws = 2 end
  return string.format('{"ticket_id":"%s","game":"fdj-keno","draws":%d,"grids":[%s]}',
                       id, draws, table.concat(grids, ","))
end

function set_pause(args)
  pause = tonumber(args[4] or "0")
end

function delay()
  -- Exponentially distributed: the connections do not fall into step, so requests arrive
  -- as from many independent terminals, not in bursts.
  if pause <= 0 then
    return 0
  end
  return -pause * math.log(1 - math.random())
end

function done(summary, latency, requests)
  io.write(string.format("PERCENTILES %.0f %.0f %.0f\n", latency:percentile(50),
                         latency:percentile(95), latency:percentile(99)))
end
