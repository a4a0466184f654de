"""Credential scrubbing: the one place that knows what a secret looks like.

Everything the remote storage shows (its ``repr``, exception messages, log lines) goes through
a :class:`Scrubber` built from the tier's storage options and URL, so that account keys,
connection strings, S3 secrets and SAS tokens never leave the process in text.
"""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from nebula_ckpt.storage.urls import refuse_url_credentials

#: option names whose values are credentials (matched anywhere in the name, case-insensitive)
_SENSITIVE_KEY = re.compile(
    r"(?i)(key|secret|token|passw|sas|signature|credential|connection_string|conn_str|auth|sig)")
#: option names that match the above but hold no secret
_NOT_SECRET_SUFFIXES = ("_version", "_id_type")
#: secret-looking fields in free text, whatever their value
_SECRET_PATTERNS = [
    # connection-string fields
    (re.compile(r"(?i)((?:AccountKey|SharedAccessSignature|SharedAccessKey|SharedAccessKeyName)=)"
                r"[^;\s\"'&]+"), r"\1***"),
    # SAS / presigned-URL query parameters
    (re.compile(r"(?i)((?:^|[?&;,\s])(?:sig|X-Amz-Signature|X-Amz-Credential|X-Amz-Security-Token|"
                r"Signature|AWSAccessKeyId|x-goog-signature|x-goog-credential)=)[^&\s\"';,]+"),
     r"\1***"),
    # HTTP Authorization headers: "SharedKey account:signature", "Bearer token", ...
    (re.compile(r"(?i)(authorization['\"]?\s*[:=]\s*['\"]?(?:[\w-]+\s+)?)[^\s'\",}]+"), r"\1***"),
]
#: shorter strings are not treated as secrets (they would blank out ordinary words)
_MIN_SECRET_LEN = 4


def collect_secrets(obj: Any, key: str = "", out: Optional[set[str]] = None) -> set[str]:
    """Every string in ``obj`` (nested dicts / lists) stored under a credential-looking key.

    Connection strings and SAS tokens also contribute each of their fields on its own, so a
    backend message quoting only the account key is scrubbed too.

    Args:
        obj: storage options (or any nested value of them).
        key: the option name ``obj`` was found under.
        out: set to add to (internal).

    Returns:
        The secrets found.
    """
    if out is None:
        out = set()
    if isinstance(obj, dict):
        for k, v in obj.items():
            collect_secrets(v, str(k), out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            collect_secrets(v, key, out)
    elif isinstance(obj, str) and obj:
        if _SENSITIVE_KEY.search(key) and not key.lower().endswith(_NOT_SECRET_SUFFIXES):
            out.add(obj)
            for part in obj.split(";"):  # connection string fields
                name, _, value = part.partition("=")
                if value and _SENSITIVE_KEY.search(name):
                    out.add(value)
            for _, value in urllib.parse.parse_qsl(obj.lstrip("?")):  # SAS token values
                if len(value) >= _MIN_SECRET_LEN:
                    out.add(value)
    return out


class Scrubber:
    """Removes known secrets (and secret-looking fields) from text.

    Args:
        secrets: the exact strings to remove (see :func:`collect_secrets`).

    Example::

        scrub = Scrubber(collect_secrets({"secret": "s3cr3t"}))
        scrub("signature with s3cr3t")  # -> "signature with ***"
    """

    def __init__(self, secrets: Iterable[str]) -> None:
        # longest first so that a connection string is replaced before the key inside it
        self._secrets = sorted({s for s in secrets if len(s) >= _MIN_SECRET_LEN}, key=len,
                               reverse=True)

    def __call__(self, text: str) -> str:
        for s in self._secrets:
            if s in text:
                text = text.replace(s, "***")
        for pattern, repl in _SECRET_PATTERNS:
            text = pattern.sub(repl, text)
        return text

    def __repr__(self) -> str:  # never show what it scrubs
        return f"Scrubber({len(self._secrets)} secrets)"


@dataclass(frozen=True)
class SafeUrl:
    """A tier URL split into what may be shown and what the filesystem needs.

    Attributes:
        display: the URL without its query string (safe to log).
        clean: the URL the filesystem is opened with (no query string).
        scheme: the URL scheme (``"file"`` when there is none).
        secrets: the query values found in the URL (to scrub).
    """

    display: str
    clean: str
    scheme: str
    secrets: frozenset[str]

    def __repr__(self) -> str:
        return f"SafeUrl({self.display!r})"

    @classmethod
    def parse(cls, url: str) -> "SafeUrl":
        """Split ``url``; a query string is never part of ``display``.

        Raises:
            ValidationError: the URL carries a password (``user:password@``): credentials go in
                ``storage_options`` (see :func:`~nebula_ckpt.storage.urls.refuse_url_credentials`); a
                user name alone (Azure's ``container@account``) stays.
        """
        refuse_url_credentials(url, "remote tier")  # before urlsplit, whose errors quote the host part
        secrets: set[str] = set()
        parts = urllib.parse.urlsplit(url)
        netloc = parts.netloc
        clean = url.split("?", 1)[0]
        if parts.query:
            secrets.add(parts.query)
            secrets.update(v for _, v in urllib.parse.parse_qsl(parts.query)
                           if len(v) >= _MIN_SECRET_LEN)
        if not parts.scheme:
            return cls(clean.rstrip("/") or "/", clean, "file", frozenset(secrets))
        shown = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))
        if shown.endswith("/") and not shown.endswith("://") and not shown.endswith(":///"):
            shown = shown.rstrip("/")
        return cls(shown, clean, parts.scheme, frozenset(secrets))
