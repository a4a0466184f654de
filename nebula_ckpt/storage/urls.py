"""Checkpoint root URLs: what may be shown of them, and what identifies a root.

A root or tier URL travels into logs, messages, ``run.json`` and pointer files, so it must hold
no secret: :func:`refuse_url_credentials` (the one check every entry point makes first) refuses
a password in its user info, and :func:`strip_credentials` gives what may be shown.
:func:`canonical_root` is the stable identity of a root (the memory tier's folder is named by it).
"""

from __future__ import annotations

import os
import re
from typing import Any, Optional
from urllib.parse import urlsplit, urlunsplit

from nebula_ckpt.errors import ValidationError

#: ``scheme://rest`` of one URL (a chained fsspec URL ``a::b://...`` is checked part by part)
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://(.*)$", re.DOTALL)


def _password_in(url: str) -> Optional[str]:
    """If ``url`` (or a part of a chained ``a::b`` URL) carries a password in its user info,
    a credential-free way to show it (``s3://***@bucket/run``); else None. Never parses the URL
    with :mod:`urllib` (whose errors quote the host part, the password included).

    The host part is the text after ``://`` up to the first ``/``, ``?`` or ``#``. A password is
    a ``:`` in the user info (before the host part's last ``@``), or a ``:`` in a host part
    without ``@`` that is not followed by a port number (``KEY:se/cr@et@bucket``: the password
    holds a ``/``), or a ``host:port`` followed by an ``@`` further on (``KEY:1234/abc@bucket``).
    A user name alone is no secret: Azure's ``abfs://container@account.dfs.core.windows.net``.
    """
    for part in url.split("::"):
        m = _URL.match(part)
        if m is None:
            continue
        scheme, rest = m.groups()
        head = re.split(r"[/?#]", rest, maxsplit=1)[0]
        bare = re.sub(r"\[[^\]]*\]", "", head)  # an IPv6 literal's colons are no password
        userinfo, at, host = bare.rpartition("@")
        _, colon, port = host.partition(":")
        if (at and ":" in userinfo) or (colon and not port.isdigit() and port) or \
                (colon and "@" in rest[len(head):]):
            tail = rest.rpartition("@")[2] if "@" in rest else ""
            return f"{scheme}://***@{tail}" if tail else f"{scheme}://***"
    return None


def refuse_url_credentials(url: Any, what: str = "root") -> None:
    """Refuse a URL with a password in its user info (``s3://KEY:SECRET@bucket/run``), and a
    blob URL with a broken scheme that would otherwise be taken for a local folder
    (:func:`refuse_mistyped_url`).

    The one check every entry point that takes a root or tier URL makes first, before the URL
    is parsed, logged, shown, or written to a file (run.json, pointers): a URL travels into all
    of these. A user name alone is allowed (Azure's ``container@account...`` form).

    Raises:
        ValidationError: saying to pass the credentials in ``storage_options``; the message
            never holds the user info.
    """
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str):
        return
    refuse_mistyped_url(url, what)
    shown = _password_in(url)
    if shown is not None:
        raise ValidationError(
            f"the {what} URL {shown} carries a password in its user info (user:password@ before the host; shown "
            "here as ***): a URL is logged, shown and written to files, so it must hold no secret. Give the URL "
            "without it and pass the credentials in storage_options, e.g. storage_options={'key': ..., "
            "'secret': ...} for s3://, {'account_name': ..., 'account_key': ...} (or 'sas_token', "
            "'connection_string') for az:// / abfs://; a user name alone (az://container@account...) is fine")


