-- wrk script: POST /v1/ticket-batches of N new FDJ tickets (unique ticket_id), each of one
-- capped grid (8-10 numbers, an allowed stake, one draw), of the realistic mix, or LNM
-- tickets of one grid (see common.lua). Seeded.
-- Usage: wrk -s batch.lua <url> -- <token> <id-prefix> <seed> <mean pause ms> <N> [mix|lnm]

dofile((debug.getinfo(1, "S").source:match("^@(.*/)") or "./") .. "common.lua")

local token, prefix, counter, size, make = "bench", "B", 0, 64, one_grid_ticket

function init(args)
  token = args[1] or token
  prefix = args[2] or prefix
  math.randomseed(tonumber(args[3] or "42"))
  set_pause(args)
  size = tonumber(args[5] or "64")
  if args[6] == "mix" then
    make = mix_ticket
    choose_hot()
  elseif args[6] == "lnm" then
    make = lnm_ticket
  end
end

function request()
  local tickets = {}
  for i = 1, size do
    counter = counter + 1
    tickets[i] = make(prefix .. "-" .. counter)
  end
  return wrk.format("POST", "/v1/ticket-batches", {
    ["Authorization"] = "Bearer " .. token,
    ["Content-Type"] = "application/json",
  }, '{"tickets":[' .. table.concat(tickets, ",") .. ']}')
end
