"""Who may look and who may act: password hashes, the signed session cookie, CSRF tokens, login
throttling and the response headers every page carries.

Nothing here talks to the database. The session lives in a cookie signed with the configured
secret (HMAC-SHA256), so every replica given the same secret accepts it; it expires after
``session_seconds`` and a login always starts a new one (a new session id and a new CSRF token:
a cookie planted before the login is worth nothing after it).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import ipaddress
import json
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from ..exceptions import ConfigError

ROLES = ("none", "read", "operate")
#: A session ends this long after its login, whatever happens in between.
DEFAULT_SESSION_SECONDS = 8 * 3600
#: The secret signs sessions and CSRF tokens: a short one can be guessed offline from one cookie.
MIN_SECRET_CHARS = 32

# scrypt's cost: about 50 ms a check on this class of machine, 16 MiB of memory.
_SCRYPT_N, _SCRYPT_R, _SCRYPT_P = 2**14, 8, 1


@dataclass(frozen=True)
class Access:
    """Who is asking and what they may do. ``role``: ``none`` (nothing served), ``read`` (look,
    payloads hidden unless ``payloads``), ``operate`` (look, see payloads, act)."""

    user: str
    role: str
    payloads: bool = False

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"role {self.role!r} is not one of {', '.join(ROLES)}")

    @property
    def can_read(self) -> bool:
        return self.role in ("read", "operate")

    @property
    def can_act(self) -> bool:
        return self.role == "operate"

    @property
    def sees_payloads(self) -> bool:
        return self.can_act or (self.can_read and self.payloads)


# -- passwords -------------------------------------------------------------------------------------


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def hash_password(password: str) -> str:
    """``scrypt$N$r$p$salt$hash`` (base64): what a users file stores, never the password."""
    if not password:
        raise ConfigError("an empty password cannot be hashed")
    salt = secrets.token_bytes(16)
    digest = hashlib.scrypt(password.encode(), salt=salt, n=_SCRYPT_N, r=_SCRYPT_R, p=_SCRYPT_P, dklen=32)
    return "$".join(["scrypt", str(_SCRYPT_N), str(_SCRYPT_R), str(_SCRYPT_P), _b64(salt), _b64(digest)])


def verify_password(password: str, stored: str) -> bool:
    try:
        scheme, n, r, p, salt, digest = stored.split("$")
        if scheme != "scrypt":
            return False
        expected = _unb64(digest)
        got = hashlib.scrypt(
            password.encode(), salt=_unb64(salt), n=int(n), r=int(r), p=int(p), dklen=len(expected)
        )
    except (ValueError, TypeError):
        return False
    return hmac.compare_digest(got, expected)


@functools.cache
def _dummy_hash() -> str:
    # Checked against when the user does not exist, so that an unknown name costs as long as a
    # wrong password (no user enumeration by timing).
    return hash_password(secrets.token_urlsafe(16))


@dataclass(frozen=True)
class User:
    name: str
    role: str
    password_hash: str
    payloads: bool = False


def parse_users(text: str, *, source: str = "users file") -> dict[str, User]:
    """A users file: one user a line, ``NAME ROLE HASH`` (ROLE ``read``, ``read+payloads`` or
    ``operate``; HASH from ``outbox dashboard hash-password``); ``#`` starts a comment."""
    users: dict[str, User] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 3:
            raise ConfigError(f"{source} line {number}: expected NAME ROLE HASH, got {len(parts)} fields")
        name, role, stored = parts
        payloads = role.endswith("+payloads")
        role = role.removesuffix("+payloads")
        if role not in ("read", "operate"):
            raise ConfigError(f"{source} line {number}: role {role!r} is not read, read+payloads or operate")
        if not stored.startswith("scrypt$") or stored.count("$") != 5:
            raise ConfigError(
                f"{source} line {number}: the third field must be a hash from `outbox dashboard "
                "hash-password`, never a password"
            )
        if name in users:
            raise ConfigError(f"{source} line {number}: user {name!r} is listed twice")
        users[name] = User(name, role, stored, payloads)
    if not users:
        raise ConfigError(f"{source} lists no user")
    return users


def check_login(users: dict[str, User], name: str, password: str) -> User | None:
    user = users.get(name)
    ok = verify_password(password, user.password_hash if user else _dummy_hash())
    return user if ok and user is not None else None


# -- the signed cookie -------------------------------------------------------------------------------


