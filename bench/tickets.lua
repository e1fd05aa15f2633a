-- wrk script: realistic new FDJ tickets (unique ticket_id): 1-5 grids of 2-10 numbers with
-- allowed stakes, some subscriptions (2, 5 or 10 draws), and a hot set of 20 popular
-- combinations of 8-10 numbers (a fifth of the grids) that reach their cap during a run.
-- Seeded: every run sends the same sequence.
-- Usage: wrk -s tickets.lua <url> -- <token> <id-prefix> <seed> [<mean pause ms>]

dofile((debug.getinfo(1, "S").source:match("^@(.*/)") or "./") .. "common.lua")

local token, prefix, counter = "bench", "B", 0

function init(args)
  token = args[1] or token
  prefix = args[2] or prefix
  math.randomseed(tonumber(args[3] or "42"))
  set_pause(args)
  choose_hot()
end

function request()
  counter = counter + 1
  return wrk.format("POST", "/v1/tickets", {
    ["Authorization"] = "Bearer " .. token,
    ["Content-Type"] = "application/json",
  }, mix_ticket(prefix .. "-" .. counter))
end
