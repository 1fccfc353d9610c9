"""Whose cached KV a request may reuse: the salt of its prefix-cache keys.

Blocks are shared only between requests with the same salt (engine.prefix_cache), so without
a salt one tenant's prompts would warm another's cache, and the time to first token would tell
a tenant what others asked (a timing side channel). By default each tenant has its own cache;
an operator may let named tenants share one; a request's own `cache_salt` (vLLM's name) picks
a cache of its own, shared only with requests that send the same salt.
"""

from __future__ import annotations

from dataclasses import dataclass

ALL_TENANTS = "*"


@dataclass(frozen=True)
class CacheSharing:
    shared_tenants: frozenset[str] = frozenset()  # ALL_TENANTS: every tenant shares

    @classmethod
    def parse(cls, text: str) -> CacheSharing:
        """The front's `prefix_cache_shared_tenants` parameter: comma-separated tenants, or *."""
        return cls(frozenset(t.strip() for t in text.split(",") if t.strip()))

    def salt(self, tenant: str, cache_salt: str = "") -> str:
        """The salt for a request of `tenant` that sent `cache_salt` ("" if none). The kinds
        are prefixed, so a client's salt can never equal a tenant's."""
        if cache_salt:
            return f"salt:{cache_salt}"
        if tenant in self.shared_tenants or ALL_TENANTS in self.shared_tenants:
            return "shared"
        return f"tenant:{tenant}"
