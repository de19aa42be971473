"""S3 listings through the curl engine (store/listing.py and the listing
part of store/s3.py): the parser alone on captured and generated
ListObjectsV2 answers, checked against botocore's own parser; then the
engine's listings against boto3's on moto's server (odd keys, pages,
prefixes, empty buckets, errors, signatures checked), and the fallbacks to
boto3 for what the engine cannot serve."""
from __future__ import annotations

import datetime
import http.client
import http.server
import threading
import time
import urllib.parse
from xml.sax.saxutils import escape

import botocore.handlers
import botocore.parsers
import botocore.session
import botocore.utils
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verneuil_fuse.store import AccessDenied, BucketNotFound, ObjectInfo, TransientError, open_store
from verneuil_fuse.store.curl import Response
from verneuil_fuse.store.listing import (
    ListingFormatError,
    decode_key,
    list_query,
    parse_list_page,
    parse_time,
)
from verneuil_fuse.store.s3 import S3Backend

NS = "http://s3.amazonaws.com/doc/2006-03-01/"
# Keys S3 stores and lists (moto refuses control characters in keys).
ODD_KEYS = ["a b", "a+b", "a%2Bb", "ü-ñ", "%2F%25%", "~!*'()&=?#", "x<y>&\"'", "tab\tx", "日本語",
            "a%zz", "cr\rx", "x" * 255, "é" * 127, "a..b", "emoji-\U0001f600", "sp ace+plus%20"]

_OUTPUT = botocore.session.get_session().get_service_model("s3").operation_model("ListObjectsV2").output_shape


def botocore_reads(body: bytes) -> tuple[list[tuple[str, int, float]], str | None]:
    """What the boto3 path makes of `body`: botocore's parser and its URL
    decoding of keys, then `S3Backend._list_page_boto3`'s conversion."""
    parsed = botocore.parsers.create_parser("rest-xml").parse(
        {"body": body, "headers": {}, "status_code": 200}, _OUTPUT)
    botocore.handlers.decode_list_object_v2(parsed, context={"encoding_type_auto_set": True})
    entries = [(c["Key"], int(c.get("Size", 0)), c["LastModified"].timestamp()) for c in parsed.get("Contents", ())]
    token = parsed.get("NextContinuationToken")
    return entries, (token if parsed.get("IsTruncated") and token else None)


def page(entries, *, encoded=True, truncated=False, token=None, ns=NS, sep="", extra="") -> bytes:
    """A ListObjectsV2 answer as S3 writes it: `entries` of (key, size,
    LastModified text); keys URL-encoded as S3 does when `encoded`; `sep`
    between elements (pretty-printing)."""
    items = []
    for key, size, stamp in entries:
        text = urllib.parse.quote_plus(key, safe="") if encoded else escape(key, {'"': "&quot;"})
        fields = ["<Key>%s</Key>" % text, "<LastModified>%s</LastModified>" % stamp,
                  "<ETag>&quot;0cc175b9c0f1b6a831c399e269772661&quot;</ETag>"]
        if size is not None:
            fields.append("<Size>%s</Size>" % size)
        fields += ["<Owner><ID>75aa</ID><DisplayName>webfile</DisplayName></Owner>",
                   "<StorageClass>STANDARD</StorageClass>"]
        items.append("<Contents>%s%s%s</Contents>" % (sep, sep.join(fields), sep))
    top = ["<Name>bucket</Name>", "<Prefix></Prefix>", "<KeyCount>%d</KeyCount>" % len(entries),
           "<MaxKeys>1000</MaxKeys>", "<Delimiter>/</Delimiter>",
           "<IsTruncated>%s</IsTruncated>" % ("true" if truncated else "false")]
    if encoded:
        top.append("<EncodingType>url</EncodingType>")
    if token is not None:
        top.append("<NextContinuationToken>%s</NextContinuationToken>" % escape(token))
    xmlns = ' xmlns="%s"' % ns if ns else ""
    return ('<?xml version="1.0" encoding="UTF-8"?>\n<ListBucketResult%s>%s%s%s%s</ListBucketResult>' % (
        xmlns, sep, sep.join(top + items), extra, sep)).encode("utf-8")


