"""Cache salts (issue #55 item 12): the radix tree and the scheduler keep prefix-cache namespaces
apart, and the page hashes a router sees are chained from the salt, as the gateway computes them."""

from __future__ import annotations

from minisgl_core.prefix_hash import page_hashes, salt_seed
from minisgl_core.sampling import SamplingParams
from minisgl_scheduler import Scheduler, SchedulerConfig
from minisgl_scheduler.prefix_events import PrefixEventLog
from minisgl_scheduler.radix import RadixCache

from .fake_executor import FakeExecutor, reference
from .helpers import assert_all_pages_back, run

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
A, B = salt_seed("tenant-a"), salt_seed("tenant-b")


def test_salt_seeds_are_stable_nonzero_and_distinct() -> None:
    assert salt_seed("") == 0
    assert salt_seed("tenant-a") == A and A not in (0, B)
    tokens = list(range(8))
    assert page_hashes(tokens, 4, A) != page_hashes(tokens, 4, B) != page_hashes(tokens, 4)


def test_salted_prefixes_match_only_their_own_salt() -> None:
    c = RadixCache(page_size=2)
    tokens = [1, 2, 3, 4, 5, 6]
    c.insert(tokens, [10, 11, 12], salt=A)
    assert c.match(tokens, salt=A).pages == [10, 11, 12]
    assert c.match(tokens, salt=B).pages == []
    assert c.match(tokens).pages == []  # unsalted requests do not see salted pages either
    # The same prefix under another salt (and unsalted) is a separate copy, not a hit.
    _, have = c.insert(tokens, [20, 21, 22], salt=B)
    assert have == 0
    _, have = c.insert(tokens[:4], [30, 31])
    assert have == 0
    assert c.match(tokens, salt=B).pages == [20, 21, 22]
    assert c.match(tokens).pages == [30, 31]
    # Splits keep a node's salt: a shorter match under A still finds A's pages only.
    assert c.match([1, 2, 3, 4, 9, 9], salt=A).pages == [10, 11]
    c.check()
    assert sorted(c.evict_all()) == [10, 11, 12, 20, 21, 22, 30, 31]
    assert c.total_pages == 0
    c.check()


def test_page_size_one_keys_stay_apart() -> None:
    c = RadixCache(page_size=1)
    c.insert([7, 8], [0, 1], salt=A)
    c.insert([7, 8], [2, 3])
    assert c.match([7, 8], salt=A).pages == [0, 1]
    assert c.match([7, 8]).pages == [2, 3]
    assert c.match([7, 8], salt=B).pages == []
    c.check()


def test_events_name_salted_pages_as_the_router_hashes_them() -> None:
    ps = 4
    c = RadixCache(ps)
    log = PrefixEventLog(ps)
    c.listener = log
    cursor = log.subscribe(0, c).cursor
    tokens = list(range(100, 112))
    c.insert(tokens, [0, 1, 2], salt=A)
    c.insert(tokens[:8], [3, 4])
    log.flush()
    batches = log.since(cursor, 0.0)
    assert batches is not None
    stored = {h for b in batches for h in b.stored}
    assert stored == set(page_hashes(tokens, ps, A)) | set(page_hashes(tokens[:8], ps))
    assert set(log.snapshot(c)[1]) == stored
    c.evict_all()
    log.flush()
    batches = log.since(batches[-1].seq, 0.0)
    assert batches is not None
    assert {h for b in batches for h in b.removed} == stored


def test_scheduler_shares_cached_prompts_only_within_a_salt() -> None:
    fake = FakeExecutor(num_pages=128, page_size=4)
    s = Scheduler(fake, SchedulerConfig(disable_overlap=True))
    prompt = list(range(1, 41))
    s.submit(0, prompt, GREEDY, cache_salt="a")
    first = run(s)
    s.submit(1, prompt, GREEDY, cache_salt="a")  # same salt: a hit
    s.submit(2, prompt, GREEDY, cache_salt="b")  # another salt: nothing cached
    s.submit(3, prompt, GREEDY)  # no salt: the shared namespace, also empty
    rec = run(s)
    assert first.out[0].cached_tokens == 0
    assert rec.out[1].cached_tokens > 0
    assert rec.out[2].cached_tokens == 0 and rec.out[3].cached_tokens == 0
    # The salt changes where KV is cached, never what is computed.
    want = reference(prompt, GREEDY, fake)
    assert first.out[0].tokens == want
    assert all(rec.out[r].tokens == want for r in (1, 2, 3))
    assert_all_pages_back(s)
