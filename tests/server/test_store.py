"""Unit tests for tensorshare.store: the semantics listed in the module docstring."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorshare.errors import BinNotFound, LimitExceeded, MemoryLimitExceeded, ServerError
from tensorshare.server.store import Store, Waiter
from tensorshare.wire.messages import Fetched as Taken
from tensorshare.wire.messages import FetchSpec


class Recorder:
    """An on_change hook that remembers every call."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, int, int]] = []

    def __call__(self, name: str, op: str, n_items: int, version: int, dropped: int = 0) -> None:
        if dropped:
            self.events.append((name, op, n_items, version, dropped))  # type: ignore[arg-type]
        else:
            self.events.append((name, op, n_items, version))


class Callback:
    """A waiter callback that remembers what it was served with."""

    def __init__(self) -> None:
        self.calls: list[Taken] = []

    def __call__(self, taken: Taken) -> None:
        self.calls.append(taken)


@pytest.fixture
def hook() -> Recorder:
    return Recorder()


@pytest.fixture
def store(hook: Recorder) -> Store:
    return Store(on_change=hook)


def fetch(store: Store, name: str, *, remove: bool, max_bytes: int | None = None,
          **kw) -> Taken:
    return store.fetch(name, FetchSpec(remove, **kw), max_bytes)


def fetch_or_wait(store: Store, name: str, cb, *, remove: bool, max_bytes: int | None = None,
                  **kw) -> Taken | Waiter:
    return store.fetch_or_wait(name, FetchSpec(remove, **kw), cb, max_bytes)


def peek(store: Store, name: str, **kw) -> Taken:
    return fetch(store, name, remove=False, **kw)


def get(store: Store, name: str, **kw) -> Taken:
    return fetch(store, name, remove=True, **kw)


# -- put / append ---------------------------------------------------------------------------
def test_put_replaces(store):
    assert store.put("x", "first", 5) == (1, 1, 0)
    assert store.put("x", "second", 6) == (2, 1, 0)
    t = peek(store, "x")
    assert t.kind == "value"
    assert t.items == ("second",)
    assert t.n_items == 1
    assert store.n_items("x") == 1
    assert store.nbytes == 6


def test_put_replaces_a_list(store):
    store.append("x", 1, 10)
    store.append("x", 2, 10)
    assert store.put("x", 3, 4) == (3, 1, 0)
    t = peek(store, "x")
    assert (t.kind, t.items, t.n_items) == ("value", (3,), 1)
    assert store.nbytes == 4


def test_append_adds_one_item_and_never_flattens(store):
    assert store.append("x", [1, 2, 3], 3) == (1, 1, 0)
    assert store.append("x", [4], 1) == (2, 2, 0)
    assert store.append("x", (5, 6), 2) == (3, 3, 0)
    t = peek(store, "x")
    assert t.kind == "list"
    assert t.items == ([1, 2, 3], [4], (5, 6))
    assert t.n_items == 3
    assert store.list() == {"x": 3}


def test_append_to_a_put_bin_makes_a_list(store):
    store.put("x", "value", 5)
    assert store.append("x", "new", 3) == (2, 2, 0)
    t = peek(store, "x")
    assert t.kind == "list"
    assert t.items == ("value", "new")
    assert store.nbytes == 8


def test_put_list_value_is_one_value(store):
    store.put("x", [1, 2], 2)
    t = get(store, "x")
    assert (t.kind, t.items) == ("value", ([1, 2],))


def test_tags_are_returned_in_order(store):
    store.append("x", "a", 1, tag=3)
    store.append("x", "b", 1)
    store.append("x", "c", 1, tag=1)
    assert peek(store, "x").tags == (3, None, 1)
    store.put("y", "v", 1, tag=9)
    assert peek(store, "y").tags == (9,)


# -- fetch ----------------------------------------------------------------------------------
def test_get_a_put_bin_returns_the_value_and_removes_the_bin(store):
    store.put("x", {"w": 1}, 10)
    t = get(store, "x")
    assert t.kind == "value"
    assert t.items == ({"w": 1},)
    assert t.n_items == 0
    assert t.dropped == 0 and t.unchanged is False
    assert store.list() == {}
    assert store.n_items("x") == 0
    assert store.nbytes == 0
    with pytest.raises(BinNotFound):
        get(store, "x")
    with pytest.raises(BinNotFound):
        peek(store, "x")


def test_get_a_list_bin_returns_all_items_fifo(store):
    for i in range(5):
        store.append("q", i, 1)
    t = get(store, "q")
    assert t.kind == "list"
    assert t.items == (0, 1, 2, 3, 4)
    assert t.n_items == 0
    assert "q" not in store.list()


