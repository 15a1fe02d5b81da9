"""The dashboard in a real browser: Debian's Chromium, headless, driven by Playwright
(never a downloaded browser: ``executable_path`` is the system's). One browser for the whole
test session (the machine has 2 cores); each test gets a fresh context (cookies, cache).

Set ``TENSORSHARE_DASHBOARD_SCREENSHOT=docs/dashboard.png`` to write the README's screenshot
from :func:`test_every_view_stays_on_its_origin_with_no_console_error`.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from tensorshare import Client, EmbeddedServer, WaitTimeout
from tensorshare.dashboard import Dashboard
from tensorshare.server import ServerConfig
from tests.conftest import wait_until
from tests.dashboard.conftest import READ_TOKEN, WRITE_TOKEN

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
try:
    import playwright.sync_api  # noqa: F401

    PLAYWRIGHT = True
except ImportError:
    PLAYWRIGHT = False

pytestmark = [
    pytest.mark.browser,
    pytest.mark.xdist_group("browser"),  # one browser: these tests share one worker
    pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine (Debian: apt-get "
                                                "install chromium; .ci/run installs it)"),
    pytest.mark.skipif(not PLAYWRIGHT, reason="playwright is not installed (the test extra)"),
]

# Chromium on this machine: no sandbox (a container), no GPU, no shared memory to speak of,
# and nothing that reaches out to the network by itself. (Playwright gives each browser its
# own temporary profile, the --user-data-dir.)
FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync"]

XSS = "<img src=x onerror=alert(1)>"


# Module-scoped: Playwright's sync API keeps its event loop marked as running in this thread
# while it is started, which an asyncio test run after these by the same worker cannot share
# (the browser tests are one xdist group, run back to back; then the browser goes).
@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            yield b
        finally:
            b.close()


@dataclass
class Tab:
    """A page with everything it did recorded."""

    page: Any
    origin: str
    requests: list[str] = field(default_factory=list)
    console: list[tuple[str, str]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)
    navigations: int = 0

    def row(self, name: str) -> str:
        """A selector of bin ``name``'s row (the name escaped as CSS wants)."""
        return f"#bins tr[data-bin={self.page.evaluate('n => CSS.escape(n)', name)}]"

    def cell(self, name: str, column: str) -> str:
        return self.page.evaluate(
            "([n, c]) => { const r = Array.from(document.querySelectorAll('#bins tbody tr'))"
            ".find(tr => tr.dataset.bin === n); return r ? r.querySelector('td.' + c)"
            ".textContent : null; }", [name, column])

    def rate(self, name: str, column: str) -> float:
        text = self.cell(name, column)
        return 0.0 if text in (None, "-") else float(text.replace(",", ""))

    def events(self) -> list[str]:
        return [u for u in self.requests if u.split("?")[0].endswith("/events")]


@pytest.fixture
def open_tab(browser: Any) -> Iterator[Any]:
    contexts = []

    def open_(dash: Dashboard, url: str | None = None) -> Tab:
        context = browser.new_context(viewport={"width": 1440, "height": 1000})
        contexts.append(context)
        page = context.new_page()
        tab = Tab(page, dash.url.rstrip("/"))
        page.on("request", lambda r: tab.requests.append(r.url))
        page.on("console", lambda m: tab.console.append((m.type, m.text)))
        page.on("pageerror", lambda e: tab.errors.append(str(e)))

        def dialog(d: Any) -> None:
            tab.dialogs.append(d.message)
            d.dismiss()

        page.on("dialog", dialog)

        def navigated(frame: Any) -> None:
            if frame == page.main_frame:
                tab.navigations += 1

        page.on("framenavigated", navigated)
        page.goto(url or dash.login_url)
        page.wait_for_selector("#status.live", timeout=15_000)
        return tab

    yield open_
    for c in contexts:
        c.close()


@pytest.fixture
def dash(secured: EmbeddedServer) -> Iterator[Dashboard]:
    with Dashboard(f"127.0.0.1:{secured.port}", port=0, read_token=READ_TOKEN) as d:
        yield d


def _writer(server: EmbeddedServer) -> Client:
    return Client("127.0.0.1", server.port, token=WRITE_TOKEN)


