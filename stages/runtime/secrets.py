"""Credentials stay out of what unirl writes: recipe.yaml, MLflow params, Prefect parameters and
artifacts, logs. Recipes refuse literal credentials (they point at environment variables or
Prefect Secret blocks instead), URLs shown to people lose their user:password part, and access
logs lose the values of query parameters that look like credentials (a client that puts
`?token=...` in a URL by mistake must not leave it in a log)."""
from __future__ import annotations

import logging
import re
from typing import Any
from urllib.parse import unquote_plus, urlsplit

# Names of fields that hold credentials (a name ending in one of these words).
SECRET_NAME = re.compile(r"(^|[_\-.])(token|secret|secrets|password|passwd|pwd|api[_\-]?key|apikey|access[_\-]?key|"
                         r"secret[_\-]?key|private[_\-]?key|credentials?|auth|authorization|session[_\-]?token)$", re.I)
REDACTED = "***"


def is_secret_name(name: str) -> bool:
    return bool(SECRET_NAME.search(str(name)))


def literal_secrets(value: Any, path: str, also: tuple[str, ...] = ()) -> list[str]:
    """`path.to.field` of every non-empty string under a credential-looking key in `value`
    (or a key named in `also`: fsspec calls an S3 access key id plainly `key`)."""
    found: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}"
            if (is_secret_name(key) or key in also) and isinstance(item, str) and item:
                found.append(where)
            else:
                found += literal_secrets(item, where, also)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found += literal_secrets(item, f"{path}.{i}", also)
    return found


def redact_url(url: str) -> str:
    """`scheme://user:***@host/...` and credential-looking query values as ***; everything else
    exactly as given (`sqlite:////abs/m.db` keeps its four slashes, `s3://` its two): only the
    secret characters are replaced, the URL is never re-assembled."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    out = url
    if "@" in parts.netloc:
        userinfo, host = parts.netloc.rsplit("@", 1)
        netloc = f"{userinfo.split(':', 1)[0]}:{REDACTED}@{host}" if ":" in userinfo else f"{REDACTED}@{host}"
        out = out.replace(f"//{parts.netloc}", f"//{netloc}", 1)
    if parts.query:
        start = out.index("?") + 1
        end = start + len(parts.query)
        pairs = []
        for pair in parts.query.split("&"):
            key, eq, value = pair.partition("=")
            pairs.append(f"{key}={REDACTED}" if eq and value and is_secret_name(unquote_plus(key)) else pair)
        out = out[:start] + "&".join(pairs) + out[end:]
    return out


_QUERY_SECRET = re.compile(r"([?&](?:[^=&\s\"']*[_\-.])?(?:token|secret|password|passwd|api[_\-]?key|apikey|access[_\-]?key|"
                           r"auth|credentials?)=)[^&\s\"']*", re.I)


def redact_text(text: str) -> str:
    """Credential-looking query values in free text (a request line of an access log) as ***."""
    return _QUERY_SECRET.sub(lambda m: m.group(1) + REDACTED, text)


class RedactingFilter(logging.Filter):
    """A logging filter that redacts credential-looking query values from a record's message and
    arguments (uvicorn's access log passes the request path as an argument)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact_text(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(redact_text(a) if isinstance(a, str) else a for a in record.args)
        return True
