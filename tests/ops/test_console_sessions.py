"""The console's sessions from the outside: a real `relay console` process,
spoken to with httpx as a browser and as an attacker would. What the tokens
file holds (names and token hashes) makes no cookie and no CSRF field that
acts; a session ends when unused for --console-session-idle, at
--console-session-max after sign-in, when its person's token changes or
their line leaves the file, and when they sign out; the cookie is HttpOnly,
SameSite=Strict and Secure over https (or a trusted proxy's word for it);
nothing on the pages, in the file or in the log acts. The last part tests
relay.console.sessions alone with a clock of its own (renewal)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import re
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from relay.console.guard import COOKIE
from relay.console.operators import Operator
from relay.console.sessions import Expired, Sessions
from tests.conftest import RelayProcess, free_port, wait_until
from tests.ops.test_audit import trail
from tests.ops.test_dead import dead_outbox, statuses

ALICE, BOB, VICTOR = "alice-session-token-1", "bob-session-token-2", "victor-session-token-3"
SIGNED_IN = "sign out"  # the header's button, shown to a signed-in person
SIGN_IN_FORM = 'name="token"'


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def team_file(tmp_path: Path, **people: tuple[str, str]) -> Path:
    """A tokens file: name -> (role, token)."""
    path = tmp_path / "tokens"
    write_team(path, **people)
    return path


def write_team(path: Path, **people: tuple[str, str]) -> None:
    path.write_text("".join(f"{n} {role} {sha(t)}\n" for n, (role, t) in people.items()))


def start_console(
    start_relay: Callable[..., RelayProcess], *args: str, env: dict[str, str] | None = None
) -> tuple[str, RelayProcess]:
    """`relay console` on a free port: its URL once it answers, and the process."""
    port = free_port()
    proc = start_relay("console", "--port", str(port), *args, env=env)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(url + "/static/console.css", timeout=2).status_code == 200
        except httpx.TransportError:
            assert proc.proc.poll() is None, proc.log
            return False

    wait_until(up, timeout=30)
    return url, proc


def browser(url: str) -> httpx.Client:
    """A client that sends its cookies back and says where it comes from, as a browser."""
    return httpx.Client(base_url=url, headers={"origin": url}, timeout=30)


def sign_in(url: str, token: str) -> tuple[httpx.Client, httpx.Response]:
    c = browser(url)
    response = c.post("/login", data={"token": token})
    assert response.status_code == 303, response.text
    return c, response


def csrf_of(page: str) -> str:
    match = re.search(r'name="csrf" value="([0-9a-f]+)"', page)
    assert match, "no CSRF field on the page"
    return match.group(1)


def retry(c: httpx.Client, row_id: str, csrf: str) -> httpx.Response:
    data = {"action": "retry", "table": "outbox", "id": row_id, "confirm": "yes", "csrf": csrf}
    return c.post("/action", data=data)


def with_cookie(url: str, value: str) -> httpx.Client:
    c = browser(url)
    c.cookies.set(COOKIE, value, domain="127.0.0.1")
    return c


def old_mac(name: str, digest: str, purpose: str) -> str:
    """What the console before this change (Guard._mac) signed with: the
    token's hash from the file."""
    message = f"relay-console:{purpose}:{name}".encode()
    return hmac.new(digest.encode(), message, hashlib.sha256).hexdigest()


def v1_keyed_by(key: bytes, name: str, digest: str) -> str:
    """A cookie in today's format, as someone who read the code would make one
    with the key guessed from the file."""
    now = int(time.time() * 1000)
    payload = base64.urlsafe_b64encode(json.dumps([name, now, now, "n" * 22]).encode())
    text = payload.rstrip(b"=").decode()
    message = f"relay-console-session\0{text}\0{name}\0{digest}".encode()
    mac = base64.urlsafe_b64encode(hmac.new(key, message, hashlib.sha256).digest())
    return f"v1.{text}.{mac.rstrip(b'=').decode()}"


def set_cookies(response: httpx.Response) -> list[str]:
    return [v for v in response.headers.get_list("set-cookie") if v.startswith(COOKIE + "=")]


def flags(header: str) -> set[str]:
    return {part.strip().lower() for part in header.split(";")[1:]}


# -- what the tokens file holds ------------------------------------------------------