def test_get_max_items_takes_from_the_front_and_leaves_the_rest(store):
    for i in range(5):
        store.append("q", i, 10)
    t = get(store, "q", max_items=2)
    assert t.items == (0, 1)
    assert t.n_items == 3
    assert store.n_items("q") == 3
    assert store.nbytes == 30
    t = get(store, "q", max_items=2)
    assert t.items == (2, 3)
    assert t.n_items == 1
    t = get(store, "q", max_items=2)
    assert t.items == (4,)
    assert t.n_items == 0
    assert store.list() == {}
    assert store.nbytes == 0


def test_max_items_larger_than_the_bin(store):
    store.append("q", "a", 1)
    store.append("q", "b", 1)
    assert get(store, "q", max_items=10).items == ("a", "b")


def test_max_items_on_a_value_bin_returns_the_value(store):
    store.put("x", "v", 1)
    t = get(store, "x", max_items=1)
    assert (t.kind, t.items, t.n_items) == ("value", ("v",), 0)


def test_peek_leaves_everything(store, hook):
    store.append("q", "a", 1)
    store.append("q", "b", 1)
    n_events = len(hook.events)
    t = peek(store, "q")
    assert t.items == ("a", "b")
    assert t.n_items == 2
    t = peek(store, "q", max_items=1)
    assert t.items == ("a",)
    assert t.n_items == 2
    assert peek(store, "q").items == ("a", "b")
    assert store.list() == {"q": 2}
    assert store.nbytes == 2
    assert store.version("q") == 2
    assert len(hook.events) == n_events


@pytest.mark.parametrize("remove", [True, False])
def test_missing_bin_raises_bin_not_found(store, remove):
    with pytest.raises(BinNotFound) as info:
        fetch(store, "no-such-bin", remove=remove)
    assert isinstance(info.value, LookupError)
    assert isinstance(info.value, ServerError)
    assert info.value.code == "bin_not_found"
    assert "no-such-bin" in str(info.value)


def test_missing_bin_is_a_lookup_error(store):
    with pytest.raises(LookupError):
        get(store, "nothing")


# -- list / delete --------------------------------------------------------------------------
def test_list_reports_non_empty_bins_only(store):
    assert store.list() == {}
    store.put("a", 1, 1)
    store.append("b", 1, 1)
    store.append("b", 2, 1)
    store.append("c", 1, 1)
    get(store, "c")
    store.put("d", 1, 1)
    store.delete("d")
    assert store.list() == {"a": 1, "b": 2}


def test_delete(store):
    store.append("x", 1, 7)
    store.append("x", 2, 7)
    assert store.delete("x") == (True, 3)
    assert store.list() == {}
    assert store.nbytes == 0
    assert store.delete("x") == (False, 3)
    assert store.version("x") == 3
    assert store.delete("never") == (False, 0)
    with pytest.raises(BinNotFound):
        peek(store, "x")


# -- versions and the change hook ---------------------------------------------------------------
def test_versions_increase_on_every_change_but_not_on_peek(store):
    assert store.version("x") == 0
    assert store.put("x", "a", 1) == (1, 1, 0)
    peek(store, "x")
    assert store.version("x") == 1
    assert store.append("x", "b", 1) == (2, 2, 0)
    t = get(store, "x", max_items=1)
    assert t.version == 3
    assert store.version("x") == 3
    t = peek(store, "x")
    assert t.version == 3
    assert store.version("x") == 3
    assert store.delete("x") == (True, 4)
    assert store.version("x") == 4


def test_failed_fetch_does_not_change_the_version(store):
    store.put("x", "a", 1)
    with pytest.raises(BinNotFound):
        get(store, "y")
    assert store.version("y") == 0
    assert store.version("x") == 1


def test_versions_continue_after_delete_and_after_the_bin_empties(store):
    store.put("x", "a", 1)  # 1
    store.delete("x")  # 2
    assert store.put("x", "b", 1) == (3, 1, 0)
    get(store, "x")  # 4, bin gone
    assert store.version("x") == 4
    assert store.append("x", "c", 1) == (5, 1, 0)
    assert peek(store, "x").version == 5


def test_versions_are_per_bin(store):
    store.put("a", 1, 1)
    store.put("a", 2, 1)
    assert store.put("b", 1, 1) == (1, 1, 0)
    assert store.version("a") == 2


def test_on_change_hook_sees_every_change_in_order(store, hook):
    store.put("x", "a", 1)
    store.append("x", "b", 1)
    peek(store, "x")
    get(store, "x", max_items=1)
    peek(store, "x")
    store.append("y", "c", 1)
    get(store, "x")
    store.delete("y")
    store.delete("y")  # missing: not a change
    assert hook.events == [
        ("x", "put", 1, 1),
        ("x", "append", 2, 2),
        ("x", "get", 1, 3),
        ("y", "append", 1, 1),
        ("x", "get", 0, 4),
        ("y", "delete", 0, 2),
    ]


