"""The naive design, for comparison: the same sale, with one awaited Redis call after the
other and no coalescing: claim the ticket id (SET NX), then one EVALSHA per capped grid
(check-and-increment on every draw), then write the decision. redis-py's asyncio client.

    python bench/naive.py PORT REDIS_URL
"""

from __future__ import annotations

import sys

import msgspec
import redis.asyncio as redis
import uvloop
from aiohttp import web

from capsvc.client.models import GridOut, Receipt, TicketIn, TicketOut
from capsvc.domain import combination

CHECK_AND_INCREMENT = """
for i = 1, #KEYS do
  if (tonumber(redis.call('GET', KEYS[i]) or '0') + tonumber(ARGV[1])) > tonumber(ARGV[2])
  then return 0 end
end
for i = 1, #KEYS do redis.call('INCRBY', KEYS[i], ARGV[1]) end
return 1
"""
_decode = msgspec.json.Decoder(TicketIn).decode
_encode = msgspec.json.encode


def main() -> None:
    port, url = int(sys.argv[1]), sys.argv[2]
    client = redis.Redis.from_url(url)
    script = client.register_script(CHECK_AND_INCREMENT)

    async def post_ticket(request: web.Request) -> web.Response:
        t = _decode(await request.read())
        first = t.first_draw or 1
        if not await client.set(f"naive:t:{t.ticket_id}", "p", nx=True, ex=86400):
            raise web.HTTPConflict()
        grids = []
        for i, g in enumerate(t.grids):
            numbers = sorted(g.numbers)
            ok = 1
            if len(numbers) >= 8:
                key = combination.encode(numbers)
                ok = await script(keys=[f"naive:c:{{{key}}}:{d}"
                                        for d in range(first, first + t.draws)],
                                  args=[g.stake, 5000])
            grids.append(GridOut(index=i, numbers=numbers,
                                 status="accepted" if ok else "rejected",
                                 cost=g.stake * t.draws if ok else None))
        out = TicketOut(ticket_id=t.ticket_id, game=t.game, status="accepted", draws=[first],
                        grids=grids, total_cost=sum(g.cost or 0 for g in grids),
                        receipt=Receipt(receipt_id="r", issued_at="2026-11-30T00:00:00+01:00"))
        body = _encode(out)
        await client.set(f"naive:t:{t.ticket_id}", body, ex=86400)
        return web.Response(body=body, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/tickets", post_ticket)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None,
                loop=uvloop.new_event_loop())


if __name__ == "__main__":
    main()
