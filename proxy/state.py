"""The app's typed state: what its handlers read, one per app (``STATE``)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from proxy.config import Config
from proxy.exposition import Expositions
from proxy.ids import IdSource
from proxy.journal import Journal
from proxy.logs import Throttle
from proxy.metrics import Metrics
from proxy.relay import Services
from proxy.settle import Settlement
from proxy.store import Store
from proxy.thread_pools import TenantPool
from proxy.tokenizer import Tokenizer


@dataclass(slots=True)
class State:
    """What handlers read. ``config`` is swapped whole on reload; nothing else mutates."""

    config: Config
    passthrough: bool
    tokenizer: Tokenizer
    metrics: Metrics
    journal: Journal
    ids: IdSource = field(default_factory=IdSource)
    store: Store | None = None
    session: aiohttp.ClientSession | None = None
    # Large prompts are counted here while their calls run, one at a time: off the event loop,
    # and never more than one core spent tokenizing (several at once on few cores only fight over
    # them and the GIL).
    estimator: TenantPool | None = None
    # Bodies whose walks are long are parsed and planned here (``planning.planned``).
    planner: TenantPool | None = None
    # Counts a reserve waits on (``planning.count_now``), and a settle's (``Services``): apart,
    # so that no tenant's prompts, refused after their count at no cost to it, hold a settle.
    reserve_counts: TenantPool | None = None
    settle_counts: TenantPool | None = None
    # /metrics' builds, on their own thread, one shared by the scrapes that come while it runs
    # (both ports': ``handlers.metrics_handler``).
    expositions: Expositions | None = None
    # Tenants this process has registered for the reapers, each until when (ms, the registry's
    # clock): registered again once half of it is gone (``handlers.registered``), dropped once
    # it ran out (``reaper.known_tenants``).
    registered_tenants: dict[str, int] = field(default_factory=dict)
    # Settlements under way (``relay.Exchange.settle``): shutdown lets them finish.
    settling: set[asyncio.Future[Settlement]] = field(default_factory=set)
    # What every exchange is given, made once per config (see ``services_for``).
    services: Services | None = None
    # Serving processes sharing the port: each keeps its own metrics (``handlers.metrics``).
    workers: int = 1
    # Reserves the store failed (unreachable, out of memory) and refused (a script's error), told
    # in the log at once and then every few seconds (``handlers.refused_reserve``).
    reserve_failures: Throttle = field(default_factory=Throttle)
    reserve_rejections: Throttle = field(default_factory=Throttle)

    def services_for(self, config: Config) -> Services:
        services = self.services
        if services is None or services.config is not config:
            assert self.store is not None and self.session is not None and self.settle_counts is not None
            services = self.services = Services(
                store=self.store,
                session=self.session,
                tokenizer=self.tokenizer,
                config=config,
                metrics=self.metrics,
                journal=self.journal,
                settling=self.settling,
                settle_counts=self.settle_counts,
            )
        return services


STATE = web.AppKey("state", State)