class Signer:
    """Signs a JSON document into a cookie value and checks it back (HMAC-SHA256)."""

    def __init__(self, secret: str) -> None:
        if not secret or len(secret) < MIN_SECRET_CHARS:
            raise ConfigError(
                f"the dashboard needs a session secret of at least {MIN_SECRET_CHARS} characters "
                "(OUTBOX_DASHBOARD_SECRET; the same on every replica), e.g. from "
                "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
            )
        self._key = hashlib.sha256(b"outbox.dashboard.session:" + secret.encode()).digest()

    def _mac(self, body: str) -> str:
        return _b64(hmac.new(self._key, body.encode(), hashlib.sha256).digest())

    def sign(self, data: dict[str, Any]) -> str:
        body = _b64(json.dumps(data, separators=(",", ":"), sort_keys=True).encode())
        return f"{body}.{self._mac(body)}"

    def unsign(self, value: str | None) -> dict[str, Any] | None:
        if not value or value.count(".") != 1:
            return None
        body, mac = value.split(".")
        # Bytes: compare_digest raises on a str that is not ASCII (a forged cookie must not 500).
        if not hmac.compare_digest(mac.encode(), self._mac(body).encode()):
            return None
        try:
            data = json.loads(_unb64(body))
        except ValueError:
            return None
        if not isinstance(data, dict) or float(data.get("exp", 0)) < time.time():
            return None
        return data


def new_session(*, seconds: float, **fields: Any) -> dict[str, Any]:
    """A fresh session: a new id and a new CSRF token."""
    return {
        "sid": secrets.token_urlsafe(16),
        "csrf": secrets.token_urlsafe(32),
        "exp": int(time.time() + seconds),
        **fields,
    }


def csrf_ok(session: dict[str, Any] | None, sent: str | None) -> bool:
    expected = (session or {}).get("csrf")
    return bool(expected and sent) and hmac.compare_digest(str(expected).encode(), str(sent).encode())


#: A login form posted over plain HTTP without its (Secure) cookie: the real cause, not a CSRF riddle.
PLAIN_HTTP_REFUSAL = (
    "the sign-in cookie did not come back: the dashboard's cookies are Secure and this page was "
    "served over plain HTTP, where browsers do not send them back (reloading will not help). "
    "Use HTTPS (or a proxy serving it, named in OUTBOX_DASHBOARD_TRUSTED_PROXIES); for local use "
    "only, turn Secure off: OUTBOX_DASHBOARD_INSECURE_COOKIES=1 (--insecure-cookies, "
    "create_app(secure_cookies=False))"
)


def loopback(host: str | None) -> bool:
    """Whether browsers treat ``host`` as a secure context: they send Secure cookies back to
    http://localhost and loopback addresses, anywhere else only over HTTPS."""
    if not host:
        return False
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def password_mark(user: User) -> str:
    """What a session keeps of its user's password hash: a new hash in the users file (a
    password reset) ends every session opened with the old one."""
    return hashlib.sha256(b"outbox.dashboard.pw:" + user.password_hash.encode()).hexdigest()[:16]


# -- login throttling -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Admission:
    """What the throttle makes of a login try: refused for ``refused_for`` seconds (nothing
    counted; ``why``: ``address`` or ``name``), or admitted, its password to be checked now
    (``known``: counted as its known browser's)."""

    refused_for: float = 0.0
    why: str = ""
    known: bool = False


