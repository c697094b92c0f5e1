"""The shape the code keeps: no module under meshnode/ over 500 lines, no class over 300, no
import cycle between its modules (imports under ``if TYPE_CHECKING:`` and inside functions count
too), and short comments (words of comments and docstrings per line of code). The generated protobuf
modules are left out. The layers themselves are import-linter's contracts in pyproject.toml
(``lint-imports``)."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "meshnode"
MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 300
# Words of comments and docstrings per line of code, over the whole package: a line where a line serves.
MAX_COMMENT_DENSITY = 1.5


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if "_pb2" not in p.name}


def _imports(name: str, path: Path, tree: ast.Module, known: set[str]) -> set[str]:
    """The meshnode modules ``name`` imports (``from package import module`` names the module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in known else base)
    return {m for m in found if m in known and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of two or more modules (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_module_is_over_500_lines():
    big = {
        str(p.relative_to(ROOT)): n for p in _modules().values() if (n := p.read_text().count("\n")) > MAX_MODULE_LINES
    }
    assert not big, f"modules over {MAX_MODULE_LINES} lines: {big}"


def test_no_class_is_over_300_lines():
    big = {}
    for path in _modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ClassDef)
                and node.end_lineno is not None
                and node.end_lineno - node.lineno > MAX_CLASS_LINES
            ):
                big[f"{path.relative_to(ROOT)}:{node.name}"] = node.end_lineno - node.lineno
    assert not big, f"classes over {MAX_CLASS_LINES} lines: {big}"


def test_no_import_cycle():
    modules = _modules()
    known = set(modules)
    graph = {name: _imports(name, path, ast.parse(path.read_text()), known) for name, path in modules.items()}
    cycles = _cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]


def _prose_and_code(source: str) -> tuple[int, int]:
    """(words of docstrings and comments, lines of code) of a module."""
    words, prose_lines = 0, set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                words += len(first.value.value.split())
                prose_lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            words += len(token.string.lstrip("#").split())
    code = sum(
        1
        for number, line in enumerate(source.splitlines(), 1)
        if line.strip() and not line.strip().startswith("#") and number not in prose_lines
    )
    return words, code


def test_comments_stay_short():
    words = code = 0
    for path in _modules().values():
        w, c = _prose_and_code(path.read_text())
        words, code = words + w, code + c
    assert words / code <= MAX_COMMENT_DENSITY, f"{words} words of comments for {code} lines of code"


def test_prose_is_counted_apart_from_code():
    source = '''"""Two words."""
x = 1  # three more words
# four words stand alone


def f():
    """Five words, said in five."""
    return x
'''
    assert _prose_and_code(source) == (2 + 3 + 4 + 5, 3)