# -- memory ---------------------------------------------------------------------------------
def test_memory_limit_refuses_put_and_append_without_losing_anything():
    hook = Recorder()
    store = Store(max_memory=1000, on_change=hook)
    store.put("weights", "w", 600)
    store.append("rollouts", "r0", 300)
    events = list(hook.events)

    with pytest.raises(MemoryLimitExceeded) as info:
        store.append("rollouts", "r1", 101)
    msg = str(info.value)
    assert "rollouts" in msg
    assert "1000" in msg
    assert isinstance(info.value, LimitExceeded)
    assert info.value.code == "memory_limit"

    with pytest.raises(MemoryLimitExceeded, match="newbin") as info:
        store.put("newbin", "n", 101)
    assert "1000" in str(info.value)

    with pytest.raises(MemoryLimitExceeded, match="weights") as info:
        store.put("weights", "bigger", 701)  # replaces 600: growth 101
    assert "1000" in str(info.value)

    assert store.nbytes == 900
    assert store.list() == {"weights": 1, "rollouts": 1}
    assert peek(store, "weights").items == ("w",)
    assert peek(store, "rollouts").items == ("r0",)
    assert store.version("weights") == 1 and store.version("rollouts") == 1
    assert store.version("newbin") == 0
    assert hook.events == events  # a refused change is not a change


def test_memory_limit_is_inclusive():
    store = Store(max_memory=100)
    store.put("a", 1, 60)
    store.append("b", 2, 40)
    assert store.nbytes == 100
    with pytest.raises(MemoryLimitExceeded):
        store.append("b", 3, 1)
    store.append("b", 4, 0)  # zero bytes never exceed
    assert store.nbytes == 100


def test_put_replacing_a_large_value_with_a_smaller_one_is_allowed_near_the_limit():
    store = Store(max_memory=100)
    store.put("a", "large", 90)
    store.put("b", "other", 10)
    assert store.nbytes == 100
    assert store.put("a", "small", 50) == (2, 1, 0)
    assert store.nbytes == 60
    assert store.put("a", "same", 50) == (3, 1, 0)  # no growth at all
    assert store.put("a", "back to large", 90) == (4, 1, 0)  # growth 40 fits exactly
    assert store.nbytes == 100
    # Replacing a list frees all its items.
    store.delete("a")
    store.append("b", "x", 45)
    store.append("b", "y", 45)
    assert store.nbytes == 100
    store.put("b", "z", 100)
    assert store.nbytes == 100
    assert peek(store, "b").items == ("z",)


def test_get_and_delete_free_bytes():
    store = Store(max_memory=100)
    store.append("q", 1, 30)
    store.append("q", 2, 30)
    store.put("v", 3, 40)
    get(store, "q", max_items=1)
    assert store.nbytes == 70
    get(store, "q")
    assert store.nbytes == 40
    store.delete("v")
    assert store.nbytes == 0
    store.put("v", 4, 100)  # the freed bytes are usable again
    assert store.nbytes == 100
    get(store, "v")
    assert store.nbytes == 0


def test_no_memory_limit_by_default():
    store = Store()
    store.put("a", 1, 10**15)
    store.append("a", 2, 10**15)
    assert store.nbytes == 2 * 10**15


# -- tags and min_tag -------------------------------------------------------------------------
def _tagged(store: Store) -> None:
    store.append("r", "t1", 10, tag=1)
    store.append("r", "untagged", 20)
    store.append("r", "t5", 30, tag=5)
    store.append("r", "t3", 40, tag=3)
    store.append("r", "t7", 50, tag=7)


def test_peek_min_tag_skips_stale_items_but_keeps_them(store):
    _tagged(store)
    t = peek(store, "r", min_tag=5)
    assert t.items == ("t5", "t7")
    assert t.tags == (5, 7)
    assert t.dropped == 3
    assert t.n_items == 5
    assert store.nbytes == 150
    assert store.version("r") == 5
    assert peek(store, "r").items == ("t1", "untagged", "t5", "t3", "t7")


def test_get_min_tag_drops_stale_items_and_frees_their_bytes(store, hook):
    _tagged(store)
    t = get(store, "r", min_tag=3, max_items=1)
    assert t.items == ("t5",)
    assert t.dropped == 2  # t1 and the untagged item
    assert t.n_items == 2
    assert store.nbytes == 90  # t3 + t7 are left
    assert peek(store, "r").items == ("t3", "t7")
    assert store.version("r") == 6
    assert hook.events[-1] == ("r", "get", 2, 6)


def test_min_tag_applies_to_a_value_bin(store):
    store.put("w", "old", 10, tag=1)
    with pytest.raises(BinNotFound):
        peek(store, "w", min_tag=2)
    assert peek(store, "w", min_tag=1).items == ("old",)
    store.put("w", "new", 10, tag=2)
    assert get(store, "w", min_tag=2).items == ("new",)


def test_peek_with_only_stale_items_raises_and_keeps_them(store):
    store.append("r", "a", 10, tag=1)
    store.append("r", "b", 10)
    with pytest.raises(BinNotFound, match="r"):
        peek(store, "r", min_tag=2)
    assert store.list() == {"r": 2}
    assert store.nbytes == 20


