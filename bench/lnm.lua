-- wrk script: new LNM tickets (unique ticket_id, a game with player limits) of one capped
-- grid each (8-10 numbers, an allowed stake, one draw), each for one of 100,000 players.
-- Seeded: every run sends the same sequence.
-- Usage: wrk -s lnm.lua <url> -- <token> <id-prefix> <seed> [<mean pause ms>]

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
  }, lnm_ticket(prefix .. "-" .. counter))
end
