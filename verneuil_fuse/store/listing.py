"""S3 ListObjectsV2 pages without boto3: the request's query and a lean
parser of the answer.

`S3Backend` (s3.py) sends its listings through the curl engine; this module
turns what it needs into the query string (`list_query`) and the XML answer
into plain tuples (`parse_list_page`), at a few microseconds of CPU per key
where botocore's parser, its datetime per key and its paginator cost tens.
It gives the values botocore gives for the same answer:

- keys: as the XML holds them, or, when the answer says
  ``<EncodingType>url</EncodingType>``, URL-decoded as botocore decodes them
  (`urllib.parse.unquote_plus`, here `decode_key`: the same result, cheaper);
- sizes: ints (0 when absent, as the boto3 path reads them);
- modification times: seconds since the epoch, the float that
  ``LastModified.timestamp()`` gives for botocore's datetime (`parse_time`);
- the continuation: IsTruncated is true only for the text ``true``, and the
  NextContinuationToken, as botocore reads them.

An answer this module cannot read as botocore would (not a
ListBucketResult, malformed XML, an entry without key or time, a time that
is not ISO 8601, a raw carriage return that XML would turn into a line
feed) raises `ListingFormatError`: the caller asks boto3 instead.  The
parser is the standard library's expat, which resolves no external entity
and bounds entity expansion.
"""
from __future__ import annotations

import codecs
import datetime
import urllib.parse
import xml.parsers.expat as expat

# The answer's root element, in S3's default namespace
# (http://s3.amazonaws.com/doc/2006-03-01/), or none for some compatible
# servers: names are compared as written (`_read_page`).
ROOT_TAG = "ListBucketResult"
# Longest text of one element read, in characters: S3 keys are at most 1 KiB
# (3 KiB URL-encoded), tokens far less; a longer one (an entity expanding
# without end) is no listing of S3's, and stops the parse at once.
MAX_TEXT = 64 << 10


class ListingFormatError(ValueError):
    """An answer this module cannot read exactly as botocore would."""


def list_query(prefix: str, max_keys: int, token: str | None, delimiter: str = "/") -> str:
    """The query string of a ListObjectsV2 request for keys starting with
    `prefix` (empty: all), at most `max_keys` of them, after continuation
    `token`, folding keys with a further `delimiter` into CommonPrefixes,
    URL-encoded keys in the answer.  Already in SigV4's canonical form
    (parameters sorted, values percent-encoded but for RFC 3986's
    unreserved characters), so the signed query is the one sent."""
    params = []
    if token:
        params.append("continuation-token=" + urllib.parse.quote(token, safe=""))
    if delimiter:
        params.append("delimiter=" + urllib.parse.quote(delimiter, safe=""))
    params.append("encoding-type=url")
    params.append("list-type=2")
    params.append("max-keys=%d" % max_keys)
    if prefix:
        params.append("prefix=" + urllib.parse.quote(prefix, safe=""))
    return "&".join(params)


_escape_decode = codecs.escape_decode  # bytes escapes (\xNN) in C
_unquote_plus = urllib.parse.unquote_plus


def decode_key(text: str) -> str:
    """`urllib.parse.unquote_plus(text)` (what botocore applies to keys of
    an answer with EncodingType url), in a few C calls for the usual
    encoded key: ASCII, "+" for spaces, "%XX" for the rest, valid UTF-8."""
    if "%" not in text:
        return text.replace("+", " ") if "+" in text else text
    if text.isascii() and "\\" not in text:
        try:
            raw = _escape_decode(text.replace("+", " ").replace("%", "\\x").encode("ascii"))[0]
            return raw.decode("utf-8")
        except ValueError:  # a "%" without two hex digits, or not UTF-8
            pass
    return _unquote_plus(text)


_fromisoformat = datetime.datetime.fromisoformat


