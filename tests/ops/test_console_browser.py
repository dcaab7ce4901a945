"""The console in a real browser (Playwright driving Debian's Chromium): an
operator finds a dead message, edits and retries it, and sees it published
by the real `relay outbox --once` on the real RabbitMQ; every page fits a
390 px wide phone.

RELAY_SCREENSHOTS=docs/console makes it save a screenshot of each page there
(that is how the README's pictures are made).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import free_port, rows, wait_until
from tests.ops.test_dead import dead_inbox, dead_outbox

CHROMIUM = "/usr/bin/chromium"
TOKEN = "browser-test-token"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SHOTS = os.environ.get("RELAY_SCREENSHOTS")


@pytest.fixture
async def browser() -> AsyncIterator[Any]:
    if not shutil.which(CHROMIUM):
        message = f"{CHROMIUM} is missing (apt-get install chromium)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    from playwright.async_api import async_playwright

    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield browser
        await browser.close()


@pytest.fixture
def console_url(start_relay: Any) -> str:
    """`relay console` with a token, as an operator starts it."""
    return serve_console(start_relay, env={"RELAY_CONSOLE_TOKEN": TOKEN})


def serve_console(start_relay: Any, *args: str, env: dict[str, str] | None = None) -> str:
    """Start `relay console` on a free port; its URL once it answers."""
    import urllib.request

    port = free_port()
    proc = start_relay("console", "--port", str(port), *args, env=env)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            with urllib.request.urlopen(url + "/static/console.css", timeout=2):
                return True
        except OSError:
            assert proc.proc.poll() is None, proc.log
            return False

    wait_until(up, timeout=30)
    return url


async def shot(page: Any, name: str) -> None:
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        await page.screenshot(path=str(Path(SHOTS) / f"{name}.png"), full_page=True)


async def test_find_edit_and_retry_a_dead_message_until_it_is_published(
    engine, rabbit, run_relay, browser, console_url
):
    queue = await rabbit.queue("orders.#")
    [row_id] = dead_outbox(
        engine,
        payload='{"order_id": "seven", "note": "<script>x</script>"}',
        error="PayloadRejected: order_id must be a number\n  (schema v3)",
    )
    dead_outbox(
        engine,
        key="customer-9",
        topic="billing.charge",
        error="NOT_FOUND - no exchange 'billing' in vhost '/'",
    )
    dead_inbox(engine, "m-41", consumer="billing")
    dead_inbox(engine, "m-42", consumer="billing", payload=None, body=b"\xffnot json")
    rows(
        engine,
        "INSERT INTO outbox (topic, payload, status, published_at) "
        "SELECT 'orders.placed', '{}', 'published', now() - i * interval '37 seconds' "
        "FROM generate_series(1, 400) i",
    )
    page = await browser.new_page(viewport={"width": 1100, "height": 800})
    alerts: list[str] = []
    page.on("dialog", lambda d: alerts.append(d.message))

    await page.goto(console_url + "/")
    assert await page.locator("h2", has_text="outbox").count() == 1
    await shot(page, "overview")
    await page.get_by_role("link", name="Dead messages").click()
    await page.get_by_text("PayloadRejected: order_id must be a number").first.wait_for()
    await shot(page, "dead")
    await page.get_by_role("link", name=row_id).click()
    # The payload is shown as text: its script tag is on the page, not run.
    await page.get_by_text('"note": "<script>x</script>"').wait_for()
    await page.fill("input[name=token]", TOKEN)
    await page.get_by_role("button", name="sign in").click()
    await page.get_by_role("button", name="Retry…", exact=True).wait_for()
    await shot(page, "message")

    await page.get_by_role("button", name="Edit and retry…").click()
    await page.fill("textarea[name=payload]", '{"order_id": 7}')
    await shot(page, "edit")
    await page.get_by_role("button", name="Edit and retry…").click()
    await page.get_by_role("button", name="Yes, edit and retry").wait_for()
    await shot(page, "confirm")
    assert rows(engine, "SELECT status FROM outbox WHERE id = CAST(:i AS uuid)", i=row_id) == [
        ("dead",)
    ]
    await page.get_by_role("button", name="Yes, edit and retry").click()
    await page.get_by_text(f"Edited and retried outbox row {row_id}").wait_for()
    await shot(page, "done")

    result = run_relay("outbox", "--once", "--exchange", rabbit.exchange)
    assert result.returncode == 0, result.stderr
    [message] = await rabbit.drain(queue, 1)
    assert json.loads(message.body) == {"order_id": 7} and message.message_id == row_id
    assert rows(engine, "SELECT status FROM outbox WHERE id = CAST(:i AS uuid)", i=row_id) == [
        ("published",)
    ]
    await page.goto(console_url + "/dead?table=outbox")
    await page.get_by_text("1 dead outbox row match").wait_for()  # the other one
    await page.goto(console_url + "/message?table=inbox&id=m-42&consumer=billing")
    await shot(page, "raw-body")
    await page.goto(console_url + "/keys")
    await page.get_by_text("customer-9").wait_for()
    await shot(page, "keys")
    assert alerts == []


async def test_every_page_fits_a_390_px_phone(engine, browser, console_url):
    [row_id] = dead_outbox(
        engine,
        key="a-rather-long-key-" + "x" * 80,
        payload='{"long": "' + "y" * 300 + '"}',
        error="AVeryLongExceptionName: " + "z" * 300,
    )
    dead_inbox(engine, "m-" + "9" * 120, consumer="a-consumer-with-a-long-name-" + "c" * 40)
    page = await browser.new_page(viewport={"width": 390, "height": 844})
    paths = [
        "/",
        "/dead",
        "/keys",
        f"/message?table=outbox&id={row_id}",
        f"/edit?table=outbox&id={row_id}",
        "/message?table=inbox&id=nope",
        "/replay",
        "/audit",
    ]
    for path in paths:
        await page.goto(console_url + path)
        width = await page.evaluate("document.scrollingElement.scrollWidth")
        assert width <= 390, (path, width)
    await page.goto(console_url + "/dead")
    await shot(page, "phone-dead")


async def test_retry_a_non_json_inbox_message_until_its_handler_processed_it(
    effects, rabbit, inbox, browser, console_url
):
    daemon = inbox()
    await rabbit.publish("t", b"<not json/>", message_id="raw-7", type="RawBody")
    wait_until(
        lambda: rows(effects, "SELECT 1 FROM inbox WHERE message_id = 'raw-7' AND status = 'dead'"),
        timeout=30,
    )
    page = await browser.new_page()
    await page.goto(console_url + "/dead?table=inbox")
    await page.get_by_role("link", name="raw-7").click()
    await page.get_by_text("<not json/>").wait_for()  # the raw body, as text
    await page.fill("input[name=token]", TOKEN)
    await page.get_by_role("button", name="sign in").click()
    await page.get_by_role("button", name="Retry…", exact=True).click()
    await page.get_by_role("button", name="Yes, retry").click()
    await page.get_by_text("Retried inbox row raw-7").wait_for()

    seen = wait_until(
        lambda: rows(effects, "SELECT key FROM effects WHERE message_id = 'raw-7'"), timeout=30
    )
    assert seen == [("body:" + b"<not json/>".hex(),)]
    await page.goto(console_url + "/")
    card = page.locator("section.card", has_text="inbox · " + daemon.queue)
    assert "processed, last hour 1" in " ".join((await card.inner_text()).split())
    assert rows(effects, "SELECT status FROM inbox WHERE message_id = 'raw-7'") == [("processed",)]


async def test_a_viewer_reads_an_operator_replays_and_the_audit_page_says_who(
    engine, rabbit, run_relay, browser, start_relay, tmp_path
):
    """Named operators (--console-tokens): the viewer sees the replay form
    disabled; the operator replays a topic's published rows, which the real
    `relay outbox --once` publishes again; the Audit page names the operator."""
    import hashlib

    tokens = tmp_path / "tokens"
    tokens.write_text(
        "".join(
            f"{name} {role} {hashlib.sha256(token.encode()).hexdigest()}\n"
            for name, role, token in [
                ("alice", "operator", "alice-secret"),
                ("victor", "viewer", "victor-secret"),
            ]
        )
    )
    url = serve_console(start_relay, "--console-tokens", str(tokens))
    queue = await rabbit.queue("orders.#")
    rows(
        engine,
        "INSERT INTO outbox (topic, key, payload, status, published_at) "
        "SELECT CASE WHEN i <= 5 THEN 'orders.placed' ELSE 'billing.charge' END, 'k', "
        "jsonb_build_object('i', i), 'published', now() FROM generate_series(1, 8) i",
    )

    viewer = await browser.new_page(viewport={"width": 390, "height": 844})
    await viewer.goto(url + "/replay")
    await viewer.fill("input[name=token]", "victor-secret")
    await viewer.get_by_role("button", name="sign in").click()
    await viewer.get_by_text("victor is a viewer: read only.").wait_for()
    assert await viewer.get_by_role("button", name="Replay…").is_disabled()

    page = await browser.new_page(viewport={"width": 1100, "height": 800})
    await page.goto(url + "/replay")
    await page.fill("input[name=token]", "alice-secret")
    await page.get_by_role("button", name="sign in").click()
    await page.fill("input[name=topic]", "orders.*")
    await page.get_by_role("button", name="Replay…").click()
    await page.get_by_text("Replay 5 outbox rows matching topic = orders.*?").wait_for()
    await shot(page, "replay-confirm")
    await page.get_by_role("button", name="Yes, replay").click()
    await page.get_by_text("Replayed 5 outbox rows").wait_for()

    result = run_relay("outbox", "--once", "--exchange", rabbit.exchange)
    assert result.returncode == 0, result.stderr
    got = await rabbit.drain(queue, 5)
    assert [json.loads(m.body)["i"] for m in got] == [1, 2, 3, 4, 5]  # in key order

    await page.get_by_role("link", name="Audit").click()
    entry = page.locator("ol.audit li").first
    await entry.wait_for()
    text = " ".join((await entry.inner_text()).split())
    assert "alice (console) · replay" in text and "outbox 5 rows filter topic=orders.*" in text
    await shot(page, "audit")
    await viewer.goto(url + "/audit")
    assert await viewer.locator("ol.audit li").count() == 1
    width = await viewer.evaluate("document.scrollingElement.scrollWidth")
    assert width <= 390


async def test_the_sources_table_fits_a_390_px_phone(engine, browser, start_relay, database):
    """Several sources: a long database name and one whose database is away
    (its row says so) beside the counts of the others."""
    dead_outbox(engine, 3)
    away = database.rsplit("/", 1)[0] + "/a-tenant-database-with-a-long-name-" + "d" * 30
    url = serve_console(
        start_relay, "--database-url", database, "--database-url", away, "--schema", "public"
    )
    page = await browser.new_page(viewport={"width": 390, "height": 844})
    await page.goto(url + "/")
    assert await page.locator("table.sources tbody tr").count() == 2
    await page.get_by_text("cannot reach this source's database").wait_for()
    width = await page.evaluate("document.scrollingElement.scrollWidth")
    assert width <= 390, width
    await page.locator("table.sources a").first.click()
    await page.get_by_text("orders.placed").first.wait_for()
    assert "source=" in page.url
    width = await page.evaluate("document.scrollingElement.scrollWidth")
    assert width <= 390, width
    await shot(page, "phone-sources")


async def test_a_cookie_computed_from_the_tokens_file_does_not_sign_chromium_in(
    engine, run_relay, browser, start_relay, tmp_path
):
    """Issue 45's attack in a real browser: the cookie the old console made
    from the file's hash (HMAC keyed by it) is refused; the real session
    cookie is out of the page's reach (HttpOnly), SameSite=Strict, not
    Secure over plain http, and ends with an expired session (a short
    --console-session-max) and with a new token for that person."""
    import hashlib
    import hmac
    import time

    [row_id] = dead_outbox(engine)
    digest = hashlib.sha256(b"alice-secret").hexdigest()
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice operator {digest}\n")
    url = serve_console(start_relay, "--console-tokens", str(tokens), "--console-session-max", "6s")

    def old(purpose: str) -> str:
        message = f"relay-console:{purpose}:alice".encode()
        return hmac.new(digest.encode(), message, hashlib.sha256).hexdigest()

    mallory = await browser.new_context()
    forged = {"name": "relay_console", "value": "alice." + old("session"), "url": url}
    await mallory.add_cookies([forged])
    page = await mallory.new_page()
    await page.goto(url + f"/message?table=outbox&id={row_id}")
    await page.get_by_role("button", name="sign in").wait_for()
    assert await page.get_by_role("button", name="Retry…", exact=True).count() == 0
    assert await mallory.cookies() == []  # the refused cookie was dropped
    await mallory.add_cookies([forged])
    form = {"action": "retry", "table": "outbox", "id": row_id, "confirm": "yes"}
    refused = await mallory.request.post(
        url + "/action", form={**form, "csrf": old("csrf")}, headers={"origin": url}
    )
    assert refused.status == 403 and "Sign in" in await refused.text()
    assert rows(engine, "SELECT status FROM outbox WHERE id = CAST(:i AS uuid)", i=row_id) == [
        ("dead",)
    ]

    alice = await browser.new_context()
    page = await alice.new_page()
    await page.goto(url + f"/message?table=outbox&id={row_id}")
    await page.fill("input[name=token]", "alice-secret")
    await page.get_by_role("button", name="sign in").click()
    await page.get_by_role("button", name="Retry…", exact=True).wait_for()
    # Signed in by now: the session began before this (taken before the
    # sign-in instead, a loaded machine's slow page left it under 6 s old).
    signed_in_by = time.monotonic()
    [cookie] = await alice.cookies()
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and not cookie["secure"]
    assert cookie["value"] != "alice." + old("session")
    assert await page.evaluate("document.cookie") == ""
    # Past the absolute limit the browser holds no session and the page offers sign-in.
    time.sleep(max(0.0, signed_in_by + 7 - time.monotonic()))
    await page.goto(url + f"/message?table=outbox&id={row_id}")
    await page.get_by_role("button", name="sign in").wait_for()
    assert await page.get_by_role("button", name="Retry…", exact=True).count() == 0

    # Signed in again, then a new token for alice in the file: the page asks her to sign in.
    await page.fill("input[name=token]", "alice-secret")
    await page.get_by_role("button", name="sign in").click()
    await page.get_by_role("button", name="Retry…", exact=True).wait_for()
    tokens.write_text(f"alice operator {hashlib.sha256(b'alice-new').hexdigest()}\n")
    await page.reload()
    await page.get_by_role("button", name="sign in").wait_for()
    assert rows(engine, "SELECT status FROM outbox WHERE id = CAST(:i AS uuid)", i=row_id) == [
        ("dead",)
    ]
    assert run_relay("audit", "--json").stdout.strip() == "[]"