@pytest.mark.timeout(90)
def test_a_put_of_three_items_shows_within_3_s_without_a_reload_over_one_event_stream(
        secured: EmbeddedServer, dash: Dashboard, open_tab: Any) -> None:
    tab = open_tab(dash)
    page = tab.page
    # Logged in: the token became an HttpOnly, SameSite=Strict cookie; the URL is clean.
    assert page.url == dash.url and "token" not in page.url
    (cookie,) = page.context.cookies()
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert page.evaluate("document.cookie") == ""  # out of the script's reach
    page.evaluate("window.__sameDocument = true")
    with _writer(secured) as c:
        assert tab.cell("rollouts", "items") is None
        for i in range(3):
            c.append("rollouts", {"obs": torch.full((4,), float(i))})
        # Within 3 s, in place: no reload, no navigation.
        page.wait_for_function(
            "() => Array.from(document.querySelectorAll('#bins tbody tr')).some(tr => "
            "tr.dataset.bin === 'rollouts' && tr.querySelector('td.items').textContent === '3'"
            " && tr.querySelector('td.version').textContent === '3')", timeout=3000)
        # A bin's rates are known from its second listing on (as in tensorshare monitor).
        c.append("rollouts", {"obs": torch.zeros(4)})
        wait_until(lambda: tab.rate("rollouts", "append") > 0, 10, "append/s > 0")
        c.get("rollouts", max_items=1)  # and a get: one item less, at once
        page.wait_for_function(
            "() => Array.from(document.querySelectorAll('#bins tbody tr')).some(tr => "
            "tr.dataset.bin === 'rollouts' && tr.querySelector('td.items').textContent === '3')",
            timeout=3000)
    assert page.evaluate("window.__sameDocument") is True
    assert page.evaluate("performance.getEntriesByType('navigation').length") == 1
    assert len(tab.events()) == 1  # one event stream, not a polling storm
    assert not tab.errors and not [m for m in tab.console if m[0] == "error"]


@pytest.mark.timeout(90)
def test_a_lagging_stream_consumer_shows_its_lag(secured: EmbeddedServer, dash: Dashboard,
                                                 open_tab: Any) -> None:
    with _writer(secured) as c:
        opened = c.stream_open("data/train", window=16)
        c.stream_join("data/train", "fast")
        c.stream_join("data/train", "slow")
        c.stream_append("data/train", [torch.zeros(2)] * 5, epoch=opened.epoch)
        c.stream_read("data/train", "fast", max_items=5)
        with pytest.raises(WaitTimeout):  # reading on acknowledges the five
            c.stream_read("data/train", "fast", at=5)
        tab = open_tab(dash)

        def lag(consumer: str) -> Any:
            return tab.page.evaluate(
                "n => { const r = document.querySelector('#streams tr[data-consumer=\"' + n + "
                "'\"] td.lag'); return r ? [r.textContent, r.classList.contains('lagging')]"
                " : null; }", consumer)

        wait_until(lambda: lag("slow") == ["5", True], 10, "the slow consumer's lag")
        assert lag("fast") == ["0", False]
        assert tab.page.is_visible("#streams-view")


@pytest.mark.timeout(90)
def test_a_bin_named_like_html_shows_as_text_and_no_dialog_opens(
        secured: EmbeddedServer, dash: Dashboard, open_tab: Any) -> None:
    tab = open_tab(dash)
    with _writer(secured) as c:
        c.put(XSS, {"<b onmouseover=alert(2)>k</b>": torch.zeros(1)})
        c.append("<script>alert(3)</script>", 1)
        c.append("<script>alert(3)</script>", 2)
    wait_until(lambda: tab.cell(XSS, "name") == XSS, 10, "the bin's row")
    assert tab.cell(XSS, "first") == "{<b onmouseover=alert(2)>k</b>: float32[1]}"
    assert tab.cell("<script>alert(3)</script>", "name") == "<script>alert(3)</script>"
    page = tab.page
    assert page.evaluate("document.querySelectorAll('main img, main b, main script').length") \
        == 0
    page.hover(tab.row(XSS) + " td.first")
    page.evaluate("0")  # a round trip: any dialog the hover opened is reported before it
    assert tab.dialogs == [] and not tab.errors


