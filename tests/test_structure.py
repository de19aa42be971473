"""The repository's shape, checked from its own files (no build, no I/O
beyond reading them): short functions, imports that point one way, no C
include cycle, and no reference to a document the repository lacks."""
from __future__ import annotations

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Longest product function, in lines: a function longer than this does
# several jobs; one that must stay one piece says so in a comment that holds
# ONE_PIECE on the line before it (or its first line).
MAX_FUNCTION_LINES = 80
ONE_PIECE = "must be one piece"
PYTHON_PACKAGES = ("verneuil_fuse", "writer_vfs")
# verneuil_fuse's layers, lowest first: a module may import its own layer
# and the ones below, never one above.
LAYERS = {
    "format": 0, "errors": 0, "logs": 0,
    "store": 1,
    "history": 2, "metrics": 2, "config": 2, "pool": 2,
    "reader": 3, "copier": 3, "readback": 3,
    "fs": 4,
    "cli": 6, "spark": 6,
}


def _files(top: str, suffix: str):
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, top)):
        dirnames[:] = [d for d in dirnames if not d.startswith((".", "__"))]
        for name in sorted(filenames):
            if name.endswith(suffix) and not name.endswith("_pb2.py"):
                yield os.path.join(dirpath, name)


def _long_python_nodes(kinds, limit: int, marker: str, before: int, after: int):
    """Product functions or classes (``kinds``) over ``limit`` lines without
    ``marker`` in the ``before`` lines above them, their first line and the
    ``after`` lines below it."""
    for package in PYTHON_PACKAGES:
        for path in _files(package, ".py"):
            text = open(path, encoding="utf-8").read()
            lines = text.split("\n")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, kinds):
                    length = node.end_lineno - node.lineno + 1
                    start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
                    around = "\n".join(lines[max(0, start - before): node.lineno + after])
                    if length > limit and marker not in around:
                        yield "%s:%d %s (%d lines)" % (os.path.relpath(path, ROOT), node.lineno, node.name, length)


def _long_python_functions():
    return _long_python_nodes((ast.FunctionDef, ast.AsyncFunctionDef), MAX_FUNCTION_LINES, ONE_PIECE, 3, 1)


def _long_c_functions():
    """C functions in the project's style: the signature starts at column 0,
    the body's braces are alone at column 0."""
    for path in _files("csrc", ".c"):
        lines = open(path, encoding="utf-8").read().split("\n")
        i = 0
        while i < len(lines):
            if lines[i] == "{":
                start = i - 1
                while start > 0 and lines[start].startswith((" ", "\t")):
                    start -= 1
                end = i + 1
                while end < len(lines) and lines[end] != "}":
                    end += 1
                length = end - start + 1
                around = "\n".join(lines[max(0, start - 3): i])
                if length > MAX_FUNCTION_LINES and ONE_PIECE not in around:
                    names = re.findall(r"(\w+)\s*\(", " ".join(lines[start:i]))
                    yield "%s:%d %s (%d lines)" % (os.path.relpath(path, ROOT), start + 1,
                                                    names[0] if names else "?", length)
                i = end
            i += 1


def test_no_product_function_does_several_jobs():
    long = list(_long_python_functions()) + list(_long_c_functions())
    assert long == [], "functions over %d lines:\n%s" % (MAX_FUNCTION_LINES, "\n".join(long))


# Longest product class, in lines: a class longer than this does several
# jobs, each of which can be a part of its own (a base class in a module of
# its own, as `Fetcher`'s, `Catalog`'s and `Copier`'s are); one that must
# stay one class says why in a comment that holds ONE_CLASS on one of the
# lines just before it.
MAX_CLASS_LINES = 400
ONE_CLASS = "must be one class"


def _long_python_classes():
    return _long_python_nodes(ast.ClassDef, MAX_CLASS_LINES, ONE_CLASS, 10, 0)


def test_no_product_class_does_several_jobs():
    long = list(_long_python_classes())
    assert long == [], "classes over %d lines without a comment saying why they %s:\n%s" % (
        MAX_CLASS_LINES, ONE_CLASS, "\n".join(long))


