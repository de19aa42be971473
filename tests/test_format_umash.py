"""UMASH against the reference vectors, on both implementations."""
import json
import pathlib

import pytest

from verneuil_fuse import format as fmt

# tests/data/umash_verneuil.json: values computed with the
# public UMASH C library (see its "about" field).
VECTORS = pathlib.Path(__file__).parent / "data" / "umash_verneuil.json"


def _load():
    return json.loads(VECTORS.read_text())


@pytest.fixture(scope="module")
def vectors():
    return _load()


def input_of(entry) -> bytes:
    if "hex" in entry:
        return bytes.fromhex(entry["hex"])
    if entry["fill"] == "zeros":
        return bytes(entry["len"])
    if entry["fill"] == "ramp":
        return bytes(i % 256 for i in range(entry["len"]))
    raise AssertionError("unknown fill %r" % entry["fill"])


@pytest.fixture(params=["portable", "clmul"])
def impl(request):
    active = fmt.select_impl(request.param)
    if active != request.param:
        pytest.skip("CPU lacks %s" % request.param)
    yield active
    fmt.select_impl("auto")


def test_params_derivation(vectors):
    assert set(vectors["params"]) == set(k.decode() for k in fmt.KEYS.values())
    for key, want in vectors["params"].items():
        assert fmt.derived_params(key.encode()) == want, key


def test_every_fingerprint_and_hash(vectors, impl):
    checked = 0
    for entry in vectors["fingerprints"]:
        data = input_of(entry)
        assert len(data) == entry["len"]
        key = entry["params_key"].encode()
        fp = fmt.fingerprint(data, key)
        assert ["%016x" % fp.major, "%016x" % fp.minor] == entry["fprint"], entry
        assert "%016x" % fmt.hash64(data, key) == entry["hash64"], entry
        checked += 1
    for entry in vectors["hashes64"]:
        assert "%016x" % fmt.hash64(input_of(entry), entry["params_key"].encode()) == entry["hash64"]
        checked += 1
    assert checked >= 600


def test_impls_agree_on_random_inputs(impl):
    import random
    rng = random.Random(42)
    for n in list(range(0, 300)) + [4095, 4096, 4097, 65535, 65536, 100_000]:
        data = rng.randbytes(n)
        fp = fmt.fingerprint(data)
        other = "portable" if impl == "clmul" else "clmul"
        fmt.select_impl(other)
        assert fmt.fingerprint(data) == fp
        fmt.select_impl(impl)


def test_golden_values():
    assert fmt.fingerprint(bytes(65536)) == (8155395758008617606, 2728302605148947890)
    assert fmt.fingerprint(bytes(65536)) == fmt.ZERO_CHUNK_FPRINT
    assert fmt.ZERO_CHUNK_NAME == "712dc93b96d4ca86%2F25dce0c3a3ad05b2"
    assert fmt.contents_fprint_of([fmt.Fprint(1, 516)]) == (7575684803259252638, 13253811199699765610)


def test_manifest_names(vectors):
    for entry in vectors["manifest_names"]:
        name = fmt.manifest_name(entry["path"], hostname=entry["hostname"])
        assert name == entry["name"], entry
        parsed = fmt.parse_manifest_name(name)
        assert parsed is not None and parsed.hostname == entry["hostname"]
        if parsed.mangled:
            assert len(name) == 240
            assert entry["path"].endswith(parsed.suffix[-20:])
        else:
            assert parsed.path == entry["path"]


def test_accepts_any_buffer():
    data = bytearray(b"x" * 1000)
    assert fmt.fingerprint(data) == fmt.fingerprint(bytes(data)) == fmt.fingerprint(memoryview(data))