@pytest.mark.timeout(120)
def test_every_view_stays_on_its_origin_with_no_console_error(
        secured: EmbeddedServer, dash: Dashboard, open_tab: Any) -> None:
    stop = threading.Event()
    with _writer(secured) as c, _writer(secured) as host:
        _populate(c)
        # (A queue drained as soon as it is filled is listed by the server only while some
        # client listens to it: let the dashboard see it full once, and listen.)
        wait_until(lambda: dash.call(lambda: "rollouts" in dash.upstreams[0].listening), 10,
                   "the dashboard listening to the queue")
        workers = [threading.Thread(target=_serve_policy, args=(host, stop), daemon=True),
                   threading.Thread(target=_traffic, args=(c, stop), daemon=True)]
        for w in workers:
            w.start()
        try:
            tab = open_tab(dash)
            page = tab.page
            for view in ("#streams-view", "#services-view", "#ops-view"):
                page.wait_for_selector(view, state="visible", timeout=10_000)
            wait_until(lambda: tab.cell("rl/parameters", "items") == "1", 10, "the bins")
            wait_until(lambda: tab.rate("rollouts", "get") > 0, 15, "rates")
            wait_until(lambda: page.evaluate(
                "document.querySelectorAll('#services tbody tr').length") == 1, 10, "service")
            shot = os.environ.get("TENSORSHARE_DASHBOARD_SCREENSHOT")
            # A few more ticks of every view (the README's picture: enough for its charts).
            ticks = _ticks(page) + (20 if shot else 3)
            wait_until(lambda: _ticks(page) >= ticks, 40, "more ticks")
            if shot:
                page.screenshot(path=str(Path(shot)), full_page=True)
        finally:
            stop.set()
            for w in workers:
                w.join(10)
    assert tab.requests and all(u.startswith(tab.origin + "/") for u in tab.requests), \
        tab.requests
    assert not tab.errors and not [m for m in tab.console if m[0] == "error"], tab.console
    assert len(tab.events()) == 1
    assert page.evaluate("document.querySelectorAll('form').length") == 0
    assert page.evaluate("Array.from(document.querySelectorAll('input, button, select, "
                         "textarea')).map(e => e.id)") == ["filter"]  # the only input
    page.fill("#filter", "roll")
    assert page.evaluate("Array.from(document.querySelectorAll('#bins tbody tr'))"
                         ".filter(tr => !tr.hidden).map(tr => tr.dataset.bin)") == ["rollouts"]


@pytest.mark.timeout(120)
def test_a_server_restart_shows_the_banner_then_numbers_resume(
        tmp_path: Path, free_port: int, open_tab: Any) -> None:
    def start() -> EmbeddedServer:
        return EmbeddedServer(port=free_port, config=ServerConfig(data_dir=str(tmp_path)))

    srv = start()
    with Client("127.0.0.1", free_port) as c:
        c.put("weights", torch.zeros(3))
    with Dashboard(f"127.0.0.1:{free_port}", port=0) as d:
        tab = open_tab(d)
        page = tab.page
        wait_until(lambda: tab.cell("weights", "version") == "1", 10, "the bin")
        assert page.is_hidden("#banner")
        srv.stop()
        page.wait_for_selector("#banner", state="visible", timeout=15_000)
        assert "unreachable" in page.text_content("#banner")
        assert tab.cell("weights", "version") == "1"  # the last numbers stay meanwhile
        srv = start()
        try:
            with Client("127.0.0.1", free_port) as c:
                c.put("weights", torch.ones(3))
            page.wait_for_selector("#banner", state="hidden", timeout=20_000)
            wait_until(lambda: tab.cell("weights", "version") == "2", 10, "numbers resume")
            page.wait_for_selector("#status.live", timeout=5000)
        finally:
            srv.stop()
    assert not tab.errors


