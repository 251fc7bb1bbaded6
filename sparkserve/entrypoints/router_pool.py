"""The servers behind `sparkserve router`: the prefill and decode servers it was given, which of
them are healthy, and the next pair to use.

A server is healthy while its GET /health answers 200; every interval the pool asks them all at
once. One that fails (or that a request could not reach) is skipped until it passes a check
again, so a dead server costs requests only until the router notices. Pairs are drawn round robin
over the healthy servers of each role, independently: any prefill server can hand a request to any
decode server (the bootstrap address in the request says where from)."""
from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from sparkserve.entrypoints.openai_protocol import ApiError

log = logging.getLogger("sparkserve.router")

DEFAULT_BOOTSTRAP_PORT = 8998       # SGLang's (and sparkserve serve's) --disaggregation-bootstrap-port


@dataclass
class Server:
    url: str                        # base URL, no trailing slash
    role: str                       # "prefill" or "decode"
    bootstrap_port: int | None = None   # prefill: where its bootstrap service listens (None: the
                                        # decode server's own --disaggregation-bootstrap-port)
    healthy: bool = True            # until the first check says otherwise

    @property
    def host(self) -> str:
        """The host a decode server reaches this prefill server's bootstrap service on."""
        return urlsplit(self.url).hostname or ""


def parse_server_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http(s)://HOST:PORT URL")
    return url.rstrip("/")


class ServerPool:
    def __init__(self, prefill: list[tuple[str, int | None]], decode: list[str], interval: float):
        if not prefill or not decode:
            raise ValueError("a PD router needs at least one --prefill and one --decode server")
        if interval <= 0:
            raise ValueError(f"--health-check-interval must be positive, got {interval}")
        self.prefill = [Server(parse_server_url(u), "prefill", port) for u, port in prefill]
        self.decode = [Server(parse_server_url(u), "decode") for u in decode]
        self.interval = interval
        self.client: httpx.AsyncClient | None = None     # the app's, set when it starts
        self._turn = {"prefill": itertools.count(), "decode": itertools.count()}

    @property
    def servers(self) -> list[Server]:
        return self.prefill + self.decode

    def pick(self, role: str) -> Server:
        """The next healthy server of `role` (503 when there is none)."""
        group = self.prefill if role == "prefill" else self.decode
        healthy = [s for s in group if s.healthy]
        if not healthy:
            raise ApiError(503, f"no healthy {role} server ({', '.join(s.url for s in group)} fail "
                                "GET /health); retry later")
        return healthy[next(self._turn[role]) % len(healthy)]

    def pair(self) -> tuple[Server, Server]:
        return self.pick("prefill"), self.pick("decode")

    def mark_down(self, server: Server, why: str) -> None:
        """A request could not reach `server`: skip it until a health check passes."""
        if server.healthy:
            log.warning("%s server %s is down (%s); skipped until GET /health passes", server.role,
                        server.url, why)
        server.healthy = False

    async def check(self) -> None:
        """One health check of every server, at once."""
        await asyncio.gather(*(self._check(s) for s in self.servers))

    async def _check(self, server: Server) -> None:
        try:
            r = await self.client.get(server.url + "/health", timeout=min(5.0, max(self.interval, 0.5)))
            ok, why = r.status_code == 200, f"GET /health answered {r.status_code}"
        except httpx.HTTPError as e:
            ok, why = False, f"{type(e).__name__}: {e}"
        if ok and not server.healthy:
            log.info("%s server %s is healthy", server.role, server.url)
            server.healthy = True
        elif not ok:
            self.mark_down(server, why)

    async def run(self) -> None:
        """Check every `interval` seconds until cancelled."""
        while True:
            await asyncio.sleep(self.interval)
            await self.check()
