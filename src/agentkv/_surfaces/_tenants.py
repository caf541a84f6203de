"""Who a request is: the front door's tenants, one per API key (docs/serve.md, "Serving many users").

A tenant is what authenticates. The door takes several API keys, each naming its tenant:

* ``--api-key KEY`` (repeatable; or several in ``$AGENTKV_API_KEY``, separated by commas): the tenant is named
  after a digest of the key (``key-<12 hex digits>``), so that it stays the same across restarts;
* a keys file (``--api-keys-file PATH``; or ``$AGENTKV_API_KEYS_FILE``): a line ``TENANT KEY`` per key (``#``
  starts a comment), which names tenants, gives one tenant several keys (a key rotated keeps its tenant's
  conversations) and keeps keys off the command line.

A request's ``Authorization: Bearer KEY`` is hashed and compared with every key's hash in constant time (as
vLLM's server compares them), so neither a key nor which key matched shows in the time taken.

**A trusted gateway** in front of the door may say which of its own users a request is for, in a header the door
is told to read (``--tenant-header NAME``; off by default): the tenant is then ``<key's tenant>:<header value>``, so
a key holder can only ever split its own tenant, never name another key's. The header is trusted as it comes:
set it only when every request reaches the door through that gateway, which sets it (and strips a client's).

Without keys every request is one tenant's (None: the pool's default tenant), or, with ``--tenant-header``, the
header's.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from starlette.datastructures import Headers

from .._errors import UserError

__all__ = ["TENANT_NAME", "Tenants", "UnauthorizedError", "read_keys_file"]

TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
"""A tenant's name (and a gateway's header value): 1 to 64 letters, digits, ``.``, ``_`` and ``-``."""


class UnauthorizedError(Exception):
    """The request carries no key the door takes (a 401); its message never says more."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def check_tenant_name(name: str, where: str) -> str:
    if not TENANT_NAME.fullmatch(name):
        raise UserError(f"{where}: a tenant's name is 1 to 64 letters, digits, '.', '_' or '-', not {name!r}")
    return name


def read_keys_file(path: str | Path) -> dict[str, str]:
    """The keys of a keys file, each with its tenant: a ``TENANT KEY`` line each; blank lines and ``#`` comments
    skipped; a malformed line or a key given twice is a `UserError` naming its line (never the key)."""
    keys: dict[str, str] = {}
    try:
        lines = Path(path).expanduser().read_text().splitlines()
    except OSError as exc:
        raise UserError(f"the API keys file {path} cannot be read: {exc.strerror or exc}") from None
    for number, line in enumerate(lines, start=1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        parts = text.split()
        if len(parts) != 2:
            raise UserError(f"{path}, line {number}: write one tenant and one key per line ('TENANT KEY')")
        tenant, key = parts
        check_tenant_name(tenant, f"{path}, line {number}")
        if key in keys:
            raise UserError(f"{path}, line {number}: this key is given twice")
        keys[key] = tenant
    return keys


@dataclass(frozen=True)
class Tenants:
    """The door's API keys, each with its tenant, and the gateway's tenant header (None: not read).

    Never shows a key (its repr lists the tenants only)."""

    keys: Mapping[bytes, str] = field(default_factory=dict, repr=False)
    """Each key's SHA-256 digest, with its tenant."""
    header: str | None = None
    """The header a trusted gateway names the tenant in (lowercase), or None."""

    @classmethod
    def of(
        cls, keys: Iterable[str] = (), *, named: Mapping[str, str] | None = None, header: str | None = None
    ) -> Tenants:
        """Tenants of bare ``keys`` (each its own tenant, named after its digest) and ``named`` keys (key ->
        tenant, as a keys file names them); ``header``: the gateway's tenant header."""
        found: dict[bytes, str] = {}
        for key in keys:
            if not key:
                raise UserError("an API key is not empty")
            found[_digest(key)] = "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]
        for key, tenant in (named or {}).items():
            if not key:
                raise UserError("an API key is not empty")
            found[_digest(key)] = check_tenant_name(tenant, "a keys file")
        if header is not None and not re.fullmatch(r"[A-Za-z0-9-]{1,64}", header):
            raise UserError(f"the tenant header's name is letters, digits and '-', not {header!r}")
        return cls(found, header.lower() if header is not None else None)

    @property
    def needs_key(self) -> bool:
        """Whether requests must carry a key."""
        return bool(self.keys)

    @property
    def names(self) -> list[str]:
        """The tenants the keys name (each once, in order)."""
        return list(dict.fromkeys(self.keys.values()))

    def tenant_of(self, headers: Headers) -> str | None:
        """The tenant ``headers`` authenticate: the key's (`UnauthorizedError` without a key the door takes), and
        the gateway's header under it when the door reads one (a `UserError` when it is missing or malformed)."""
        tenant = self._keyed(headers.get("authorization", "")) if self.keys else None
        if self.header is None:
            return tenant
        given = headers.get(self.header)
        if given is None or not TENANT_NAME.fullmatch(given):
            raise UserError(
                f"this server takes each request's tenant from its {self.header!r} header (set by the gateway in "
                "front of it): 1 to 64 letters, digits, '.', '_' or '-'"
            )
        return given if tenant is None else f"{tenant}:{given}"

    def _keyed(self, authorization: str) -> str:
        scheme, _, given = authorization.partition(" ")
        digest = _digest(given)
        found: str | None = None
        for key, tenant in self.keys.items():  # every key compared, in constant time: no timing says which
            if secrets.compare_digest(digest, key):
                found = tenant
        if scheme.lower() != "bearer" or found is None:
            raise UnauthorizedError
        return found
