"""The Triton servers behind the gateway: one gRPC client each, and a health loop that reads
each server's readiness and load (its metrics endpoint) every `health_interval_s`. A server
that is not ready, has no healthy engine, or has not answered for `unhealthy_after_s` is out
of the rotation until it answers again."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import deque
from typing import Any

import aiohttp

from python_backends.config import GRPC_API_KEY_HEADER
from python_backends.front.tenancy import CacheSharing
from python_backends.gateway.config import BackendConfig, GatewayConfig
from python_backends.gateway.routing import ServerView
from python_backends.gateway.triton import Breaker, TritonClient
from python_backends.metrics_text import Metrics, histogram_quantile, metric_sum, parse_metrics
from python_backends.wire import FRONT_START_METRIC

log = logging.getLogger(__name__)
TTFT_WINDOW_S = 60.0  # latency-aware routing reads each server's TTFT p95 over this window
TTFT_METRIC = "llm_time_to_first_token_seconds"
BLOCK_SIZE_METRIC = "llm_kv_block_size_tokens"
SHARING_PARAMETER = "prefix_cache_shared_tenants"  # of the front model's config
# The families the gateway reads of a server's scrape. The scrape is parsed on the event loop
# that relays every token, and Triton's own families are most of it.
READ_METRICS = ("llm_engine_healthy", "llm_kv_cache_usage_ratio", "llm_num_requests_waiting",
                "llm_num_requests_running", "llm_kv_cache_blocks_used", TTFT_METRIC,
                FRONT_START_METRIC, BLOCK_SIZE_METRIC)


class Backend:
    def __init__(self, config: BackendConfig) -> None:
        self.config = config
        self.name = config.name
        self.client: Any = None  # a TritonClient, made in the event loop that uses it
        # a server's own key (launcher --api-key), in Triton's gRPC metadata name for it
        self.headers = {GRPC_API_KEY_HEADER: config.api_key} if config.api_key else None
        self.ready = False
        self.last_answer = 0.0  # monotonic time of its last successful health check
        self.in_flight = 0
        self.breaker = Breaker()  # its open streams, ended when it loses them
        self.front_started: float | None = None  # its front's start (FRONT_START_METRIC)
        # its front's prefix-cache sharing (each tenant its own cache until read), and the
        # start of the front it was read from: a restarted front is read again
        self.cache_sharing = CacheSharing()
        self.sharing_read_from: float | None = None
        self._history: deque[tuple[float, Metrics]] = deque()  # scrapes of the TTFT window
        self.metrics = {}

    @property
    def metrics(self) -> Metrics:
        """Its last scrape (the families the gateway reads)."""
        return self._metrics

    @metrics.setter
    def metrics(self, m: Metrics) -> None:
        # What routing reads of a scrape is worked out once per scrape, not per request.
        self._metrics = m
        engines = m.get("llm_engine_healthy", {})
        self._engines_ok = not engines or any(v > 0 for v in engines.values())
        self._view = ServerView(
            name=self.name, region=self.config.region, weight=self.config.weight,
            healthy=False, waiting=metric_sum(m, "llm_num_requests_waiting"),
            running=metric_sum(m, "llm_num_requests_running"),
            kv_usage=max(m.get("llm_kv_cache_usage_ratio", {}).values(), default=0.0),
            kv_blocks_used=metric_sum(m, "llm_kv_cache_blocks_used"),
            ttft_p95_s=self.ttft_p95(), canary=self.config.canary,
            block_size=int(max(m.get(BLOCK_SIZE_METRIC, {}).values(), default=0)),
            cache_sharing=self.cache_sharing)

    def ttft_p95(self) -> float | None:
        """TTFT p95 of the requests that finished in the last TTFT_WINDOW_S (about)."""
        if len(self._history) < 2:
            return None
        return histogram_quantile(0.95, self._history[0][1], self._history[-1][1],
                                  TTFT_METRIC)

    def view(self, now: float, unhealthy_after_s: float) -> ServerView:
        healthy = (self.ready and self._engines_ok
                   and now - self.last_answer <= unhealthy_after_s)
        return dataclasses.replace(self._view, healthy=healthy, in_flight=self.in_flight)

    def connect(self) -> None:
        self.client = TritonClient(self.config.grpc)

    async def check(self, session: aiohttp.ClientSession, timeout_s: float,
                    unhealthy_after_s: float) -> None:
        """Read readiness and metrics once; a failure leaves the server's last answer as is.
        Streams the server has lost are broken: once it has not answered for
        `unhealthy_after_s`, those that received nothing for as long; when its front
        restarted, those opened before."""
        try:
            ready = await self.client.is_server_ready(self.headers, timeout_s)
            async with session.get(self.config.metrics,
                                   timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                text = await r.text()
        except Exception as e:  # down, restarting, unreachable: out until it answers
            if self.ready:
                log.warning("backend %s stopped answering: %s", self.name, e)
            self.ready = False
            silent = time.monotonic() - self.last_answer
            if silent > unhealthy_after_s and self.breaker:
                # only streams as quiet as the server: one still receiving pieces is alive
                n = self.breaker.break_all(f"it has not answered for {silent:.0f} s",
                                           quiet_s=unhealthy_after_s)
                if n:
                    log.warning("backend %s: %d open stream(s) moved away (silent %.0f s)",
                                self.name, n, silent)
            return
        if ready and not self.ready:
            log.info("backend %s is ready", self.name)
        self.ready = bool(ready)
        metrics = parse_metrics(text, READ_METRICS)
        self.last_answer = now = time.monotonic()
        self._history.append((now, metrics))
        # keep one scrape at or before the window's start, as the baseline of the deltas
        while len(self._history) > 2 and self._history[1][0] <= now - TTFT_WINDOW_S:
            self._history.popleft()
        started = max(metrics.get(FRONT_START_METRIC, {}).values(), default=None)
        self._watch_front(started)
        await self._read_cache_sharing(started, timeout_s)
        self.metrics = metrics

    async def _read_cache_sharing(self, started: float | None, timeout_s: float) -> None:
        """The front's prefix_cache_shared_tenants, once per start of the front: the salt rules
        its engines key cached KV by, which prefix-aware routing hashes prompts with. A server
        without a front, or one whose config cannot be read, keeps the front's default (each
        tenant its own cache) and is asked again at the next check. `started`: the front's
        start (FRONT_START_METRIC), None without a front."""
        if not self.ready or started is None or started == self.sharing_read_from:
            return
        try:
            params = await self.client.model_parameters("front", self.headers, timeout_s)
        except Exception as e:
            log.debug("backend %s: front config unread: %s", self.name, e)
            return
        self.cache_sharing = CacheSharing.parse(params.get(SHARING_PARAMETER, ""))
        self.sharing_read_from = started

    def _watch_front(self, started: float | None) -> None:
        if started is None:
            return
        if self.front_started is not None and started > self.front_started:
            n = self.breaker.break_all("its front restarted", opened_before=started,
                                       server_ok=True)
            log.warning("backend %s: its front restarted; %d stream(s) it held moved away",
                        self.name, n)
        self.front_started = started


class BackendPool:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.backends = {b.name: Backend(b) for b in config.backends}
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    def views(self) -> list[ServerView]:
        now = time.monotonic()
        return [b.view(now, self.config.unhealthy_after_s) for b in self.backends.values()]

    async def check_all(self) -> None:
        assert self._session is not None
        timeout = max(0.5, self.config.health_interval_s)
        await asyncio.gather(*(b.check(self._session, timeout, self.config.unhealthy_after_s)
                               for b in self.backends.values()))

    async def start(self) -> None:
        for b in self.backends.values():
            b.connect()
        self._session = aiohttp.ClientSession()
        await self.check_all()
        self._task = asyncio.create_task(self._loop(), name="gateway-health")

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            await self.check_all()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for b in self.backends.values():
            if b.client is not None:
                await b.client.close()
        if self._session is not None:
            await self._session.close()