def parse_time(text: str) -> float:
    """Seconds since the epoch of an ISO 8601 time ("2024-05-01T12:34:56.789Z"):
    exactly ``LastModified.timestamp()`` of the datetime botocore parses from
    it (both are aware datetimes, both truncate fractions to microseconds;
    a time without zone is local time in both).  `ListingFormatError` for
    any other form (botocore also reads RFC 822 dates and epoch numbers)."""
    try:
        if text[10:11] == "T" and text[4:5] == "-":  # S3's extended form, no week dates
            return _fromisoformat(text).timestamp()
    except (TypeError, ValueError, OverflowError):
        pass
    raise ListingFormatError("not an ISO 8601 time: %r" % (text[:100],))


def parse_list_page(body: bytes) -> tuple[list[tuple[str, int, float]], str | None]:
    """The entries of a ListObjectsV2 answer, ``(key, size, mtime)`` each in
    the answer's order, and the continuation token of the next page (None:
    this page is the last).  Keys are whole (the caller strips its own
    prefix); CommonPrefixes are left out.  `ListingFormatError` for an
    answer that cannot be read as botocore would read it."""
    keys, sizes, stamps, top = _read_page(body)
    if top.get("EncodingType") == "url":
        keys = [decode_key(key) for key in keys]
    elif b"\r" in body:
        # XML reads a raw CR (in a key not URL-encoded) as LF.
        raise ListingFormatError("raw carriage return in a listing")
    times: dict[str, float] = {}  # a page's entries often share their time
    mtimes = []
    for stamp in stamps:
        mtime = times.get(stamp)
        if mtime is None:
            mtime = times[stamp] = parse_time(stamp)
        mtimes.append(mtime)
    try:
        sizes = [int(size) if size else 0 for size in sizes]
    except ValueError:
        raise ListingFormatError("listing entry with a size that is no number") from None
    token = top.get("NextContinuationToken") if top.get("IsTruncated") == "true" else None
    return list(zip(keys, sizes, mtimes)), token or None


def _read_page(body: bytes) -> tuple[list[str], list[str | None], list[str], dict[str, str | None]]:
    """The texts of a ListBucketResult: each entry's Key, Size (None when
    absent) and LastModified in three lists, and the top-level elements'
    texts by name.  Element names are compared as written: S3 and the
    servers like it use a default namespace, never a prefix; a prefixed
    document is no ListBucketResult here (boto3 then reads it).  The
    handlers make few allocations the garbage collector tracks (an element
    tree of a 1000-key page is 7000 of them, and the collections they cause
    cost more than the parse)."""
    keys: list[str] = []
    sizes: list[str | None] = []
    stamps: list[str] = []
    top: dict[str, str | None] = {}
    text: str | None = None
    depth = 0
    entry = False  # inside a Contents element
    key = size = stamp = None

    def start(name: str, attrs: list) -> None:
        nonlocal text, depth, entry, key, size, stamp
        depth += 1
        text = None
        if depth == 2:
            if name == "Contents":
                entry = True
                key = size = stamp = None
        elif depth == 1 and name != ROOT_TAG:
            raise ListingFormatError("not a ListBucketResult: %r" % (name[:100],))

    def data(chunk: str) -> None:
        nonlocal text
        if text is None:
            text = chunk
        elif len(text) < MAX_TEXT:
            text += chunk
        else:
            raise ListingFormatError("listing element text over %d characters" % MAX_TEXT)

    def end(name: str) -> None:
        nonlocal text, depth, entry, key, size, stamp
        if depth == 3:
            if entry:
                if name == "Key":
                    key = text or ""
                elif name == "LastModified":
                    stamp = text or ""
                elif name == "Size":
                    size = text
        elif depth == 2:
            if not entry:
                top[name] = text
            elif key is None or stamp is None:
                raise ListingFormatError("listing entry without Key or LastModified")
            else:
                entry = False
                keys.append(key)
                sizes.append(size)
                stamps.append(stamp)
        depth -= 1
        text = None

    parser = expat.ParserCreate()
    parser.buffer_text = True  # one call per text, entities included
    parser.ordered_attributes = True  # a list, cheaper than a dict
    parser.StartElementHandler = start
    parser.CharacterDataHandler = data
    parser.EndElementHandler = end
    try:
        parser.Parse(body, True)
    except expat.ExpatError as exc:
        raise ListingFormatError("malformed listing: %s" % (exc,)) from None
    return keys, sizes, stamps, top