# Packages of one layer that keep to themselves: the reader (serves a
# mount), the copier (ships a spool) and readback (reads a store back into
# files and reports) share only the layers below them.
ROOMS = ("reader", "copier", "readback")


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "verneuil_fuse" and len(parts) > 1 and parts[1] in ROOMS else None


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "verneuil_fuse" or len(parts) < 2:
        return None
    return LAYERS.get(parts[1])


def test_imports_point_one_way():
    wrong = []
    for package in PYTHON_PACKAGES:
        for path in _files(package, ".py"):
            rel = os.path.relpath(path, ROOT)[: -len(".py")].replace(os.sep, ".")
            module = rel[: -len(".__init__")] if rel.endswith(".__init__") else rel
            own = _layer(module)
            for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
                if isinstance(node, ast.ImportFrom) and node.level:
                    base = module.split(".")[: len(module.split(".")) - node.level + rel.endswith("__init__")]
                    targets = [".".join(base + ([node.module] if node.module else []))]
                elif isinstance(node, ast.ImportFrom):
                    targets = [node.module or ""]
                elif isinstance(node, ast.Import):
                    targets = [a.name for a in node.names]
                else:
                    continue
                for target in targets:
                    if package == "writer_vfs" and target.startswith("verneuil_fuse"):
                        wrong.append("%s imports %s (the writer imports nothing of the reader)" % (module, target))
                    theirs = _layer(target)
                    if own is not None and theirs is not None and theirs > own:
                        wrong.append("%s (layer %d) imports %s (layer %d)" % (module, own, target, theirs))
                    if _room(module) and _room(target) and _room(module) != _room(target):
                        wrong.append("%s imports %s (rooms apart)" % (module, target))
    assert wrong == [], "\n".join(wrong)


def test_the_manifest_protobuf_is_read_and_written_by_format_only():
    """`manifest_pb2` (the generated protobuf) is imported inside `format/`
    only: every other module goes through `format`'s encode and decode, so
    their checks and bounds are never skipped."""
    outside = []
    for package in PYTHON_PACKAGES:
        for path in _files(package, ".py"):
            rel = os.path.relpath(path, ROOT)
            if rel.startswith(os.path.join("verneuil_fuse", "format") + os.sep):
                continue
            for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
                names = []
                if isinstance(node, ast.ImportFrom):
                    names = [node.module or ""] + [a.name for a in node.names]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                if any(n.split(".")[-1] == "manifest_pb2" for n in names):
                    outside.append("%s:%d" % (rel, node.lineno))
    assert outside == [], "manifest_pb2 imported outside format/:\n" + "\n".join(outside)


def test_store_capabilities_are_types_not_probed():
    """What a backend can do beyond `Backend`'s calls is `Backend.capabilities`
    (`store.Capabilities`): nothing asks a store or a backend with getattr or
    hasattr whether it has an attribute."""
    probes = []
    store_like = re.compile(r"\b(?:store|backend|chunks|manifests|fetcher\.store)\b")
    for package in PYTHON_PACKAGES:
        for path in _files(package, ".py"):
            for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                        and node.func.id in ("getattr", "hasattr") and node.args
                        and store_like.search(ast.unparse(node.args[0]))):
                    probes.append("%s:%d %s" % (os.path.relpath(path, ROOT), node.lineno, ast.unparse(node)))
    assert probes == [], "store capabilities probed:\n" + "\n".join(probes)


def test_imports_are_absolute():
    """One style of imports in the product: absolute (`from verneuil_fuse.store
    import ...`), never relative, so a module reads the same wherever it moves."""
    relative = []
    for package in PYTHON_PACKAGES:
        for path in _files(package, ".py"):
            for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
                if isinstance(node, ast.ImportFrom) and node.level:
                    relative.append("%s:%d" % (os.path.relpath(path, ROOT), node.lineno))
    assert relative == [], "relative imports:\n" + "\n".join(relative)