def test_get_with_only_stale_items_raises_and_drops_them(store, hook):
    store.append("r", "a", 10, tag=1)
    store.append("r", "b", 10)
    with pytest.raises(BinNotFound) as info:
        get(store, "r", min_tag=2)
    assert "'r'" in str(info.value)
    assert store.list() == {}
    assert store.nbytes == 0
    assert store.n_items("r") == 0
    assert store.version("r") == 3  # dropping the stale items was a change
    assert hook.events[-1] == ("r", "get", 0, 3)
    with pytest.raises(BinNotFound):
        peek(store, "r")
    # The drop is reported by the next get that returns items.
    store.append("r", "c", 10, tag=5)
    assert get(store, "r", min_tag=2).dropped == 2


def test_without_min_tag_untagged_items_are_returned(store):
    store.append("r", "a", 1)
    t = get(store, "r")
    assert t.items == ("a",) and t.dropped == 0


# -- newer_than ------------------------------------------------------------------------------
@pytest.mark.parametrize("remove", [True, False])
def test_newer_than_current_version_is_unchanged(store, hook, remove):
    store.put("x", "a", 1)
    store.append("x", "b", 1)
    n_events = len(hook.events)
    for newer_than in (2, 3, 100):
        t = fetch(store, "x", remove=remove, newer_than=newer_than)
        assert t.unchanged is True
        assert t.items == ()
        assert t.tags == ()
        assert t.version == 2
        assert t.n_items == 2
    assert store.list() == {"x": 2}
    assert store.version("x") == 2
    assert len(hook.events) == n_events


def test_newer_than_lower_version_returns_the_data(store):
    store.put("x", "a", 1)
    store.append("x", "b", 1)
    t = peek(store, "x", newer_than=1)
    assert t.unchanged is False and t.items == ("a", "b")
    t = get(store, "x", newer_than=0)
    assert t.unchanged is False and t.items == ("a", "b")
    assert t.version == 3


def test_newer_than_on_a_missing_bin_raises(store):
    with pytest.raises(BinNotFound):
        peek(store, "x", newer_than=0)


# -- waiters --------------------------------------------------------------------------------
def test_fetch_or_wait_serves_at_once_when_possible(store):
    store.append("x", "a", 1)
    cb = Callback()
    t = fetch_or_wait(store, "x", cb, remove=True)
    assert isinstance(t, Taken)
    assert t.items == ("a",)
    assert cb.calls == []
    assert store.n_waiters == 0
    assert store.list() == {}


def test_get_waiter_is_served_by_a_later_append(store, hook):
    cb = Callback()
    w = fetch_or_wait(store, "x", cb, remove=True)
    assert isinstance(w, Waiter)
    assert w.active
    assert store.n_waiters == 1
    assert cb.calls == []
    store.append("x", "item", 4)
    assert len(cb.calls) == 1
    t = cb.calls[0]
    assert t.kind == "list"
    assert t.items == ("item",)
    assert t.n_items == 0
    assert t.version == 2
    assert not w.active
    assert store.n_waiters == 0
    assert store.list() == {}
    assert store.nbytes == 0
    assert hook.events == [("x", "append", 1, 1), ("x", "get", 0, 2)]
    store.append("x", "again", 1)  # served once only
    assert len(cb.calls) == 1
    assert store.list() == {"x": 1}


def test_get_waiter_is_served_by_put(store):
    cb = Callback()
    fetch_or_wait(store, "x", cb, remove=True)
    store.put("x", "v", 1)
    assert [(t.kind, t.items) for t in cb.calls] == [("value", ("v",))]
    assert store.list() == {}


def test_peek_waiter_does_not_remove(store, hook):
    cb = Callback()
    assert isinstance(fetch_or_wait(store, "x", cb, remove=False), Waiter)
    store.append("x", "item", 4)
    assert [t.items for t in cb.calls] == [("item",)]
    assert cb.calls[0].n_items == 1
    assert store.list() == {"x": 1}
    assert store.nbytes == 4
    assert hook.events == [("x", "append", 1, 1)]
    store.append("x", "more", 1)
    assert len(cb.calls) == 1


def test_get_waiters_are_served_fifo_one_item_each(store):
    cbs = [Callback() for _ in range(3)]
    for cb in cbs:
        fetch_or_wait(store, "q", cb, remove=True)
    assert store.n_waiters == 3
    store.append("q", "a", 1)
    assert [len(cb.calls) for cb in cbs] == [1, 0, 0]
    store.append("q", "b", 1)
    store.append("q", "c", 1)
    assert [cb.calls[0].items for cb in cbs] == [("a",), ("b",), ("c",)]
    assert all(len(cb.calls) == 1 for cb in cbs)
    assert store.n_waiters == 0
    assert store.list() == {}