# -- the parser alone ----------------------------------------------------------

# A ListObjectsV2 answer of AWS S3 (from its documentation, one key with
# entities and character references added), not URL-encoded.
CAPTURED_S3 = b"""<?xml version="1.0" encoding="UTF-8"?>
<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">
    <Name>bucket</Name>
    <Prefix/>
    <KeyCount>3</KeyCount>
    <MaxKeys>1000</MaxKeys>
    <IsTruncated>true</IsTruncated>
    <NextContinuationToken>1ueGcxLPRx1Tr/XYExHnhbYLgveDs2J/wm36Hy4vbOwM=</NextContinuationToken>
    <Contents>
        <Key>ExampleObject.txt</Key>
        <LastModified>2013-09-17T18:07:53.000Z</LastModified>
        <ETag>"599bab3ed2c697f1d26842727561fd94"</ETag>
        <Size>857</Size>
        <StorageClass>REDUCED_REDUNDANCY</StorageClass>
    </Contents>
    <Contents>
        <Key>R&amp;D &lt;x&gt; &#233;t&#xE9; &quot;q&quot; &apos;a&apos; caf\xc3\xa9</Key>
        <LastModified>2024-02-29T23:59:59.123456Z</LastModified>
        <Size>0</Size>
    </Contents>
    <CommonPrefixes><Prefix>photos/</Prefix></CommonPrefixes>
    <Contents>
        <Key>no-size</Key>
        <LastModified>1969-12-31T23:59:59.999Z</LastModified>
    </Contents>
</ListBucketResult>"""

# moto's answer to a listing with encoding-type=url, as it came.
CAPTURED_MOTO = (
    b'<?xml version="1.0" encoding="utf-8"?>\n<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
    b'<IsTruncated>false</IsTruncated><Contents><Key>%252F%2525%25</Key><LastModified>2026-11-27T03:08:51.000Z'
    b'</LastModified><ETag>"afcf6192baefba4c01e43e8d1afbf8a6"</ETag><ChecksumAlgorithm>CRC32</ChecksumAlgorithm>'
    b'<Size>7</Size><StorageClass>STANDARD</StorageClass></Contents><Contents><Key>a%2Bb</Key><LastModified>'
    b'2026-11-27T03:08:51.000Z</LastModified><ETag>"65c884f742c8591808a121a828bc09f8"</ETag><Size>3</Size>'
    b'<StorageClass>STANDARD</StorageClass></Contents><Contents><Key>x%3Cy%3E%26%22%27</Key><LastModified>'
    b'2026-11-27T03:08:52.000Z</LastModified><ETag>"e76a009ea935dd61ff1afcdf9f2e7dca"</ETag><Size>7</Size>'
    b'<StorageClass>STANDARD</StorageClass></Contents><Contents><Key>%C3%BC-%C3%B1</Key><LastModified>'
    b'2026-11-27T03:08:51.000Z</LastModified><ETag>"3a2dd2c4fe3204ba6a297ff568aa1857"</ETag><Size>5</Size>'
    b'<StorageClass>STANDARD</StorageClass></Contents><Name>chunks-0-754e8c67</Name><Prefix/><MaxKeys>1000'
    b'</MaxKeys><EncodingType>url</EncodingType><KeyCount>4</KeyCount></ListBucketResult>')


def test_parser_reads_captured_answers():
    entries, token = parse_list_page(CAPTURED_S3)
    assert token == "1ueGcxLPRx1Tr/XYExHnhbYLgveDs2J/wm36Hy4vbOwM="
    assert entries == [
        ("ExampleObject.txt", 857, 1379441273.0),
        ("R&D <x> été \"q\" 'a' café", 0, 1709251199.123456),
        ("no-size", 0, -0.001),
    ]
    assert (entries, token) == botocore_reads(CAPTURED_S3)
    entries, token = parse_list_page(CAPTURED_MOTO)
    assert token is None
    assert [e[0] for e in entries] == ["%2F%25%", "a+b", "x<y>&\"'", "ü-ñ"]
    assert (entries, token) == botocore_reads(CAPTURED_MOTO)


