"""Every use-case of the service, wired over one store and the Redis clock.

What the HTTP layer and the janitor loop are given; knows which use-case needs which
collaborator, nothing of HTTP or of Redis keys.
"""

from __future__ import annotations

from dataclasses import dataclass

from capsvc.audit.service import Audit
from capsvc.config import Settings
from capsvc.domain.games import Catalog
from capsvc.journal.recorder import Recorder
from capsvc.journal.writer import Journal
from capsvc.redis.clock import RedisClock
from capsvc.redis.store import Store
from capsvc.service.availability import Availability
from capsvc.service.caps import DrawCaps
from capsvc.service.draws import Draws
from capsvc.service.exposure import Exposure
from capsvc.service.feed import Feed
from capsvc.service.janitor import Janitor
from capsvc.service.players import Players
from capsvc.service.steps import SaleSteps
from capsvc.service.tickets import Tickets


@dataclass(frozen=True, slots=True)
class UseCases:
    catalog: Catalog
    clock: RedisClock
    draws: Draws
    tickets: Tickets
    availability: Availability
    players: Players
    janitor: Janitor
    feed: Feed
    exposure: Exposure
    journal: Recorder
    audit: Audit


def build_usecases(settings: Settings, store: Store, clock: RedisClock | None = None,
                   journal: Journal | None = None) -> UseCases:
    """The use-cases over `store`; the clock reads Redis TIME through the same store.
    `journal`: where answered decisions are journaled (None: not journaled)."""
    clock = clock or RedisClock(store.time_ms)
    recorder = Recorder(journal, clock.now)
    catalog = Catalog(settings.games)
    caps = DrawCaps(store, recorder.cap)
    draws = Draws(store, clock, caps, recorder)
    steps = SaleSteps(store, caps, recorder)
    tickets = Tickets(settings, catalog, draws, store, steps, clock, recorder)
    availability = Availability(store, draws)
    exposure = Exposure(store, caps, clock)
    return UseCases(
        catalog=catalog, clock=clock, draws=draws, tickets=tickets,
        availability=availability,
        players=Players(catalog, steps.players, clock, recorder),
        janitor=Janitor(settings, catalog, store, steps, tickets, clock),
        feed=Feed(store, clock, draws, availability),
        exposure=exposure,
        journal=recorder,
        audit=Audit(settings, catalog, store, clock, exposure, tickets, recorder),
    )