def test_peek_waiters_then_get_waiter_all_served_by_one_append(store):
    p1, p2, g = Callback(), Callback(), Callback()
    fetch_or_wait(store, "q", p1, remove=False)
    fetch_or_wait(store, "q", p2, remove=False)
    fetch_or_wait(store, "q", g, remove=True)
    store.append("q", "a", 1)
    assert [c.calls[0].items for c in (p1, p2, g)] == [("a",), ("a",), ("a",)]
    assert store.list() == {}
    assert store.n_waiters == 0


def test_get_waiter_takes_the_item_before_a_later_peek_waiter(store):
    g, p = Callback(), Callback()
    fetch_or_wait(store, "q", g, remove=True)
    fetch_or_wait(store, "q", p, remove=False)
    store.append("q", "a", 1)
    assert [t.items for t in g.calls] == [("a",)]
    assert p.calls == []
    assert store.n_waiters == 1
    store.append("q", "b", 1)
    assert [t.items for t in p.calls] == [("b",)]


def test_min_items_waits_until_enough_items(store):
    store.append("q", 0, 1)
    cb = Callback()
    w = fetch_or_wait(store, "q", cb, remove=True, min_items=3)
    assert isinstance(w, Waiter)
    store.append("q", 1, 1)
    assert cb.calls == []
    store.append("q", 2, 1)
    assert [t.items for t in cb.calls] == [(0, 1, 2)]
    assert store.list() == {}


def test_min_items_served_at_once_when_present(store):
    for i in range(3):
        store.append("q", i, 1)
    t = fetch_or_wait(store, "q", Callback(), remove=True, min_items=3, max_items=2)
    assert isinstance(t, Taken)
    assert t.items == (0, 1)
    assert t.n_items == 1


def test_newer_than_waiter_is_served_only_by_a_higher_version(store):
    store.put("w", "v1", 1)
    cb = Callback()
    w = fetch_or_wait(store, "w", cb, remove=False, newer_than=1)
    assert isinstance(w, Waiter)  # waits instead of answering "unchanged"
    store.put("w", "v2", 1)
    assert [(t.items, t.version, t.unchanged) for t in cb.calls] == [(("v2",), 2, False)]

    cb2 = Callback()
    w2 = fetch_or_wait(store, "w", cb2, remove=False, newer_than=3)
    store.put("w", "v3", 1)  # version 3: not above 3
    assert cb2.calls == []
    assert w2.active
    store.put("w", "v4", 1)
    assert [t.items for t in cb2.calls] == [("v4",)]


def test_newer_than_waiter_served_at_once_when_already_newer(store):
    store.put("w", "v1", 1)
    store.put("w", "v2", 1)
    t = fetch_or_wait(store, "w", Callback(), remove=False, newer_than=1)
    assert isinstance(t, Taken) and t.items == ("v2",)


def test_min_tag_waiter(store):
    store.append("r", "stale", 10, tag=1)
    cb = Callback()
    w = fetch_or_wait(store, "r", cb, remove=True, min_tag=2)
    assert isinstance(w, Waiter)
    assert store.list() == {}  # the stale item was dropped while trying
    assert store.nbytes == 0
    store.append("r", "stale again", 10, tag=0)
    assert cb.calls == []
    assert store.list() == {}  # dropped again by the waiter's attempt
    assert store.nbytes == 0
    store.append("r", "fresh", 10, tag=2)
    # The two stale items dropped while it waited are reported with the items it gets.
    assert [(t.items, t.dropped) for t in cb.calls] == [(("fresh",), 2)]
    assert store.nbytes == 0
    assert store.n_waiters == 0


def test_cancel_withdraws_a_waiter(store):
    cb1, cb2 = Callback(), Callback()
    w1 = fetch_or_wait(store, "x", cb1, remove=True)
    w2 = fetch_or_wait(store, "x", cb2, remove=True)
    assert store.n_waiters == 2
    assert store.cancel(w1) is True
    assert not w1.active
    assert store.n_waiters == 1
    assert store.cancel(w1) is False
    store.append("x", "a", 1)
    assert cb1.calls == []
    assert [t.items for t in cb2.calls] == [("a",)]
    assert store.cancel(w2) is False  # already served
    assert store.n_waiters == 0


def test_cancelled_waiter_is_never_called(store):
    cb = Callback()
    w = fetch_or_wait(store, "x", cb, remove=False)
    assert store.cancel(w) is True
    assert store.n_waiters == 0
    store.put("x", 1, 1)
    store.append("x", 2, 1)
    assert cb.calls == []


def test_n_waiters_counts_across_bins(store):
    ws = [fetch_or_wait(store, name, Callback(), remove=True) for name in ("a", "a", "b")]
    assert store.n_waiters == 3
    store.append("b", 1, 1)
    assert store.n_waiters == 2
    store.cancel(ws[0])
    assert store.n_waiters == 1
    store.cancel(ws[1])
    assert store.n_waiters == 0