@pytest.mark.parametrize("body", [
    page([]),
    page([], encoded=False),
    page([], truncated=True),  # truncated without a token: the last page, as boto3's path reads it
    page([("k", 1, "2024-01-01T00:00:00.000Z")], truncated=True, token=""),
    page([("k", 1, "2024-01-01T00:00:00.000Z")], truncated=False, token="ignored"),
    page([("k", 1, "2024-01-01T00:00:00Z")], ns=""),  # no namespace
    page([("a b", 2, "2024-01-01T00:00:00.5+02:00"), ("c", None, "2024-01-01T00:00:00.000Z")],
         sep="\r\n  ", truncated=True, token="t+/=="),  # pretty-printed, CRLF
    page([("k", 1, "2024-01-01T00:00:00.000Z")],
         extra="<CommonPrefixes><Prefix>dir/</Prefix></CommonPrefixes><StartAfter>x</StartAfter>"),
], ids=["empty", "empty-plain", "truncated-no-token", "empty-token", "not-truncated", "no-ns",
        "pretty", "common-prefixes"])
def test_parser_agrees_with_botocore_on_shapes(body):
    assert parse_list_page(body) == botocore_reads(body)


@pytest.mark.parametrize("body, why", [
    (b"<Error><Code>NoSuchBucket</Code><Message>x</Message></Error>", "not a ListBucketResult"),
    (b'<s3:ListBucketResult xmlns:s3="%s"></s3:ListBucketResult>' % NS.encode(), "not a ListBucketResult"),
    (page([("k", 1, "2024-01-01T00:00:00.000Z")])[:-30], "malformed"),
    (b"", "malformed"),
    (b"<ListBucketResult><Contents><Key>k</Key></Contents></ListBucketResult>", "without Key or LastModified"),
    (b"<ListBucketResult><Contents><LastModified>2024-01-01T00:00:00Z</LastModified></Contents>"
     b"</ListBucketResult>", "without Key or LastModified"),
    (page([("k", 1, "Mon, 01 Jan 2024 00:00:00 GMT")]), "ISO 8601"),
    (page([("k", 1, "1704067200")]), "ISO 8601"),
    (page([("k", "12x", "2024-01-01T00:00:00Z")]), "size"),
    (page([("cr\rx", 1, "2024-01-01T00:00:00Z")], encoded=False), "carriage return"),
])
def test_parser_refuses_what_it_cannot_read_as_botocore(body, why):
    with pytest.raises(ListingFormatError, match=why):
        parse_list_page(body)


def test_parser_bounds_entity_expansion():
    bomb = (b'<?xml version="1.0"?><!DOCTYPE l [<!ENTITY a "aaaaaaaaaa">'
            + b"".join(b'<!ENTITY %c "%s">' % (ord("b") + i, (b"&%c;" % (ord("a") + i)) * 10) for i in range(8))
            + b"]><ListBucketResult><Contents><Key>&i;</Key></Contents></ListBucketResult>")
    with pytest.raises(ListingFormatError):
        parse_list_page(bomb)


_key_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=40)
# Characters XML 1.0 can carry (others need URL encoding); no CR (XML reads it as LF).
_xml_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc"), exclude_characters="\ufffe\uffff")
                    | st.sampled_from("\t\n"), min_size=1, max_size=40)
_stamps = st.builds(
    lambda when, digits, zone: when.strftime("%Y-%m-%dT%H:%M:%S")
    + ("." + ("%06d" % when.microsecond + "987")[:digits] if digits else "") + zone,
    st.datetimes(min_value=datetime.datetime(1900, 1, 1), max_value=datetime.datetime(2200, 1, 1)),
    st.integers(0, 9), st.sampled_from(["Z", "+00:00", "-07:30", "+05:45"]))


@settings(max_examples=200, deadline=None)
@given(keys=st.lists(_key_text, max_size=8), stamps=st.lists(_stamps, min_size=8, max_size=8),
       sizes=st.lists(st.integers(0, 1 << 40), min_size=8, max_size=8), token=st.none() | _xml_text)
