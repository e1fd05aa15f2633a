-- wrk script: POST /v1/ticket-batches of N new FDJ tickets (unique ticket_id) of one capped
-- grid each (8-10 numbers, an allowed stake, one draw). Seeded.
-- Usage: wrk -s batch.lua <url> -- <token> <id-prefix> <seed> <mean pause ms> <N>

dofile((debug.getinfo(1, "S").source:match("^@(.*/)") or "./") .. "common.lua")

local token, prefix, counter, size = "bench", "B", 0, 64
local stakes = {100, 200, 300, 500, 1000}

function init(args)
  token = args[1] or token
  prefix = args[2] or prefix
  math.randomseed(tonumber(args[3] or "42"))
  set_pause(args)
  size = tonumber(args[5] or "64")
end

function request()
  local tickets = {}
  for i = 1, size do
    counter = counter + 1
    tickets[i] = string.format(
      '{"ticket_id":"%s-%d","game":"fdj-keno","grids":[{"numbers":[%s],"stake":%d}]}',
      prefix, counter, numbers(math.random(8, 10)), stakes[math.random(1, #stakes)])
  end
  return wrk.format("POST", "/v1/ticket-batches", {
    ["Authorization"] = "Bearer " .. token,
    ["Content-Type"] = "application/json",
  }, '{"tickets":[' .. table.concat(tickets, ",") .. ']}')
end