#: ``s3:/b/r``, ``s3:b/r``, ``s3//b/r`` (a scheme fsspec knows, then no ``://``); group 1 the scheme, 3 the rest
_MISTYPED = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)(:/(?!/)|:(?![/:\\])|:\\+|//)(.*)$", re.DOTALL)


def _known_schemes() -> set[str]:
    """The URL schemes fsspec knows (its registry and the implementations it knows by name)."""
    try:
        from fsspec.registry import known_implementations, registry
    except ImportError:  # no fsspec: every root is local
        return set()
    return {str(k).lower() for k in (*known_implementations, *registry)}


def refuse_mistyped_url(url: str, what: str = "root") -> None:
    """Refuse a path that is a blob URL with a broken scheme: ``s3:/bucket/run``, ``az:c/run``,
    ``abfs:/...``, ``gs:/...``, ``s3//bucket/run`` (a scheme fsspec knows, followed by ``:/``,
    ``:`` or ``//`` instead of ``://``). Without this it would silently become a local folder
    (``./s3:/bucket/run``). A local path is never refused for a colon or a folder named like a
    scheme elsewhere: ``s3/bucket``, ``ckpt:v2/run``, ``/data/s3:/x``, and ``./s3:/x`` (a
    leading ``./`` says "a local path") all stay local.

    Raises:
        ValidationError: naming the root and the URL it likely meant.
    """
    if url.startswith("file://"):
        _file_url_path(url, what)
        return
    m = _MISTYPED.match(url)
    if m is None or m.group(1).lower() not in _known_schemes():
        return
    scheme, rest = m.group(1).lower(), m.group(3).replace("\\", "/").lstrip("/")
    user, at, host = rest.rpartition("@")
    if at and ":" in user:  # a password in the user info: never shown (a user name alone is Azure's container)
        rest = "***@" + host
        url = f"{m.group(1)}{m.group(2)}{rest}"
    meant = f"{scheme}:///{rest}" if scheme in ("file", "local") else f"{scheme}://{rest}"
    raise ValidationError(f"the {what} {url!r} looks like a URL with a broken scheme (it would become a local folder "
                          f"named {url.split('/')[0]!r}): did you mean {meant!r}? For a local folder of that name, "
                          f"write it as './{url}'")


def _file_url_path(url: str, what: str) -> str:
    """The path of the ``file://`` URL ``url``: ``file:///p`` and ``file://localhost/p`` are ``/p``.

    Raises:
        ValidationError: another host: ``file://tmp/run``, the slip for ``file:///tmp/run``, would be
            a folder under the current directory.
    """
    rest = url[len("file://"):]
    host, _, path = rest.partition("/")
    if not host:
        return rest
    if host.lower() == "localhost":
        return "/" + path
    raise ValidationError(f"the {what} {url!r} names the host {host!r} (it would become a local folder under the "
                          "current directory); a file URL is 'file:///absolute/path' (three slashes) or "
                          f"'file://localhost/absolute/path': did you mean 'file:///{rest}'?")


def strip_credentials(url: str) -> str:
    """Drop a password and the query string from a URL (they may carry secrets). A user name
    alone stays: it names the container in Azure's ``abfs://container@account...``."""
    hidden = _password_in(url)
    if hidden is not None:  # never parsed: the parser's errors would quote the password
        return re.split(r"[?#]", hidden, maxsplit=1)[0]  # the query too (a SAS token, a signature)
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable url>"
    if not parts.scheme:
        return url
    netloc = (f"{parts.username}@" if parts.username else "") + (parts.hostname or "")
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def local_path(url: str) -> Optional[str]:
    """The local path of ``url`` if it is a path or a file:// URL, else None.

    Raises:
        ValidationError: a ``file://`` URL naming a host other than ``localhost`` (``file://tmp/run``,
            the slip for ``file:///tmp/run``, would be a folder under the current directory).
    """
    if url.startswith("file://"):
        return _file_url_path(url, "URL")
    if "://" in url:
        return None
    return os.path.expanduser(url)


def canonical_root(root: str) -> str:
    """A stable identity for a root: absolute path for local roots, the credential-free URL otherwise."""
    p = local_path(root)
    return os.path.realpath(p) if p is not None else strip_credentials(root).rstrip("/")
