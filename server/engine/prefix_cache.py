"""Prefix caching: full KV pages found again by a hash of everything that determines them.

A page's key is ``sha256(parent key, page tokens)``, and the chain's root is
``sha256(base-model revision, sharing scope, adapter digest)``. All of it is set by the server:
the revision is a hash of the model's config and weights (not a path), the scope is the
request's tenant (or one public scope when a deployment enables cross-tenant sharing), and the
adapter is named by content digest, so a re-uploaded adapter never meets its old pages and no
client can reach another tenant's cache.

Cached pages are one-page pager entries (kind PREFIX): pinned while requests hold them, cached
in LRU order once none does, competing for the pool with KV and adapters.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Hashable
from dataclasses import dataclass

from loraplex.server.engine.pager import PageKind, Pager
from loraplex.server.engine.request import Request

PUBLIC_SCOPE = "\x00public"


@dataclass(frozen=True)
class PrefixStats:
    queried_tokens: dict[str, int]  # by tenant: prompt tokens looked up
    hit_tokens: dict[str, int]  # by tenant: tokens served from cached pages
    num_cached_pages: int


class PrefixCache:
    """Page hashes per request, lookup at admission, registration as pages fill."""

    def __init__(self, pager: Pager, page_size: int, base_revision: str,
                 share_across_tenants: bool = False) -> None:
        self.pager = pager
        self.page_size = page_size
        self.base_revision = base_revision
        self.share_across_tenants = share_across_tenants
        self._pages: dict[bytes, int] = {}  # key -> page
        self._hashes: dict[str, list[bytes]] = {}  # request id -> keys of its full pages
        self._registered: dict[str, int] = {}  # request id -> leading pages already offered
        self._queried: defaultdict[str, int] = defaultdict(int)
        self._hits: defaultdict[str, int] = defaultdict(int)
        pager.on_evict(PageKind.PREFIX, self._on_evict)

    def _root(self, request: Request) -> bytes:
        scope = PUBLIC_SCOPE if self.share_across_tenants else request.tenant
        h = hashlib.sha256()
        for part in (self.base_revision, scope, request.adapter_digest or ""):
            data = part.encode()
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
        return h.digest()

    def _page_keys(self, request: Request, num_pages: int) -> list[bytes]:
        keys = self._hashes.setdefault(request.request_id, [])
        tokens = request.all_token_ids
        parent = keys[-1] if keys else self._root(request)
        for i in range(len(keys), num_pages):
            chunk = tokens[i * self.page_size:(i + 1) * self.page_size]
            h = hashlib.sha256(parent)
            h.update(b"".join(t.to_bytes(4, "little") for t in chunk))
            parent = h.digest()
            keys.append(parent)
        return keys[:num_pages]

    def match(self, request: Request) -> list[int]:
        """Cached pages for the request's leading full pages, pinned for it. At least one
        token is left to compute, so the step that finishes the prompt yields logits."""
        if request.page_ids:
            return []
        max_pages = (request.num_tokens - 1) // self.page_size
        if request.params.prompt_logprobs is not None:
            # Its prompt logprobs need the logits of every prompt position it has not scored.
            max_pages = min(max_pages, len(request.prompt_logprobs) // self.page_size)
        matched: list[int] = []
        for key in self._page_keys(request, max_pages):
            page = self._pages.get(key)
            if page is None:
                break
            self.pager.pin(key)
            matched.append(page)
        return matched

    def unmatch(self, request: Request, pages: list[int]) -> None:
        """Give back pages from ``match`` when the request is not admitted after all (last
        page first, so the deepest page is the first evicted and the rest still match)."""
        self.pager.free(pages[::-1])

    def record_admission(self, request: Request, num_hit_tokens: int) -> None:
        """Count a first admission's prompt tokens and cache hits (for hit rates by tenant)."""
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_hit_tokens
            self._queried[request.tenant] += request.num_prompt_tokens
            self._hits[request.tenant] += num_hit_tokens

    def register(self, request: Request) -> None:
        """Offer the request's newly computed full pages to the cache (after a step)."""
        num_full = min(request.num_computed_tokens // self.page_size, len(request.page_ids))
        done = self._registered.get(request.request_id, 0)
        if num_full <= done:
            return
        keys = self._page_keys(request, num_full)
        for i in range(done, num_full):
            if keys[i] in self._pages:
                continue  # cached already (this very page, or an identical one)
            try:
                self.pager.promote(request.page_ids[i], keys[i])
            except ValueError:
                continue  # a page shared with other requests stays plain KV
            self._pages[keys[i]] = request.page_ids[i]
        self._registered[request.request_id] = num_full

    def forget(self, request: Request, finished: bool) -> None:
        """Drop a request's bookkeeping when it finishes; on preemption only its registration
        mark (its pages are gone, the hashes of its tokens stay valid)."""
        self._registered.pop(request.request_id, None)
        if finished:
            self._hashes.pop(request.request_id, None)

    def _on_evict(self, key: Hashable) -> None:
        if isinstance(key, bytes):
            self._pages.pop(key, None)

    def stats(self) -> PrefixStats:
        return PrefixStats(dict(self._queried), dict(self._hits), len(self._pages))