def test_parser_agrees_with_botocore_on_url_encoded_pages(keys, stamps, sizes, token):
    body = page(list(zip(keys, sizes, stamps)), truncated=token is not None, token=token)
    assert parse_list_page(body) == botocore_reads(body)


@settings(max_examples=200, deadline=None)
@given(keys=st.lists(_xml_text, max_size=8), stamps=st.lists(_stamps, min_size=8, max_size=8))
def test_parser_agrees_with_botocore_on_plain_pages(keys, stamps):
    body = page([(k, i, s) for i, (k, s) in enumerate(zip(keys, stamps))], encoded=False)
    assert parse_list_page(body) == botocore_reads(body)


@settings(max_examples=500, deadline=None)
@given(text=st.lists(st.sampled_from(list("ab+% \\%2F0zZ9é\U0001f600") + ["%C3", "%A9", "%ff", "%2", "%E2%82"]))
       .map("".join) | _key_text.map(lambda k: urllib.parse.quote_plus(k, safe="")))
def test_decode_key_is_unquote_plus(text):
    assert decode_key(text) == urllib.parse.unquote_plus(text)


@settings(max_examples=500, deadline=None)
@given(stamp=_stamps)
def test_parse_time_is_botocore_timestamp(stamp):
    assert parse_time(stamp) == botocore.utils.parse_timestamp(stamp).timestamp()


def test_list_query_is_canonical():
    assert list_query("", 1000, None) == "delimiter=%2F&encoding-type=url&list-type=2&max-keys=1000"
    query = list_query("chunks/é a+", 2, "1ue/G+x=")
    assert query == ("continuation-token=1ue%2FG%2Bx%3D&delimiter=%2F&encoding-type=url&list-type=2"
                     "&max-keys=2&prefix=chunks%2F%C3%A9%20a%2B")
    names = [part.split("=")[0] for part in query.split("&")]
    assert names == sorted(names)


# -- against moto's server -------------------------------------------------------


def engine_only(backend: S3Backend, monkeypatch) -> None:
    """Make sure the engine serves `backend`'s listings: boto3's page is an error."""
    def refuse(*args):
        raise AssertionError("boto3 listed a page")
    monkeypatch.setattr(backend, "_list_page_boto3", refuse)


def boto3_twin(backend: S3Backend) -> S3Backend:
    """The same bucket and prefix, listed by boto3 only."""
    return S3Backend(backend.client, backend.bucket, backend.prefix, page_size=backend.page_size, use_engine=False)


def both_lists(backend: S3Backend, prefix: str = "") -> tuple[list[ObjectInfo], list[ObjectInfo]]:
    return list(backend.list(prefix)), list(boto3_twin(backend).list(prefix))


@pytest.mark.parametrize("page_size", [1000, 3, 1])
def test_engine_lists_what_boto3_lists(s3_server, monkeypatch, page_size):
    store = s3_server.make_store(page_size=page_size)
    with store:
        c = store.chunks
        engine_only(c, monkeypatch)
        assert both_lists(c) == ([], [])  # an empty bucket
        for key in ODD_KEYS:
            s3_server.admin.put_object(Bucket=c.bucket, Key=key, Body=key.encode())
        s3_server.admin.put_object(Bucket=c.bucket, Key="dir/nested", Body=b"folded into CommonPrefixes")
        s3_server.admin.put_object(Bucket=c.bucket, Key=".hidden", Body=b"not a key of ours")
        listed, expected = both_lists(c)
        assert listed == expected
        assert sorted(info.key for info in listed) == sorted(ODD_KEYS)
        assert {info.key: info.size for info in listed} == {k: len(k.encode()) for k in ODD_KEYS}
        for prefix in ("a", "a+", "a b", "é", "日", "%2F", "~!*'()&=?", "nothing", "x<"):
            listed, expected = both_lists(c, prefix)
            assert listed == expected
            assert sorted(info.key for info in listed) == sorted(k for k in ODD_KEYS if k.startswith(prefix))
        assert c._engine_lists and c.use_engine