def test_a_cookie_or_csrf_field_made_from_the_tokens_file_is_refused(
    engine, start_relay, run_relay, tmp_path
):
    """The attack of issue 45: read the file, compute alice's cookie and CSRF
    field as the old Guard._mac did (and in today's format, keyed by what the
    file holds), retry a dead row under her name."""
    [row_id] = dead_outbox(engine)
    tokens = team_file(tmp_path, alice=("operator", ALICE))
    url, proc = start_console(start_relay, "--console-tokens", str(tokens))
    digest = sha(ALICE)

    alice, _ = sign_in(url, ALICE)
    real = alice.cookies[COOKIE]
    assert SIGNED_IN in alice.get("/").text
    old_cookie = urllib.parse.quote("alice") + "." + old_mac("alice", digest, "session")
    assert real != old_cookie

    forged = [
        (old_cookie, old_mac("alice", digest, "csrf")),
        (v1_keyed_by(digest.encode(), "alice", digest), old_mac("alice", digest, "csrf")),
        (v1_keyed_by(bytes.fromhex(digest), "alice", digest), old_mac("alice", digest, "csrf")),
        # a real cookie's payload with the MAC swapped for one made from the file
        (real.rsplit(".", 1)[0] + "." + old_mac("alice", digest, "session"), "0" * 64),
    ]
    for cookie, csrf in forged:
        with with_cookie(url, cookie) as mallory:
            page = mallory.get(f"/message?table=outbox&id={row_id}")
            assert SIGNED_IN not in page.text and SIGN_IN_FORM in page.text
            # the refused cookie is dropped, not renewed
            [dropped] = set_cookies(page)
            assert "max-age=0" in flags(dropped)
        with with_cookie(url, cookie) as mallory:
            refused = retry(mallory, row_id, csrf)
            assert refused.status_code == 403 and "Sign in" in refused.text
    assert statuses(engine, "outbox")[row_id] == "dead"
    assert trail(run_relay) == []  # nobody it knows: nothing written under alice's name
    assert "refused a session cookie it did not make" in proc.log
    # Alice herself still acts, with the field of her own session.
    csrf = csrf_of(alice.get(f"/message?table=outbox&id={row_id}").text)
    assert retry(alice, row_id, csrf).status_code == 200
    assert statuses(engine, "outbox")[row_id] == "pending"
    assert [(e["actor"], e["action"]) for e in trail(run_relay)] == [("alice", "retry")]


def test_the_csrf_field_belongs_to_one_session(engine, start_relay, tmp_path):
    """Two sessions of one person: each one's field fails with the other's cookie."""
    [row_id] = dead_outbox(engine)
    tokens = team_file(tmp_path, alice=("operator", ALICE))
    url, _ = start_console(start_relay, "--console-tokens", str(tokens))
    first, _ = sign_in(url, ALICE)
    second, _ = sign_in(url, ALICE)
    page = f"/message?table=outbox&id={row_id}"
    first_csrf, second_csrf = csrf_of(first.get(page).text), csrf_of(second.get(page).text)
    assert first_csrf != second_csrf
    refused = retry(first, row_id, second_csrf)
    assert refused.status_code == 403 and "CSRF" in refused.text
    assert statuses(engine, "outbox")[row_id] == "dead"
    assert retry(first, row_id, first_csrf).status_code == 200