class Throttle:
    """Failed logins within ``window_seconds``, counted three ways.

    Per (user name, client address): after ``max_failures``, that address's tries for that name
    are refused, even a right one, until the oldest failure ages out. Behind a proxy whose
    forwarded address is not trusted every operator shares one address; counted per name too,
    a guesser there locks out the name guessed, not every operator.

    Per user name, from every address: once the name has ``max_failures``, one try of it is
    checked at a time, the next ``slow_seconds`` after the one before, doubling with each further
    failure up to ``slow_max_seconds``; a try before its time is refused with that time (nothing
    is queued: queued tries would add up, and a campaign from many addresses would make the
    user's own try wait for all of them). A guesser with a new address per guess gets a handful
    of tries a minute.

    Per (user name, known browser): a browser that has signed in as the name holds a token of
    it (``device``); its tries skip both counts above and are counted on their own, so no one
    else's guesses hold the user back there. One that fails ``max_failures`` times is a browser
    like any other until they age out.

    Each try counts as a failure from the moment it starts (:meth:`begin`) until it succeeds,
    so concurrent guesses cannot all slip in while the first ones are being checked. In memory:
    each replica counts its own (a guesser spread over N replicas gets N times the tries).
    """

    #: Names longer than this count under their first characters (a long made-up name is not
    #: a new bucket per byte, nor kept whole); addresses and browser tokens likewise.
    NAME_CHARS = 128
    ADDRESS_CHARS = 64
    #: Counters are swept of old failures once there are this many, then again whenever they
    #: have doubled since the last sweep (a flood of names costs each try O(1), not a sweep).
    MAX_NAMES = 10_000

    def __init__(
        self,
        max_failures: int = 5,
        window_seconds: float = 300.0,
        *,
        slow_seconds: float = 1.0,
        slow_max_seconds: float = 8.0,
    ) -> None:
        self.max_failures = max_failures
        self.window_seconds = window_seconds
        self.slow_seconds = slow_seconds
        self.slow_max_seconds = slow_max_seconds
        # Keyed by "user NAME", by "LEN:ADDRESS NAME" and by "device TOKEN NAME" (the length and
        # the prefix keep them apart).
        self._failures: dict[str, deque[float]] = {}
        self._next_check: dict[str, float] = {}
        self._sweep_at = self.MAX_NAMES
        self._lock = threading.Lock()

    def _keys(self, name: str, address: str, device: str | None) -> tuple[str, str, str | None]:
        name, address = name[: self.NAME_CHARS], address[: self.ADDRESS_CHARS]
        known = f"device {device[: self.ADDRESS_CHARS]} {name}" if device else None
        return f"user {name}", f"{len(address)}:{address} {name}", known

    def _recent(self, key: str, now: float) -> deque[float] | None:
        q = self._failures.get(key)
        while q and q[0] <= now - self.window_seconds:
            q.popleft()
        return q

    def _sweep(self, now: float) -> None:
        if len(self._failures) < self._sweep_at:
            return
        horizon = now - self.window_seconds
        self._failures = {k: q for k, q in self._failures.items() if q and q[-1] > horizon}
        self._next_check = {k: t for k, t in self._next_check.items() if t > now}
        self._sweep_at = max(self.MAX_NAMES, 2 * len(self._failures))

    def begin(self, name: str, address: str, device: str | None = None) -> Admission:
        """Start a login try for this name from this address (and this known browser's token,
        if it holds one for the name): refused (nothing counted), or admitted and counted as a
        failure until :meth:`succeeded`."""
        now = time.monotonic()
        user, pair, known = self._keys(name, address, device)
        with self._lock:
            self._sweep(now)
            if known is not None and len(self._recent(known, now) or ()) < self.max_failures:
                self._failures.setdefault(known, deque()).append(now)
                return Admission(known=True)
            q = self._recent(pair, now)
            if q is not None and len(q) >= self.max_failures:
                return Admission(refused_for=q[0] + self.window_seconds - now, why="address")
            failures = len(self._recent(user, now) or ())
            if failures >= self.max_failures:
                at = self._next_check.get(user, now)
                if at > now:
                    return Admission(refused_for=at - now, why="name")
                doublings = min(failures - self.max_failures, 16)
                self._next_check[user] = now + min(self.slow_max_seconds, self.slow_seconds * 2**doublings)
            for key in (user, pair):
                self._failures.setdefault(key, deque()).append(now)
            return Admission()

    def succeeded(self, name: str, address: str, admission: Admission, device: str | None = None) -> None:
        """The try ``admission`` let in was right: its own count is forgotten (the known
        browser's, or this address's failures for the name, the try uncounted from the name's:
        the other addresses' failures still slow it)."""
        user, pair, known = self._keys(name, address, device)
        with self._lock:
            if admission.known:
                if known is not None:
                    self._failures.pop(known, None)
                return
            self._failures.pop(pair, None)
            q = self._failures.get(user)
            if q:
                q.pop()


# -- headers -----------------------------------------------------------------------------------------

#: No inline script or style anywhere (htmx is served from the package, its indicator styles off),
#: and no framing: a page of the dashboard cannot be overlaid by another site (clickjacking).
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'; object-src 'none'"
)
SECURITY_HEADERS = {
    "content-security-policy": CONTENT_SECURITY_POLICY,
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "same-origin",
}
