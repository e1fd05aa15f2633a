-- What bench/tickets.lua, bench/one_grid.lua and bench/batch.lua share (loaded by both with dofile):
-- pacing (args[4]: the mean ms a connection waits after an answer) and the percentiles
-- line that bench/run.py reads.

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