def test_delete_does_not_serve_or_drop_waiters(store):
    store.put("x", "a", 1)
    cb = Callback()
    w = fetch_or_wait(store, "x", cb, remove=True, newer_than=1)
    assert store.delete("x") == (True, 2)
    assert cb.calls == []  # the bin is gone: nothing to serve
    assert w.active and store.n_waiters == 1
    store.put("x", "b", 1)  # version 3; the get that serves the waiter makes it 4
    assert [(t.items, t.version) for t in cb.calls] == [(("b",), 4)]
    assert store.list() == {}


def test_a_waiter_that_cannot_be_served_does_not_hold_back_a_later_one(store):
    store.append("x", "a", 1)
    early = Callback()
    w1 = fetch_or_wait(store, "x", early, remove=False, newer_than=1)
    assert isinstance(w1, Waiter)
    late = Callback()
    # An earlier waiter is queued on "x" but cannot be served yet (it wants a newer
    # version). The queue is served in order at once, so the get is served now.
    w2 = fetch_or_wait(store, "x", late, remove=True)
    assert isinstance(w2, Waiter) and not w2.active
    assert [t.items for t in late.calls] == [("a",)]
    assert early.calls == [] and w1.active
    assert store.list() == {} and store.n_waiters == 1
    # The earlier waiter keeps its turn: it is served first by the next change.
    late2 = Callback()
    w3 = fetch_or_wait(store, "x", late2, remove=True)
    assert isinstance(w3, Waiter) and w3.active
    store.append("x", "b", 1)
    assert [t.items for t in early.calls] == [("b",)]
    assert [t.items for t in late2.calls] == [("b",)]
    assert store.list() == {} and store.n_waiters == 0


def test_fifo_order_among_waiters_that_can_all_be_served(store):
    a, b = Callback(), Callback()
    fetch_or_wait(store, "x", a, remove=True)
    fetch_or_wait(store, "x", b, remove=True)
    store.append("x", "1", 1)
    store.append("x", "2", 1)
    assert [t.items for t in a.calls] == [("1",)]
    assert [t.items for t in b.calls] == [("2",)]
    # A waiter on another bin does not block this one.
    fetch_or_wait(store, "y", Callback(), remove=True)
    store.append("z", "z", 1)
    assert isinstance(fetch_or_wait(store, "z", Callback(), remove=True), Taken)


def test_max_bytes_caps_the_items_of_one_fetch(store):
    for i in range(5):
        store.append("x", i, 100)
    taken = fetch(store, "x", remove=True, max_bytes=250)
    assert taken.items == (0, 1) and taken.n_items == 3
    taken = fetch(store, "x", remove=True, max_bytes=10)  # always at least one item
    assert taken.items == (2,)


def test_waiter_cancelled_by_an_earlier_waiters_callback_is_never_called(store):
    # A callback may cancel another waiter (e.g. the server's send fails and the connection
    # cancels all its waiters). The cancelled waiter must not be called, and the append that
    # triggered the serving must succeed.
    second = Callback()
    waiters: dict[str, Waiter] = {}

    def first(taken: Taken) -> None:
        assert store.cancel(waiters["second"]) is True

    fetch_or_wait(store, "x", first, remove=False)
    w = fetch_or_wait(store, "x", second, remove=False)
    assert isinstance(w, Waiter)
    waiters["second"] = w
    assert store.append("x", "a", 1) == (1, 1, 0)
    assert second.calls == []
    assert store.n_waiters == 0
    assert store.list() == {"x": 1}


def test_waiter_registered_by_a_callback_after_a_cancel_is_kept(store):
    # The first waiter's callback cancels the second (emptying the bin's queue) and registers
    # a new waiter. The new waiter must stay registered and be served by the next change.
    second, third = Callback(), Callback()
    waiters: dict[str, Waiter | Taken] = {}

    def first(taken: Taken) -> None:
        store.cancel(waiters["second"])
        waiters["third"] = fetch_or_wait(store, "x", third, remove=False,
                                               newer_than=taken.version)

    fetch_or_wait(store, "x", first, remove=False)
    waiters["second"] = fetch_or_wait(store, "x", second, remove=False)
    store.append("x", "a", 1)
    assert second.calls == []
    assert isinstance(waiters["third"], Waiter)
    assert store.n_waiters == 1
    store.append("x", "b", 1)
    assert [t.items for t in third.calls] == [("a", "b")]


# -- property test against a reference model -----------------------------------------------------
BINS = ("a", "b", "c")

op_strategy = st.one_of(
    st.tuples(st.just("put"), st.sampled_from(BINS), st.integers(0, 40)),
    st.tuples(st.just("append"), st.sampled_from(BINS), st.integers(0, 40)),
    st.tuples(st.just("get"), st.sampled_from(BINS), st.one_of(st.none(), st.integers(1, 4))),
    st.tuples(st.just("peek"), st.sampled_from(BINS), st.one_of(st.none(), st.integers(1, 4))),
    st.tuples(st.just("delete"), st.sampled_from(BINS), st.just(0)),
)