def test_nothing_in_the_file_the_pages_or_the_log_lets_anyone_act(
    engine, start_relay, run_relay, tmp_path
):
    """Every long word of the tokens file, of every page a signed-in operator
    saw (their CSRF field included) and of the console's log, tried as a
    token, a bearer token and a session cookie: none acts. The session
    cookie and the secret appear on no page and in no log line."""
    [row_id, other] = dead_outbox(engine, 2)
    secret = tmp_path / "secret"
    secret.write_text(os.urandom(32).hex())
    tokens = team_file(tmp_path, alice=("operator", ALICE), victor=("viewer", VICTOR))
    url, proc = start_console(
        start_relay, "--console-tokens", str(tokens), "--console-secret-file", str(secret)
    )
    alice, _ = sign_in(url, ALICE)
    pages = [alice.get(p).text for p in ("/", "/dead", "/keys", "/replay", "/audit")]
    pages.append(alice.get(f"/message?table=outbox&id={row_id}").text)
    pages.append(alice.get(f"/edit?table=outbox&id={row_id}").text)
    csrf = csrf_of(pages[-1])
    done = retry(alice, row_id, csrf)
    assert done.status_code == 200
    pages.append(done.text)
    cookie = alice.cookies[COOKIE]
    victor, _ = sign_in(url, VICTOR)
    pages.append(victor.get("/").text)
    seen = "\n".join([*pages, tokens.read_text()])
    log = proc.log

    for text in (seen, log):
        assert cookie not in text and cookie.rsplit(".", 1)[1] not in text
        assert secret.read_text() not in text
        assert ALICE not in text and VICTOR not in text
    words = set(re.findall(r"[A-Za-z0-9_.%\-]{16,}", seen + "\n" + log)) - {cookie}
    assert csrf in words and sha(ALICE) in words  # what an attacker has to try with
    with browser(url) as anyone:
        for word in sorted(words):
            assert anyone.post("/login", data={"token": word}).status_code == 403
            anyone.cookies.clear()
            bearer = {"authorization": f"Bearer {word}"}
            data = {"action": "retry", "table": "outbox", "id": other, "confirm": "yes"}
            acted = anyone.post("/action", data={**data, "csrf": csrf}, headers=bearer)
            assert acted.status_code == 403
            with with_cookie(url, word) as forged:
                assert retry(forged, other, csrf).status_code == 403
    assert statuses(engine, "outbox")[other] == "dead"
    assert [e["actor"] for e in trail(run_relay)] == ["alice"]


# -- cookie flags -------------------------------------------------------------------


def test_the_cookie_is_httponly_samesite_strict_and_secure_over_https(start_relay, tmp_path):
    tokens = team_file(tmp_path, alice=("operator", ALICE))
    url, _ = start_console(start_relay, "--console-tokens", str(tokens))
    _, plain = sign_in(url, ALICE)
    [header] = set_cookies(plain)
    assert {"httponly", "samesite=strict", "path=/"} <= flags(header)
    assert "secure" not in flags(header)
    assert any(f.startswith("max-age=") for f in flags(header))
    # A proxy's word is not believed unless the console is told to trust it.
    told = httpx.post(
        url + "/login",
        data={"token": ALICE},
        headers={"origin": url, "x-forwarded-proto": "https"},
    )
    assert "secure" not in flags(set_cookies(told)[0])

    proxied, _ = start_console(
        start_relay, "--console-tokens", str(tokens), "--console-trust-proxy"
    )
    over_tls = httpx.post(
        proxied + "/login",
        data={"token": ALICE},
        headers={"origin": proxied, "x-forwarded-proto": "https"},
    )
    assert {"secure", "httponly", "samesite=strict"} <= flags(set_cookies(over_tls)[0])
    over_http = httpx.post(
        proxied + "/login",
        data={"token": ALICE},
        headers={"origin": proxied, "x-forwarded-proto": "http"},
    )
    assert "secure" not in flags(set_cookies(over_http)[0])


# -- sessions that end -----------------------------------------------------------------


def alice_signed_in(
    engine, start_relay, tmp_path, *flags: str
) -> tuple[str, str, RelayProcess, httpx.Client, httpx.Response]:
    """A dead row, a console started with `flags` and alice signed in: the
    row's id, the URL, the process, her browser and her sign-in's answer."""
    [row_id] = dead_outbox(engine)
    tokens = team_file(tmp_path, alice=("operator", ALICE))
    url, proc = start_console(start_relay, "--console-tokens", str(tokens), *flags)
    alice, login = sign_in(url, ALICE)
    return row_id, url, proc, alice, login


def test_an_unused_session_ends_after_the_idle_limit(engine, start_relay, tmp_path):
    row_id, url, proc, alice, _ = alice_signed_in(
        engine, start_relay, tmp_path, "--console-session-idle", "4s"
    )
    page = alice.get(f"/message?table=outbox&id={row_id}").text
    assert SIGNED_IN in page
    csrf, cookie = csrf_of(page), alice.cookies[COOKIE]
    time.sleep(5)
    with with_cookie(url, cookie) as copied:
        refused = retry(copied, row_id, csrf)
        assert refused.status_code == 403 and "Sign in" in refused.text
    assert SIGN_IN_FORM in alice.get("/").text
    assert statuses(engine, "outbox")[row_id] == "dead"
    assert "alice's session was unused for over 4 s" in proc.log


