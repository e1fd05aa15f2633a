-- wrk script: realistic new FDJ tickets (unique ticket_id): 1-5 grids of 2-10 numbers with
-- allowed stakes, some subscriptions (2, 5 or 10 draws), and a hot set of 20 popular
-- combinations of 8-10 numbers (a fifth of the grids) that reach their cap during a run.
-- Seeded: every run sends the same sequence.
-- Usage: wrk -s tickets.lua <url> -- <token> <id-prefix> <seed> [<mean pause ms>]

dofile((debug.getinfo(1, "S").source:match("^@(.*/)") or "./") .. "common.lua")

local token, prefix, counter = "bench", "B", 0
local stakes = {100, 200, 300, 500, 1000}
local hot = {}

function init(args)
  token = args[1] or token
  prefix = args[2] or prefix
  math.randomseed(tonumber(args[3] or "42"))
  set_pause(args)
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
