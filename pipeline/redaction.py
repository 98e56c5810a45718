"""Masking secrets that URLs carry, in a URL or anywhere in a text (safe to show).

The bottom layer, importing nothing of the pipeline: :func:`pipeline.errors.error_text`
masks every handler and relay error with it before the text is stored or shown, and the
settings (:mod:`pipeline.config`) and the driver errors mask their own URLs with it.

A URL carries a secret in two places: ``user:password@`` and query parameters named for
one (``password=``, ``sslpassword=``, ``api_key=``, ``token=``, ``secret=``,
``signature=`` and the like). Both become ``***``; the rest of the URL stays readable.
"""

from __future__ import annotations

import re
from urllib.parse import unquote, urlsplit, urlunsplit

# A query parameter whose name says it holds a secret: password=, sslpassword= (libpq
# reads both), api_key=, access_token=, client_secret=, signature=, auth= and the like.
_QUERY_SECRET = re.compile(
    r"((?:^|[&;])[^=&;]*(?:pass|pwd|secret|token|key|auth|sig|credential|session)[^=&;]*=)"
    r"[^&;]*",
    re.IGNORECASE,
)
# A URL inside free text (an HTTP client's error quotes the one it called), up to a
# space, a quote or a bracket; trailing punctuation of the sentence is not part of it.
_URL_IN_TEXT = re.compile(r"""[A-Za-z][A-Za-z0-9+.-]*://[^\s'"`<>()\[\]{}]+""")
_TRAILING = ".,;:!?"


def redact_url(url: str) -> str:
    """Return ``url`` with any password replaced by ``***`` (safe to log).

    Both places a URL can carry one are covered: ``user:password@`` and query
    parameters named for a secret (``password=``, ``sslpassword=``, ``api_key=``,
    ``token=``, ``secret=``, ``signature=`` and the like).
    """
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return "<unparseable url>"
    if password is not None:
        netloc = parts.netloc.rsplit("@", 1)[1]
        parts = parts._replace(netloc=f"{parts.username or ''}:***@{netloc}")
    if parts.query:
        parts = parts._replace(query=_QUERY_SECRET.sub(r"\1***", parts.query))
    return urlunsplit(parts)


def url_secrets(url: str) -> list[str]:
    """The passwords ``url`` carries, as written and percent-decoded (longest first)."""
    found: set[str] = set()
    userinfo = url.split("://", 1)[-1].split("/", 1)[0].rpartition("@")[0]
    if ":" in userinfo:
        found.add(userinfo.split(":", 1)[1])
    query = url.partition("?")[2].partition("#")[0]
    for match in _QUERY_SECRET.finditer(query):
        found.add(match.group(0).split("=", 1)[1])
    found |= {unquote(secret) for secret in found}
    return sorted((secret for secret in found if secret), key=len, reverse=True)


def redact_secrets(text: str, *urls: str) -> str:
    """``text`` with every password of ``urls`` replaced by ``***``.

    The last guard before a driver's message is shown: libpq and redis-py may quote the
    URL they were given when it does not parse.
    """
    for url in urls:
        text = text.replace(url, redact_url(url))
        for secret in url_secrets(url):
            text = mask_secret(text, secret)
    return text


def redact_text(text: str) -> str:
    """``text`` with the secrets of every URL in it masked, wherever they appear in it.

    For text nobody has vetted: a handler's error (``Client error '401' for url
    'https://api.example/charge?api_key=…'``), a driver's message. A secret the URL
    carries is also masked where the text repeats it outside the URL.
    """
    if "://" not in text:
        return text
    urls = {match.rstrip(_TRAILING) for match in _URL_IN_TEXT.findall(text)}
    return redact_secrets(text, *sorted(urls, key=len, reverse=True))


def mask_secret(text: str, secret: str) -> str:
    """``text`` with ``secret`` replaced by ``***`` wherever it stands alone: a password
    ``p`` must not turn ``port`` into ``***ort``."""
    before = r"(?<!\w)" if secret[:1].isalnum() or secret[:1] == "_" else ""
    after = r"(?!\w)" if secret[-1:].isalnum() or secret[-1:] == "_" else ""
    return re.sub(before + re.escape(secret) + after, "***", text) if secret else text