def test_a_session_in_use_ends_at_the_absolute_limit(engine, start_relay, tmp_path):
    row_id, url, proc, alice, login = alice_signed_in(
        engine, start_relay, tmp_path, "--console-session-max", "4s"
    )
    [header] = set_cookies(login)
    assert "max-age=4" in flags(header) or "max-age=3" in flags(header)
    deadline = time.monotonic() + 5
    page = alice.get(f"/message?table=outbox&id={row_id}").text
    csrf, cookie = csrf_of(page), alice.cookies[COOKIE]
    while time.monotonic() < deadline:  # in use all along: the idle limit (30m) never nears
        if COOKIE in alice.cookies:
            cookie = alice.cookies[COOKIE]
        alice.get("/")
        time.sleep(0.2)
    # The browser drops the cookie at its Max-Age; a copy kept past it is refused.
    assert SIGN_IN_FORM in alice.get("/").text
    with with_cookie(url, cookie) as copied:
        refused = retry(copied, row_id, csrf)
        assert refused.status_code == 403 and "Sign in" in refused.text
    assert statuses(engine, "outbox")[row_id] == "dead"
    assert "alice's session reached its end (4 s after sign-in)" in proc.log


def test_a_new_token_or_a_removed_line_ends_that_persons_sessions(engine, start_relay, tmp_path):
    [row_id] = dead_outbox(engine)
    tokens = team_file(tmp_path, alice=("operator", ALICE), bob=("operator", BOB))
    url, proc = start_console(start_relay, "--console-tokens", str(tokens))
    alice, _ = sign_in(url, ALICE)
    bob, _ = sign_in(url, BOB)
    assert SIGNED_IN in alice.get("/").text and SIGNED_IN in bob.get("/").text

    # Alice's token replaced in place (the same file written again).
    write_team(tokens, alice=("operator", "alice-new-token"), bob=("operator", BOB))
    assert SIGN_IN_FORM in alice.get("/").text
    assert "read " + str(tokens) + " again: 2 operator(s)" in proc.log
    assert SIGNED_IN in bob.get("/").text
    assert browser(url).post("/login", data={"token": ALICE}).status_code == 403
    again, _ = sign_in(url, "alice-new-token")
    assert SIGNED_IN in again.get("/").text

    # Bob's line removed, the file swapped in whole (as a ConfigMap update does).
    fresh = tmp_path / "tokens.new"
    write_team(fresh, alice=("operator", "alice-new-token"))
    fresh.replace(tokens)
    page = bob.get(f"/message?table=outbox&id={row_id}").text
    assert SIGN_IN_FORM in page
    assert retry(bob, row_id, "0" * 64).status_code == 403
    assert SIGNED_IN in again.get("/").text
    assert statuses(engine, "outbox")[row_id] == "dead"


def test_a_tokens_file_broken_while_serving_lets_nobody_in_until_fixed(start_relay, tmp_path):
    tokens = team_file(tmp_path, alice=("operator", ALICE))
    url, proc = start_console(start_relay, "--console-tokens", str(tokens))
    alice, _ = sign_in(url, ALICE)
    tokens.write_text(f"alice operator {sha(ALICE)}\nbob operator not-a-hash\n")
    assert SIGN_IN_FORM in alice.get("/").text
    assert browser(url).post("/login", data={"token": ALICE}).status_code == 403
    assert "nobody may sign in until the tokens file is fixed" in proc.log
    assert "line 2" in proc.log and sha(ALICE) not in proc.log
    write_team(tokens, alice=("operator", ALICE))
    again, _ = sign_in(url, ALICE)
    assert SIGNED_IN in again.get("/").text


def test_signing_out_ends_a_copied_cookie(start_relay, tmp_path):
    tokens = team_file(tmp_path, alice=("operator", ALICE))
    url, _ = start_console(start_relay, "--console-tokens", str(tokens))
    alice, _ = sign_in(url, ALICE)
    copied = alice.cookies[COOKIE]
    assert SIGNED_IN in with_cookie(url, copied).get("/").text
    out = alice.post("/logout")
    assert out.status_code == 303 and all("max-age=0" in flags(h) for h in set_cookies(out))
    assert SIGN_IN_FORM in with_cookie(url, copied).get("/").text


