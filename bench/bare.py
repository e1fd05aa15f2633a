"""The ceiling: an aiohttp + msgspec handler that decodes a ticket and answers a decision of
the same shape as capsvc's, with no Redis work at all. Run: python bench/bare.py PORT"""

from __future__ import annotations

import sys

import msgspec
import uvloop
from aiohttp import web

from capsvc.client.models import GridOut, Receipt, TicketIn, TicketOut

_decode = msgspec.json.Decoder(TicketIn).decode
_encode = msgspec.json.encode


async def post_ticket(request: web.Request) -> web.Response:
    t = _decode(await request.read())
    out = TicketOut(
        ticket_id=t.ticket_id, game=t.game, status="accepted", draws=[1],
        grids=[GridOut(index=i, numbers=sorted(g.numbers), status="accepted", cost=g.stake)
               for i, g in enumerate(t.grids)],
        total_cost=sum(g.stake for g in t.grids),
        receipt=Receipt(receipt_id="r", issued_at="2026-11-30T00:00:00+01:00"),
    )
    return web.Response(body=_encode(out), content_type="application/json")


def main() -> None:
    app = web.Application()
    app.router.add_post("/v1/tickets", post_ticket)
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None,
                print=None, loop=uvloop.new_event_loop())


if __name__ == "__main__":
    main()
