-- wrk script: new FDJ tickets (unique ticket_id) of one capped grid each (8-10 numbers, an
-- allowed stake, one draw): every sale is claim + reserve + decision, nothing else.
-- Seeded: every run sends the same sequence.
-- Usage: wrk -s one_grid.lua <url> -- <token> <id-prefix> <seed> [<mean pause ms>]

dofile((debug.getinfo(1, "S").source:match("^@(.*/)") or "./") .. "common.lua")

local token, prefix, counter = "bench", "B", 0

function init(args)
  token = args[1] or token
  prefix = args[2] or prefix
  math.randomseed(tonumber(args[3] or "42"))
  set_pause(args)
end

function request()
  counter = counter + 1
  return wrk.format("POST", "/v1/tickets", {
    ["Authorization"] = "Bearer " .. token,
    ["Content-Type"] = "application/json",
  }, (ticket_of or one_grid_ticket)(prefix .. "-" .. counter))
end