def test_a_restart_ends_every_session_unless_the_key_is_given(start_relay, tmp_path):
    tokens = team_file(tmp_path, alice=("operator", ALICE))
    secret = tmp_path / "secret"
    secret.write_text(os.urandom(32).hex() + "\n")

    url, proc = start_console(start_relay, "--console-tokens", str(tokens))
    alice, _ = sign_in(url, ALICE)
    cookie = alice.cookies[COOKIE]
    proc.stop()
    url, _ = start_console(start_relay, "--console-tokens", str(tokens))
    assert SIGN_IN_FORM in with_cookie(url, cookie).get("/").text

    env = {"RELAY_CONSOLE_SECRET_FILE": str(secret)}
    url, proc = start_console(start_relay, "--console-tokens", str(tokens), env=env)
    alice, _ = sign_in(url, ALICE)
    cookie = alice.cookies[COOKIE]
    proc.stop()
    url, _ = start_console(start_relay, "--console-tokens", str(tokens), env=env)
    assert SIGNED_IN in with_cookie(url, cookie).get("/").text


@pytest.mark.parametrize(
    ("secret", "said"),
    [
        ("short", "holds 5 bytes; give at least 32"),
        (None, "not the tokens file"),
        ("missing", "cannot read"),
    ],
)
def test_a_bad_secret_file_exits_2_with_one_line(run_relay, tmp_path, secret, said):
    tokens = team_file(tmp_path, alice=("operator", ALICE))
    if secret is None:
        path = str(tokens)
    elif secret == "missing":
        path = str(tmp_path / "nowhere")
    else:
        path = str(tmp_path / "secret")
        Path(path).write_text(secret)
    result = run_relay(
        "console", "--console-tokens", str(tokens), "--console-secret-file", path, timeout=30
    )
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert "--console-secret-file" in line and said in line
    assert sha(ALICE) not in result.stderr


# -- relay.console.sessions alone, with a clock of its own --------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


ALICE_OP = Operator("alice", "operator", sha(ALICE))


def sessions(clock: Clock, **limits: Any) -> Sessions:
    return Sessions(os.urandom(32), clock=clock, **{"idle": 60, "lifetime": 600, **limits})


def test_each_use_renews_the_idle_limit_up_to_the_absolute_one():
    clock = Clock()
    s = sessions(clock)
    team = {"alice": ALICE_OP}
    session = s.begin(ALICE_OP)
    cookie = s.cookie(session, ALICE_OP)
    for _ in range(9):  # used every 50 s: 450 s in all, past the idle limit many times over
        clock.now += 50
        found = s.read(cookie, team)
        assert found is not None and found[0].nonce == session.nonce
        cookie = s.cookie(s.renewed(found[0]), ALICE_OP)
    clock.now += 151  # 601 s after sign-in
    with pytest.raises(Expired, match="reached its end"):
        s.read(cookie, team)


def test_a_cookie_changed_anywhere_does_not_verify():
    clock = Clock()
    s = sessions(clock)
    team = {"alice": ALICE_OP, "bob": Operator("bob", "operator", sha(BOB))}
    cookie = s.cookie(s.begin(ALICE_OP), ALICE_OP)
    version, payload, mac = cookie.split(".")
    bob_payload = base64.urlsafe_b64encode(
        json.dumps(["bob", *json.loads(base64.urlsafe_b64decode(payload + "=="))[1:]]).encode()
    ).decode()
    for changed in [
        f"v2.{payload}.{mac}",
        f"{version}.{bob_payload.rstrip('=')}.{mac}",
        f"{version}.{payload}.{mac[:-2]}AA",
        f"{version}.{payload}",
        "",
        "v1..",
        "v1.!!!.x",
    ]:
        assert s.read(changed, team) is None
    assert s.read(cookie, team) is not None
    assert sessions(clock).read(cookie, team) is None  # another key


@given(
    st.one_of(
        st.text(),
        st.text().map(lambda t: "v1." + t),
        st.binary().map(lambda b: "v1." + base64.urlsafe_b64encode(b).decode() + ".x"),
        st.recursive(st.integers() | st.text(), lambda c: st.lists(c, max_size=4)).map(
            lambda v: "v1." + base64.urlsafe_b64encode(json.dumps(v).encode()).decode() + ".x"
        ),
    )
)
def test_any_cookie_not_made_by_the_console_reads_as_none(value):
    s = sessions(Clock())
    assert s.read(value, {"alice": ALICE_OP}) is None


def test_a_deeply_nested_payload_is_refused_without_parsing():
    deep = base64.urlsafe_b64encode(b"[" * 100_000 + b"]" * 100_000).decode()
    assert sessions(Clock()).read(f"v1.{deep}.x", {"alice": ALICE_OP}) is None
