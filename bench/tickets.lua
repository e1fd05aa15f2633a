-- wrk script: every request is a new FDJ ticket (unique ticket_id) of 1-3 grids of 2-10
-- numbers with allowed stakes. Seeded, so every run sends the same sequence of tickets.
-- Usage: wrk -s tickets.lua <url> -- <token> <id-prefix> <seed>

local token, prefix, counter = "bench", "B", 0
local stakes = {100, 200, 300, 500, 1000}

function init(args)
  token = args[1] or token
  prefix = args[2] or prefix
  math.randomseed(tonumber(args[3] or "42"))
end

local function grid()
  local picks = math.random(2, 10)
  local chosen, nums = {}, {}
  while #nums < picks do
    local n = math.random(1, 70)
    if not chosen[n] then
      chosen[n] = true
      nums[#nums + 1] = n
    end
  end
  return string.format('{"numbers":[%s],"stake":%d}', table.concat(nums, ","),
                       stakes[math.random(1, #stakes)])
end

function request()
  counter = counter + 1
  local grids = {}
  for g = 1, math.random(1, 3) do
    grids[g] = grid()
  end
  local body = string.format('{"ticket_id":"%s-%d","game":"fdj-keno","grids":[%s]}',
                             prefix, counter, table.concat(grids, ","))
  return wrk.format("POST", "/v1/tickets", {
    ["Authorization"] = "Bearer " .. token,
    ["Content-Type"] = "application/json",
  }, body)
end