@pytest.mark.long
@pytest.mark.timeout(120)
def test_with_the_page_open_for_30_s_the_server_counts_no_write_from_it(
        secured: EmbeddedServer, dash: Dashboard, open_tab: Any) -> None:
    with _writer(secured) as c:
        c.put("weights", torch.zeros(3))
        c.append("queue", 1)
        before = c.stats()["server"]["requests"]
    tab = open_tab(dash)
    tab.page.wait_for_timeout(30_000)  # the soak itself: 30 s of the page, live
    with _writer(secured) as c:
        after = c.stats()["server"]["requests"]
    changed = {op: after.get(op, 0) - before.get(op, 0) for op in after
               if after.get(op, 0) != before.get(op, 0)}
    # Only reads: the dashboard's stats every second and its listens (and our own stats,
    # and the bye that closed our first client's session after it counted).
    assert set(changed) <= {"stats", "listen", "unlisten", "ping", "hello", "bye"}, changed
    assert changed["stats"] >= 25
    assert tab.cell("queue", "items") == "1"


# -- what the busy page shows ------------------------------------------------------------------
def _ticks(page: Any) -> int:
    """The server's stats requests as the page shows them: one more per tick."""
    text = page.evaluate("(() => { const r = document.querySelector('#ops tr[data-op=stats] "
                         "td.requests'); return r ? r.textContent : '0'; })()")
    return int(text)


def _populate(c: Client) -> None:
    c.put("rl/parameters", {"policy": torch.randn(256, 256), "step": 1200})
    c.put("rl/normalizer", {"mean": torch.zeros(64), "std": torch.ones(64)})
    for _ in range(4):
        c.append("rollouts", {"obs": torch.randn(128, 64), "reward": torch.randn(128)})
    c.put(XSS, torch.zeros(1))
    opened = c.stream_open("data/train", window=64)
    c.stream_join("data/train", "trainer-0")
    c.stream_join("data/train", "trainer-1")
    c.stream_append("data/train", [torch.zeros(32, 3, 8, 8)] * 12, epoch=opened.epoch)
    c.stream_read("data/train", "trainer-0", max_items=12)
    with pytest.raises(WaitTimeout):
        c.stream_read("data/train", "trainer-0", at=12)


def _traffic(c: Client, stop: threading.Event) -> None:
    while not stop.is_set():
        c.append("rollouts", {"obs": torch.randn(128, 64), "reward": torch.randn(128)})
        c.get("rollouts")
        c.peek("rl/parameters")
        c.service_call("policy", torch.randn(8, 4), rows=8)
        stop.wait(0.02)


def _serve_policy(host: Client, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            batch = host.service_take("policy", max_batch=64, timeout=0.5)
        except WaitTimeout:
            continue
        host.service_reply("policy", batch.batch, [v * 2 for v in batch.values])


@pytest.mark.timeout(90)
def test_a_primary_and_its_replica_show_role_term_each_replicas_lag_and_resyncs(
        open_tab: Any) -> None:
    with EmbeddedServer(0) as primary, \
            EmbeddedServer(0, replica_of=f"127.0.0.1:{primary.port}") as replica, \
            Client("127.0.0.1", primary.port) as c, Client("127.0.0.1", replica.port) as r:
        wait_until(lambda: r.stats()["server"]["replication"]["synced"], 20, "in sync")
        c.put("w", torch.zeros(4))
        offset = c.stats()["server"]["replication"]["offset"]
        wait_until(lambda: r.stats()["server"]["replication"]["offset"] == offset, 20,
                   "the replica caught up")
        (address,) = [x["address"] for x in c.stats()["server"]["replication"]["replicas"]]
        with Dashboard([f"127.0.0.1:{primary.port}", f"127.0.0.1:{replica.port}"], port=0,
                       interval=0.2) as dash:
            tab = open_tab(dash, dash.url)

            def fact(index: int) -> Any:
                return tab.page.evaluate(
                    "i => { const v = document.querySelector('.card[data-server=\"' + i + "
                    "'\"] .fact-replication'); return v && !v.parentNode.hidden ? "
                    "v.textContent : null; }", index)

            want = (f"primary, term 0, offset {offset}; {address} at {offset}, lag 0 B / "
                    f"0.000 s; resyncs 1 full, 0 partial")
            wait_until(lambda: fact(0) == want, 15, f"the primary's card to say {want!r}")
            wait_until(lambda: (fact(1) or "").startswith(
                f"replica, term 0, offset {offset}; replica of 127.0.0.1:{primary.port}, "
                f"lag "), 15, "the replica's card")
            assert (fact(1) or "").endswith("s; resyncs 1 full, 0 partial")
            assert not tab.errors and not [m for m in tab.console if m[0] == "error"]