@settings(max_examples=300, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op_strategy, max_size=60),
       max_memory=st.one_of(st.none(), st.integers(0, 150)))
def test_store_matches_a_reference_model(ops, max_memory):
    store = Store(max_memory=max_memory)
    # model: bin -> [kind, [(item, nbytes), ...]]; versions: bin -> int
    model: dict[str, list] = {}
    versions: dict[str, int] = {}
    counter = 0

    def total() -> int:
        return sum(nb for _, entries in model.values() for _, nb in entries)

    for op, name, arg in ops:
        if op in ("put", "append"):
            counter += 1
            item, nb = counter, arg
            old = sum(n for _, n in model[name][1]) if (op == "put" and name in model) else 0
            growth = nb - old
            if max_memory is not None and growth > 0 and total() + growth > max_memory:
                with pytest.raises(MemoryLimitExceeded):
                    getattr(store, op)(name, item, nb)
            else:
                if op == "put":
                    model[name] = ["value", [(item, nb)]]
                else:
                    model.setdefault(name, ["list", []])
                    model[name][0] = "list"
                    model[name][1].append((item, nb))
                versions[name] = versions.get(name, 0) + 1
                assert getattr(store, op)(name, item, nb) == (versions[name], len(model[name][1]), 0)
        elif op in ("get", "peek"):
            remove = op == "get"
            if name not in model:
                with pytest.raises(BinNotFound):
                    fetch(store, name, remove=remove, max_items=arg)
            else:
                kind, entries = model[name]
                n = len(entries) if (arg is None or kind == "value") else min(arg, len(entries))
                expected = tuple(item for item, _ in entries[:n])
                if remove:
                    del entries[:n]
                    versions[name] = versions.get(name, 0) + 1
                    if not entries:
                        del model[name]
                t = fetch(store, name, remove=remove, max_items=arg)
                assert t.kind == kind
                assert t.items == expected
                assert t.version == versions[name]
                assert t.n_items == (len(model[name][1]) if name in model else 0)
        else:  # delete
            existed = name in model
            if existed:
                del model[name]
                versions[name] = versions.get(name, 0) + 1
            assert store.delete(name) == (existed, versions.get(name, 0))

        assert store.list() == {k: len(v[1]) for k, v in model.items()}
        assert store.nbytes == total()
        for b in BINS:
            assert store.version(b) == versions.get(b, 0)
            assert store.n_items(b) == (len(model[b][1]) if b in model else 0)
        if max_memory is not None:
            assert store.nbytes <= max_memory


# -- bounded bins ----------------------------------------------------------------------------------
from tensorshare.errors import BinFull  # noqa: E402, I001
from tensorshare.server.store import BinConfig, Blocked, Written  # noqa: E402


def test_reject_refuses_an_append_to_a_full_bin_and_changes_nothing(store, hook):
    store.configure("q", BinConfig(max_items=2))
    store.append("q", "a", 1)
    store.append("q", "b", 1)
    events = list(hook.events)
    with pytest.raises(BinFull, match=r"bin 'q' is full .*max_items=2"):
        store.append("q", "c", 1)
    assert isinstance(BinFull("x"), LimitExceeded)
    assert [t for t in get(store, "q").items] == ["a", "b"]
    assert hook.events[: len(events)] == events and len(hook.events) == len(events) + 1


def test_max_bytes_counts_item_sizes(store):
    store.configure("q", BinConfig(max_bytes=10))
    store.append("q", "a", 6)
    with pytest.raises(BinFull):
        store.append("q", "b", 5)
    store.append("q", "c", 4)
    with pytest.raises(BinFull, match="max_bytes=10"):
        store.append("q", "huge", 11)
    assert store.n_items("q") == 2


def test_drop_oldest_pushes_out_the_oldest_and_reports_how_many(store, hook):
    store.configure("q", BinConfig(max_items=3, overflow="drop_oldest"))
    for i in range(3):
        store.append("q", i, 1)
    assert store.append("q", 3, 1) == (4, 3, 1)
    assert hook.events[-1] == ("q", "append", 3, 4, 1)
    assert get(store, "q").items == (1, 2, 3)
    store.configure("b", BinConfig(max_bytes=10, overflow="drop_oldest"))
    store.append("b", "x", 4)
    store.append("b", "y", 4)
    assert store.append("b", "z", 8).dropped == 2
    assert store.nbytes == 8


def test_put_never_exceeds_max_bytes(store):
    store.configure("v", BinConfig(max_bytes=4))
    store.put("v", "ok", 4)
    with pytest.raises(BinFull):
        store.put("v", "too big", 5)
    assert peek(store, "v").items == ("ok",)