def test_engine_lists_a_prefixed_store(s3_server, monkeypatch):
    store = s3_server.make_store(single_bucket=True, page_size=2)
    with store:
        for i in range(5):
            store.chunks.put("c%d" % i, b"c")
            store.manifests.put("m%d" % i, b"m")
        for backend, stem in ((store.chunks, "c"), (store.manifests, "m")):
            engine_only(backend, monkeypatch)
            listed, expected = both_lists(backend)
            assert listed == expected
            assert [info.key for info in listed] == ["%s%d" % (stem, i) for i in range(5)]
            assert both_lists(backend, stem + "1") == (listed[1:2], listed[1:2])


def test_engine_listing_is_lazy(s3_server, monkeypatch):
    store = s3_server.make_store(page_size=2)
    with store:
        c = store.chunks
        for i in range(5):
            c.put("lazy%d" % i, b"x")
        engine_only(c, monkeypatch)
        before = s3_server.counts().get("LIST", 0)
        it = c.list("lazy")
        assert next(it).key == "lazy0"
        assert s3_server.counts().get("LIST", 0) - before == 1  # one page asked for so far
        assert [info.key for info in it] == ["lazy1", "lazy2", "lazy3", "lazy4"]
        assert s3_server.counts().get("LIST", 0) - before == 3


class _FakeEngine:
    """Takes the engine's requests and answers them with `body` at once."""

    def __init__(self, body: bytes):
        self.body = body
        self.requests = []

    def submit(self, request, done):
        self.requests.append(request)
        done(Response(200, self.body))


@pytest.mark.parametrize("prefix, expected", [
    ("http://127.0.0.1:9000/bucket/", "http://127.0.0.1:9000/bucket?"),
    ("https://bucket.s3.eu-west-1.amazonaws.com/", "https://bucket.s3.eu-west-1.amazonaws.com/?"),
    ("http://host:9000/base/bucket/", "http://host:9000/base/bucket?"),
])
def test_engine_listing_urls(aws_env, monkeypatch, prefix, expected):
    """The listing's URL for each addressing style (the bucket's, as
    botocore lists it), the query, signing and time limits of the request."""
    from verneuil_fuse.store.s3 import LIST_REQUEST_TIMEOUT, make_client

    backend = S3Backend(make_client(endpoint="http://127.0.0.1:9", region="eu-west-1"), "bucket", "p/", page_size=7)
    engine = _FakeEngine(page([("p/k", 1, "2024-01-01T00:00:00Z")]))
    sigv4 = ("aws:amz:eu-west-1:s3", "AKID", "SECRET")
    monkeypatch.setattr(backend, "_engine_auth", lambda: (prefix, ["x-amz-content-sha256: UNSIGNED-PAYLOAD"], sigv4))
    engine_only(backend, monkeypatch)
    backend._engine = engine
    try:
        assert list(backend.list("k")) == [ObjectInfo("k", 1, 1704067200.0)]
    finally:
        backend._engine = None
        backend.close()
    (request,) = engine.requests
    assert request.url == expected + list_query("p/k", 7, None)
    assert request.method == "GET" and request.sigv4 == sigv4 and request.body is None
    assert request.max_bytes is None and request.timeout == LIST_REQUEST_TIMEOUT


def test_engine_listing_errors(s3_server, monkeypatch):
    store = open_store(s3_server.url("no-such-chunks-listing", "no-such-manifests-listing"))
    with store:
        engine_only(store.chunks, monkeypatch)
        with pytest.raises(BucketNotFound):
            list(store.chunks.list())
        assert store.chunks._engine is not None
    store = s3_server.make_store(connect_timeout=1.0, max_attempts=2)
    with store:
        store.chunks.put("k", b"v")
        engine_only(store.chunks, monkeypatch)
        s3_server.stop()
        try:
            started = time.monotonic()
            with pytest.raises(TransientError, match="cannot reach"):
                list(store.chunks.list())
            assert time.monotonic() - started < 10
        finally:
            s3_server.start()
        assert [info.key for info in store.chunks.list()] == ["k"]


