-- wrk script: realistic new FDJ tickets (unique ticket_id): 1-5 grids of 2-10 numbers with
-- allowed stakes, some subscriptions (2, 5 or 10 draws), and a hot set of 20 popular
-- combinations of 8-10 numbers (a fifth of the grids) that reach their cap during a run.
-- Seeded: every run sends the same sequence.
-- Usage: wrk -s tickets.lua <url> -- <token> <id-prefix> <seed>

local token, prefix, counter = "bench", "B", 0
local pause = 0  -- mean ms a connection waits after an answer (args[4]): paces the load
local stakes = {100, 200, 300, 500, 1000}
local hot = {}

local function numbers(picks)
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

function init(args)
  token = args[1] or token
  prefix = args[2] or prefix
  math.randomseed(tonumber(args[3] or "42"))
  pause = tonumber(args[4] or "0")
  for i = 1, 20 do
    hot[i] = numbers(math.random(8, 10))
  end
end

local function grid()
  local nums
  if math.random() < 0.2 then
    nums = hot[math.random(1, #hot)]
  else
    nums = numbers(math.random(2, 10))
  end
  return string.format('{"numbers":[%s],"stake":%d}', nums, stakes[math.random(1, #stakes)])
end

function request()
  counter = counter + 1
  local grids = {}
  for g = 1, math.random(1, 5) do
    grids[g] = grid()
  end
  local draws = 1
  local r = math.random()
  if r < 0.05 then draws = 10 elseif r < 0.10 then draws = 5 elseif r < 0.15 then draws = 2 end
  local body = string.format('{"ticket_id":"%s-%d","game":"fdj-keno","draws":%d,"grids":[%s]}',
                             prefix, counter, draws, table.concat(grids, ","))
  return wrk.format("POST", "/v1/tickets", {
    ["Authorization"] = "Bearer " .. token,
    ["Content-Type"] = "application/json",
  }, body)
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
