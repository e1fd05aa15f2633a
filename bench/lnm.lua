-- wrk script: new LNM tickets (unique ticket_id, a game with player limits) of one capped
-- grid each (8-10 numbers, an allowed stake, one draw), each for one of 100,000 players:
-- bench/one_grid.lua's requests with common.lua's lnm_ticket. Seeded.
-- Usage: wrk -s lnm.lua <url> -- <token> <id-prefix> <seed> [<mean pause ms>]

local here = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
dofile(here .. "one_grid.lua")
ticket_of = lnm_ticket