def test_c_headers_include_no_cycle():
    graph = {}
    for path in _files("csrc", ""):
        if path.endswith((".c", ".h")):
            text = open(path, encoding="utf-8").read()
            graph[os.path.basename(path)] = re.findall(r'^\s*#\s*include\s+"([^"]+)"', text, re.M)
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        assert name not in path, "include cycle: " + " -> ".join(path[path.index(name):] + [name])
        if name in done:
            return
        for dep in graph.get(name, ()):
            visit(dep, path + [name])
        done.add(name)

    for name in graph:
        visit(name, [])


def test_every_cited_document_is_in_the_repository():
    cited = re.compile(r"\b((?:docs/)?[A-Z][A-Z_]+\.md)\b")
    missing = []
    for top in ("verneuil_fuse", "writer_vfs", "csrc", "docs", "scripts", "tests"):
        for path in _files(top, ""):
            if not path.endswith((".py", ".c", ".h", ".md", ".sh", ".proto")):
                continue
            for name in set(cited.findall(open(path, encoding="utf-8", errors="replace").read())):
                where = name if name.startswith("docs/") else "docs/" + name
                if not (os.path.exists(os.path.join(ROOT, where)) or os.path.exists(os.path.join(ROOT, name))):
                    missing.append("%s cites %s" % (os.path.relpath(path, ROOT), name))
    for name in set(cited.findall(open(os.path.join(ROOT, "README.md"), encoding="utf-8").read())):
        if not os.path.exists(os.path.join(ROOT, name)) and not os.path.exists(os.path.join(ROOT, "docs", name)):
            missing.append("README.md cites " + name)
    assert missing == [], "\n".join(sorted(missing))


def test_the_chunk_engine_writes_the_disk_caches_records_as_the_cache_reads_them():
    """The chunk engine writes a chunk's index record itself, after the
    bytes, on its thread (see `reader.segments.RECORD`): its size and salt
    are the cache's."""
    import struct
    python = open(os.path.join(ROOT, "verneuil_fuse", "reader", "segments.py"), encoding="utf-8").read()
    text = open(os.path.join(ROOT, "csrc", "reader", "chunk_engine.c"), encoding="utf-8").read()
    size = re.search(r"#define RECORD_BYTES (\d+)", text)
    salt = re.search(r"#define RECORD_SALT (0x[0-9a-fA-F]+)u", text)
    record = re.search(r'^RECORD = struct.Struct\("([^"]+)"\)', python, re.M)
    check_salt = re.search(r"^_CHECK_SALT = (0x[0-9a-fA-F]+)", python, re.M)
    assert size and salt, "chunk_engine.c no longer defines RECORD_BYTES and RECORD_SALT"
    assert record and check_salt, "reader/segments.py no longer defines RECORD and _CHECK_SALT"
    assert int(size.group(1)) == struct.calcsize(record.group(1))
    assert int(salt.group(1), 16) == int(check_salt.group(1), 16)


def test_tests_cited_by_the_product_exist():
    """A module's docstring names the tests that check it
    (``tests/test_x.py (test_a, test_b)``): each file and test exists."""
    cited = re.compile(r"tests/(test_\w+\.py)(?:\s*(?:::(\w+)|\(([^)]*)\)))?")
    missing = []
    for package in PYTHON_PACKAGES:
        for path in _files(package, ".py"):
            for name, one, many in cited.findall(open(path, encoding="utf-8").read()):
                test_path = os.path.join(ROOT, "tests", name)
                if not os.path.exists(test_path):
                    missing.append("%s cites tests/%s" % (os.path.relpath(path, ROOT), name))
                    continue
                defined = set(re.findall(r"^(?:async )?def (test_\w+)", open(test_path, encoding="utf-8").read(), re.M))
                for test in ([one] if one else []) + re.findall(r"\btest_\w+", many):
                    if test not in defined:
                        missing.append("%s cites tests/%s::%s" % (os.path.relpath(path, ROOT), name, test))
    assert missing == [], "\n".join(missing)
