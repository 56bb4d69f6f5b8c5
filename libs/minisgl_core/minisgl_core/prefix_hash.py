"""Chained hashes of whole KV pages: the names under which a scheduler reports its prefix cache
and a router looks a prompt up (the same function on both sides, so the router's index is exact).

Page i's hash covers page i's token ids and page i-1's hash, so equal hashes mean equal prefixes
(up to a 64-bit collision), as the block hashes of vLLM's and SGLang's KV events do. blake2b is
stable across processes and Python versions, unlike the built-in `hash`.

A request's cache salt (vLLM's `cache_salt`) starts its chain at `salt_seed(salt)` instead of 0:
every page hash of a salted prompt differs from the same prompt's under another salt, so neither
the scheduler's radix tree nor a router ever matches pages across salts.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from hashlib import blake2b

_BYTES = 4  # int32 token ids
_SALT_PERSON = b"minisgl-salt"  # keeps salt seeds apart from page hashes of the same bytes


def salt_seed(salt: str) -> int:
    """The chain start of a prefix-cache namespace: 0 (the shared one) for "", else a nonzero
    64-bit hash of the salt."""
    if not salt:
        return 0
    digest = blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=8, person=_SALT_PERSON)
    return int.from_bytes(digest.digest(), "little") or 1


def page_hashes(tokens: Sequence[int], page_size: int, parent: int = 0) -> list[int]:
    """One hash per whole page of `tokens` (a partial last page is not hashed), chained from
    `parent` (the hash of the page before `tokens[0]`, 0 at the start of a sequence)."""
    if page_size < 1:
        raise ValueError("page_size must be >= 1")
    buf = array("i", tokens).tobytes()
    step = page_size * _BYTES
    out: list[int] = []
    h = parent
    for start in range(0, len(buf) - step + 1, step):
        digest = blake2b(h.to_bytes(8, "little"), digest_size=8)
        digest.update(buf[start : start + step])
        h = int.from_bytes(digest.digest(), "little")
        out.append(h)
    return out
