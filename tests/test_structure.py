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
    "history": 2, "metrics": 2, "config": 2,
    "reader": 3, "copier": 3,
    "fs": 4, "mount": 5,
    "cli": 6, "spark": 6,
}


def _files(top: str, suffix: str):
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, top)):
        dirnames[:] = [d for d in dirnames if not d.startswith((".", "__"))]
        for name in sorted(filenames):
            if name.endswith(suffix) and not name.endswith("_pb2.py"):
                yield os.path.join(dirpath, name)


def _long_python_functions():
    for package in PYTHON_PACKAGES:
        for path in _files(package, ".py"):
            text = open(path, encoding="utf-8").read()
            lines = text.split("\n")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    length = node.end_lineno - node.lineno + 1
                    start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
                    around = "\n".join(lines[max(0, start - 3): node.lineno + 1])
                    if length > MAX_FUNCTION_LINES and ONE_PIECE not in around:
                        yield "%s:%d %s (%d lines)" % (os.path.relpath(path, ROOT), node.lineno, node.name, length)


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
    assert wrong == [], "\n".join(wrong)


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
