"""The fixed set of outcomes a Conceptual Captions row can have.

Every row of the accounting parquet carries exactly one of these, so failure kinds can be counted
and compared across shards and runs. Adding a kind means adding it here; nothing else invents one.
"""

from __future__ import annotations

OK = "ok"
MALFORMED_ROW = "malformed_row"  # the TSV line itself is unusable (field count, empty field, encoding)
DUPLICATE_URL = "duplicate_url"  # an earlier row of the same split has this URL; that row holds the image
UNSUPPORTED_URL = "unsupported_url"  # a URL shape the downloader cannot fetch (no scheme, no host, a remote file://)
REFUSED_SCHEME = "refused_scheme"  # a scheme not fetched (not http(s), or file:// without allow_file_urls), or a redirect to one
NOT_FOUND = "not_found"  # HTTP 404/410, or a file:// path that does not exist
HTTP_ERROR = "http_error"  # any other HTTP failure: 5xx after retries, other 4xx, redirect loops
TIMEOUT = "timeout"  # connect/read timeout or the per-attempt deadline, after retries
CONNECTION_ERROR = "connection_error"  # refused, reset, DNS, TLS, truncated body, after retries
IO_ERROR = "io_error"  # a local file that exists but cannot be read (permissions, a directory)
TOO_LARGE = "too_large"  # body over max_bytes, or an image over the decompression-bomb pixel cap
NOT_AN_IMAGE = "not_an_image"  # the bytes are not in any image format Pillow knows (HTML, text)
DECODE_ERROR = "decode_error"  # an image format was recognised but the pixels would not decode

ALL_STATUSES: tuple[str, ...] = (
    OK,
    MALFORMED_ROW,
    DUPLICATE_URL,
    UNSUPPORTED_URL,
    REFUSED_SCHEME,
    NOT_FOUND,
    HTTP_ERROR,
    TIMEOUT,
    CONNECTION_ERROR,
    IO_ERROR,
    TOO_LARGE,
    NOT_AN_IMAGE,
    DECODE_ERROR,
)
FAILURE_STATUSES: frozenset[str] = frozenset(ALL_STATUSES) - {OK}