@pytest.mark.s3
def test_engine_listing_signed_and_refused(aws_env, tmp_path, monkeypatch):
    """moto with its signature checks on: pages signed by libcurl (query,
    continuation tokens and all) are accepted; a wrong secret is access
    denied, at once."""
    import boto3

    from support.s3server import S3Server, moto_available, patched_environ

    if not moto_available():
        pytest.skip("moto[server] is not installed")
    with S3Server(auth=True, free_actions=3, log_dir=str(tmp_path)) as server:
        good = server.user_credentials("lister")
        with patched_environ(good):
            admin = boto3.session.Session().client("s3", endpoint_url=server.moto_endpoint, region_name="us-east-1")
            admin.create_bucket(Bucket="signed-listing")
            for name in ODD_KEYS[:8]:
                admin.put_object(Bucket="signed-listing", Key=name, Body=b"x")
            url = server.url("signed-listing", "signed-listing")
            with open_store(url) as store:
                store.chunks.page_size = 3
                engine_only(store.chunks, monkeypatch)
                listed = list(store.chunks.list())
                assert sorted(info.key for info in listed) == sorted(ODD_KEYS[:8])
                assert [info.key for info in store.chunks.list("a")] == ["a b", "a%2Bb", "a+b"]
        with patched_environ(dict(good, AWS_SECRET_ACCESS_KEY="not-the-secret")):
            with open_store(url) as store:
                engine_only(store.chunks, monkeypatch)
                started = time.monotonic()
                with pytest.raises(AccessDenied) as info:
                    list(store.chunks.list())
                assert time.monotonic() - started < 10
                assert "not-the-secret" not in str(info.value)


class _FrontHandler(http.server.BaseHTTPRequestHandler):
    """Forwards boto3's requests to moto; answers the engine's (libcurl
    sends no User-Agent) as `mode` says."""

    protocol_version = "HTTP/1.1"
    mode = "redirect"
    target = ""
    seen: list

    def do_GET(self):  # noqa: N802 - http.server's name
        if "Boto" in self.headers.get("User-Agent", ""):
            return self._forward()
        self.seen.append(self.path)
        if self.mode == "redirect":
            body = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>PermanentRedirect</Code>'
                    b"<Message>The bucket is in this region: eu-west-1.</Message></Error>")
            status = 301
        else:
            body, status = b"<ListBucketResult><Contents><Key>k</Key></Contents>", 200
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_PUT = do_HEAD = None

    def _forward(self):
        host, port = urllib.parse.urlsplit(self.target).netloc.split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
        conn.request("GET", self.path, headers=headers)
        answer = conn.getresponse()
        body = answer.read()
        self.send_response(answer.status)
        for name, value in answer.getheaders():
            if name.lower() not in ("content-length", "connection", "transfer-encoding", "server", "date"):
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        conn.close()

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("mode", ["redirect", "unreadable"])
def test_boto3_serves_what_the_engine_cannot(s3_server, mode):
    """A bucket in another region (the engine is off for the backend from
    then on, as for GETs) or an answer the parser cannot read (listings go
    through boto3 from then on): boto3 lists, the same keys."""
    bucket = s3_server.new_bucket("front")
    for i in range(3):
        s3_server.admin.put_object(Bucket=bucket, Key="k%d" % i, Body=b"x" * i)
    handler = type("Front", (_FrontHandler,), {"mode": mode, "target": s3_server.moto_endpoint, "seen": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        front = "http://127.0.0.1:%d" % server.server_address[1]
        url = s3_server.url(bucket, bucket).replace(s3_server.endpoint, front)
        with open_store(url) as store:
            backend = store.chunks
            backend.page_size = 2
            listed = list(backend.list())
            assert [(i.key, i.size) for i in listed] == [("k0", 0), ("k1", 1), ("k2", 2)]
            assert listed == list(boto3_twin(backend).list())
            assert len(handler.seen) == 1 and "list-type=2" in handler.seen[0]
            assert handler.seen[0].startswith("/%s?" % bucket)  # path style, as botocore lists
            assert not backend.use_engine if mode == "redirect" else not backend._engine_lists
            assert [i.key for i in backend.list("k1")] == ["k1"]
            assert len(handler.seen) == 1  # boto3 from then on
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
