"""API keys: who may call, and which tenant a call belongs to.

Keys come from a file (``--api-keys-file``, re-read on SIGHUP) and from the environment
(``EDGESPEC_API_KEYS``, read once at start). Both use one format: an entry is a key,
optionally followed by whitespace and a tenant name; the file has one entry per line (blank
lines and lines starting with ``#`` are skipped), the environment separates entries with
commas or newlines::

    # key                                    tenant
    3f9c1e0b8a7d4c2e9f6a5b4c3d2e1f0a         acme
    9b8a7c6d5e4f3a2b1c0d9e8f7a6b5c4d         acme      (a second key of acme: rotation)
    0123456789abcdef0123456789abcdef                   (its own tenant)

The tenant, not the key, owns sessions, prefix-cache entries and quotas, so a key rotated
within a tenant keeps its cache and does not double its quota. A key without a name is its
own tenant, named ``key-`` plus 12 hex digits of the key's SHA-256 (never the key itself).
Only digests are kept in memory; logs and metrics name tenants, never keys.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cloud_verifier.config import key_digest
from cloud_verifier.errors import Unauthenticated

log = logging.getLogger(__name__)

ENV_VAR = "EDGESPEC_API_KEYS"
ANONYMOUS = "anonymous"
TENANT_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# Shorter keys can be guessed; they are accepted (tests, demos) with a warning.
MIN_KEY_CHARS = 16
_BEARER = "Bearer "


class KeyFileError(ValueError):
    """A key file or variable that cannot be used; the message never quotes a key."""


def default_tenant(digest: str) -> str:
    return f"key-{digest[:12]}"


def parse_entries(entries: Iterable[str], source: str) -> dict[str, str]:
    """{key digest: tenant} from entries ``KEY [TENANT]``; raises KeyFileError."""
    keys: dict[str, str] = {}
    for number, raw in enumerate(entries, 1):
        entry = raw.strip()
        if not entry or entry.startswith("#"):
            continue
        fields = entry.split()
        if len(fields) > 2:
            raise KeyFileError(f"{source} entry {number}: expected 'KEY [TENANT]', got "
                               f"{len(fields)} fields")
        digest = key_digest(fields[0])
        tenant = fields[1] if len(fields) == 2 else default_tenant(digest)
        if not TENANT_RE.match(tenant):
            raise KeyFileError(f"{source} entry {number}: a tenant name is 1-64 characters "
                               "of [A-Za-z0-9_.-]")
        if keys.get(digest, tenant) != tenant:
            raise KeyFileError(f"{source} entry {number}: the same key is given two tenants")
        if len(fields[0]) < MIN_KEY_CHARS:
            log.warning("%s entry %d: an API key of fewer than %d characters can be guessed",
                        source, number, MIN_KEY_CHARS)
        keys[digest] = tenant
    return keys


def read_key_file(path: Path) -> dict[str, str]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise KeyFileError(f"cannot read the API key file {path}: {err}") from err
    keys = parse_entries(text.splitlines(), str(path))
    if not keys:
        raise KeyFileError(f"the API key file {path} holds no keys")
    return keys


def parse_env(value: str) -> dict[str, str]:
    return parse_entries(re.split(r"[,\n]", value), ENV_VAR)


@dataclass(frozen=True)
class Caller:
    """Who a call comes from: the tenant owns what the call creates."""

    tenant: str
    digest: str | None  # None when the server takes no keys


class KeyRing:
    """The accepted keys; ``reload`` swaps in the file's current ones atomically.

    With no keys at start, authentication is off for the life of the process (every call is
    ``anonymous``); a reload can change the keys but never turn authentication off.
    """

    def __init__(self, static: dict[str, str] | None = None, path: Path | None = None) -> None:
        self._static = dict(static or {})
        self._path = path
        self._lock = threading.Lock()
        self._keys = {**self._static, **(read_key_file(path) if path is not None else {})}
        # Bumped by every reload that changed the keys: streams re-check theirs then.
        self.version = 0
        self.enabled = bool(self._keys)

    @property
    def tenants(self) -> frozenset[str]:
        return frozenset(self._keys.values())

    def authenticate(self, metadata) -> Caller:
        """The caller of a call with this metadata; raises Unauthenticated."""
        if not self.enabled:
            return Caller(ANONYMOUS, None)
        values = [v for k, v in (metadata or ()) if k == "authorization"]
        if len(values) != 1 or not isinstance(values[0], str) \
                or not values[0].startswith(_BEARER):
            raise Unauthenticated("missing 'authorization: Bearer <api key>' metadata")
        digest = key_digest(values[0][len(_BEARER):])
        tenant = self._keys.get(digest)
        if tenant is None:
            raise Unauthenticated("unknown API key")
        return Caller(tenant, digest)

    def still_valid(self, caller: Caller) -> bool:
        """Whether a caller authenticated earlier would still be let in, as the same tenant."""
        return caller.digest is None or self._keys.get(caller.digest) == caller.tenant

    def reload(self) -> bool:
        """Re-reads the key file; on any error keeps the current keys. Returns whether the
        keys are now the file's."""
        if self._path is None:
            log.info("API keys: no --api-keys-file to reload")
            return False
        try:
            fresh = {**self._static, **read_key_file(self._path)}
        except KeyFileError as err:
            log.error("API keys not reloaded, the current ones stay: %s", err)
            return False
        with self._lock:
            changed = fresh != self._keys
            self._keys = fresh
            if changed:
                self.version += 1
        log.info("API keys reloaded: %d keys of %d tenants%s", len(fresh),
                 len(set(fresh.values())), "" if changed else " (unchanged)")
        return True