def test_block_waits_for_room_and_a_get_makes_it(store):
    store.configure("q", BinConfig(max_items=1, overflow="block"))
    assert isinstance(store.append_or_wait("q", [("a", 1, None)], lambda w: None), Written)
    served: list[Written] = []
    blocked = store.append_or_wait("q", [("b", 1, None)], served.append)
    assert isinstance(blocked, Blocked) and store.n_blocked == 1
    assert served == [] and store.n_items("q") == 1
    assert get(store, "q").items == ("a",)  # room: the blocked append is stored now
    assert [w.n_items for w in served] == [1] and store.n_blocked == 0
    assert peek(store, "q").items == ("b",)


def test_blocked_appends_keep_their_order_and_can_be_cancelled(store):
    store.configure("q", BinConfig(max_items=1, overflow="block"))
    store.append("q", 0, 1)
    out: list[int] = []
    b1 = store.append_or_wait("q", [(1, 1, None)], lambda w: out.append(1))
    b2 = store.append_or_wait("q", [(2, 1, None)], lambda w: out.append(2))
    b3 = store.append_or_wait("q", [(3, 1, None)], lambda w: out.append(3))
    assert store.cancel(b2) and not store.cancel(b2)
    assert isinstance(b1, Blocked) and isinstance(b3, Blocked)
    assert get(store, "q").items == (0,)
    assert get(store, "q").items == (1,)
    assert get(store, "q").items == (3,)
    assert out == [1, 3]


def test_configure_lifting_block_stores_the_waiting_appends(store):
    store.configure("q", BinConfig(max_items=1, overflow="block"))
    store.append("q", 0, 1)
    out: list[object] = []
    store.append_or_wait("q", [(1, 1, None)], out.append)
    store.configure("q", BinConfig())
    assert len(out) == 1 and isinstance(out[0], Written)
    assert get(store, "q").items == (0, 1)


def test_bad_bin_config_is_refused():
    with pytest.raises(ValueError):
        BinConfig(max_items=0)
    with pytest.raises(ValueError):
        BinConfig(overflow="evict")


# -- restore --------------------------------------------------------------------------------------
def test_restore_puts_items_back_in_front_in_their_order(store, hook):
    for i in range(4):
        store.append("q", i, 1, tag=i)
    taken = get(store, "q", max_items=2)
    store.append("q", 9, 1)
    v = store.restore("q", taken.kind, [(it, 1, tag) for it, tag in zip(taken.items, taken.tags, strict=True)])
    assert hook.events[-1] == ("q", "restore", 5, v)
    t = get(store, "q")
    assert t.items == (0, 1, 2, 3, 9) and t.tags == (0, 1, 2, 3, None)
    assert store.nbytes == 0


def test_restore_of_a_value_superseded_by_a_put_is_dropped(store):
    store.put("v", "old", 1)
    taken = get(store, "v")
    store.put("v", "new", 1)
    store.restore("v", "value", [(taken.items[0], 1, None)])
    assert peek(store, "v").items == ("new",)
    store.delete("v")
    store.restore("v", "value", [(taken.items[0], 1, None)])
    assert peek(store, "v").items == ("old",)


def test_describe_and_names(store):
    store.append("a/1", "x", 3)
    store.append("a/1", "y", 4)
    store.configure("b", BinConfig(max_items=5))
    d = store.describe("a/1")
    assert (d["kind"], d["n_items"], d["nbytes"], d["first"], d["last"]) == ("list", 2, 7, "x", "y")
    assert d["ops"] == {"append": 2} and d["bytes_in"] == 7
    assert store.names() == ["a/1", "b"] and store.names("a/*") == ["a/1"]
    assert store.describe("b")["kind"] == "empty"


def test_append_many_is_one_change_all_or_none(store, hook):
    store.configure("q", BinConfig(max_items=3))
    assert store.append_many("q", [("a", 1, 1), ("b", 1, 2)]) == (1, 2, 0)
    assert hook.events[-1] == ("q", "append", 2, 1)
    with pytest.raises(BinFull, match="full for 2 more items"):
        store.append_many("q", [("c", 1, None), ("d", 1, None)])
    assert get(store, "q").tags == (1, 2)
    with pytest.raises(BinFull, match="4 items do not fit"):
        store.append_many("q", [(i, 1, None) for i in range(4)])
    store.configure("d", BinConfig(max_items=3, overflow="drop_oldest"))
    store.append_many("d", [(i, 1, None) for i in range(3)])
    assert store.append_many("d", [(3, 1, None), (4, 1, None)]).dropped == 2
    assert get(store, "d").items == (2, 3, 4)


def test_a_blocked_batch_waits_for_room_for_all_of_it(store):
    store.configure("q", BinConfig(max_items=3, overflow="block"))
    store.append_many("q", [(0, 1, None), (1, 1, None), (2, 1, None)])
    out: list[object] = []
    assert isinstance(store.append_or_wait("q", [(3, 1, None), (4, 1, None)], out.append),
                      Blocked)
    assert get(store, "q", max_items=1).items == (0,)  # room for one only: still waiting
    assert out == []
    assert get(store, "q", max_items=1).items == (1,)
    assert len(out) == 1 and peek(store, "q").items == (2, 3, 4)
