"""A twin's ``.pxd`` cannot drift from its ``.py``.

Each module of ``tensorshare._ext.TWINS`` is compiled from its ``.py`` typed by its ``.pxd``.
Cython checks a ``cpdef`` signature against its ``def``, but not the attributes: one assigned
in the ``.py`` and not declared raises ``AttributeError`` only when the compiled module runs
that line, and one declared and no longer assigned lingers. So, for every twin:

- every attribute a class declared in the ``.pxd`` assigns (``self.x = ...`` in any of its
  methods, nested functions included) is declared in its ``cdef class`` block or in that of
  a ``cdef class`` it derives from (a class with ``cdef dict __dict__`` may keep others in its
  dict: those are listed below, each with its reason);
- every name the ``.pxd`` declares exists in the ``.py``: its classes, their attributes
  (assigned by the class or a class of the module deriving from it) and methods, its module
  functions and variables, and each name of a ``@cython.locals`` (an argument or a name
  assigned in that function).

The ``.pxd`` is read by the small parser below (one ``cdef`` statement a line, as the house
writes them), the ``.py`` by :mod:`ast`.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tensorshare import _ext

ROOT = Path(__file__).resolve().parents[1]

# Attributes a class with ``cdef dict __dict__`` keeps in its dict on purpose, with why.
IN_DICT: dict[tuple[str, str], str] = {}

#: Slots Cython gives a cdef class when its .pxd declares them, which no method assigns: a
#: weak reference to the object (a WeakSet of connections) and its instance dict.
CYTHON_SLOTS = frozenset({"__weakref__", "__dict__"})


@dataclass
class PxdFunction:
    name: str
    line: int
    locals: list[str] = field(default_factory=list)


@dataclass
class PxdClass:
    name: str
    line: int
    bases: list[str]
    attributes: dict[str, int] = field(default_factory=dict)
    methods: list[PxdFunction] = field(default_factory=list)
    has_dict: bool = False


@dataclass
class Pxd:
    classes: dict[str, PxdClass] = field(default_factory=dict)
    functions: list[PxdFunction] = field(default_factory=list)
    variables: dict[str, int] = field(default_factory=dict)


_CLASS = re.compile(r"cdef\s+class\s+(\w+)\s*(?:\(([\w\s,.]*)\))?\s*:")
_FUNCTION = re.compile(r"c?p?def\s+(?:(?:inline|api)\s+)*(?:[\w.]+(?:\[[^\]]*\])?\s+)?(\w+)\s*\(")
_ATTRIBUTE = re.compile(r"cdef\s+(?:(?:public|readonly)\s+)?[\w.]+(?:\[[^\]]*\])?\s+"
                        r"(\w+(?:\s*,\s*\w+)*)$")
_LOCALS = re.compile(r"@cython\.locals\((.*)\)$", re.S)


def _statements(text: str) -> list[tuple[int, int, str]]:
    """(line, indent, statement) of each logical line: comments dropped, a statement whose
    parentheses are open joined with the lines that close them."""
    out: list[tuple[int, int, str]] = []
    pending: list[str] = []
    start = indent = depth = 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].rstrip()
        if not line.strip():
            continue
        if not pending:
            start, indent = number, len(line) - len(line.lstrip())
        pending.append(line.strip())
        depth += line.count("(") - line.count(")")
        if depth <= 0:
            out.append((start, indent, " ".join(pending)))
            pending, depth = [], 0
    return out


def parse_pxd(text: str) -> Pxd:
    """The classes (attributes, methods), functions and variables a ``.pxd`` declares."""
    pxd = Pxd()
    current: PxdClass | None = None
    locals_: list[str] = []
    for line, indent, stmt in _statements(text):
        if indent == 0:
            current = None
        if m := _LOCALS.match(stmt):
            locals_ = [kv.split("=")[0].strip() for kv in m.group(1).split(",") if "=" in kv]
        elif m := _CLASS.match(stmt):
            bases = [b.strip() for b in (m.group(2) or "").split(",") if b.strip()]
            current = pxd.classes[m.group(1)] = PxdClass(m.group(1), line, bases)
        elif m := _FUNCTION.match(stmt):
            fn = PxdFunction(m.group(1), line, locals_)
            (current.methods if current is not None else pxd.functions).append(fn)
            locals_ = []
        elif m := _ATTRIBUTE.match(stmt):
            names = [n.strip() for n in m.group(1).split(",")]
            if current is None:
                pxd.variables.update(dict.fromkeys(names, line))
            elif names == ["__dict__"]:
                current.has_dict = True
            else:
                current.attributes.update(dict.fromkeys(names, line))
    return pxd


def test_the_parser_reads_the_house_style() -> None:
    pxd = parse_pxd(
        "import cython\ncdef object _A, _B\n\n@cython.final\ncdef class K(Base):\n"
        "    cdef public object a, b  # c\n    cdef readonly bint flag\n"
        "    cdef dict __dict__\n    @cython.locals(x=list,\n                   y=object)\n"
        "    cpdef list go(self, object a,\n                  object b=*)\n"
        "    cdef _quiet(self)\n\ncpdef Py_ssize_t f(Py_ssize_t n)\n")
    assert pxd.variables.keys() == {"_A", "_B"}
    k = pxd.classes["K"]
    assert k.bases == ["Base"] and k.has_dict and k.attributes.keys() == {"a", "b", "flag"}
    assert [(f.name, f.locals) for f in k.methods] == [("go", ["x", "y"]), ("_quiet", [])]
    assert [f.name for f in pxd.functions] == ["f"]


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return list(node.targets)
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        return [node.target]
    return []


def _flat(target: ast.expr) -> list[ast.expr]:
    if isinstance(target, (ast.Tuple, ast.List)):
        return [t for e in target.elts for t in _flat(e)]
    if isinstance(target, ast.Starred):
        return _flat(target.value)
    return [target]


def self_assigned(cls: ast.ClassDef) -> dict[str, int]:
    """The attributes ``self.x`` the methods of ``cls`` assign, with a line of each."""
    out: dict[str, int] = {}
    for method in cls.body:
        if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)) or not method.args.args:
            continue
        me = method.args.args[0].arg
        for node in ast.walk(method):
            for t in (x for target in _targets(node) for x in _flat(target)):
                if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                        and t.value.id == me):
                    out.setdefault(t.attr, t.lineno)
    return out


def local_names(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """A function's arguments and the names it binds (nested functions' own names aside)."""
    a = fn.args
    names = {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if x}
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


@dataclass
class Py:
    classes: dict[str, ast.ClassDef]
    functions: dict[str, ast.FunctionDef | ast.AsyncFunctionDef]
    names: set[str]


def parse_py(text: str) -> Py:
    tree = ast.parse(text)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    functions = {n.name: n for n in tree.body
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    names = {t.id for n in tree.body for target in _targets(n) for t in _flat(target)
             if isinstance(t, ast.Name)}
    return Py(classes, functions, names | classes.keys() | functions.keys())


def _base_names(cls: ast.ClassDef) -> list[str]:
    return [b.id if isinstance(b, ast.Name) else ast.unparse(b) for b in cls.bases]


def _lineage(pxd: Pxd, name: str) -> list[PxdClass]:
    """``name``'s cdef class and those it derives from, in this ``.pxd``."""
    out, todo = [], [name]
    while todo:
        cls = pxd.classes.get(todo.pop())
        if cls is not None:
            out.append(cls)
            todo.extend(cls.bases)
    return out


def _descendants(py: Py, name: str) -> list[ast.ClassDef]:
    """Class ``name`` of the module and the module's classes deriving from it."""
    out, seen = [], {name}
    changed = True
    while changed:
        changed = False
        for cls in py.classes.values():
            if cls.name not in seen and seen & set(_base_names(cls)):
                seen.add(cls.name)
                changed = True
    out = [py.classes[n] for n in sorted(seen) if n in py.classes]
    return out


def _check_locals(where: str, fn: PxdFunction, body: ast.AST | None) -> list[str]:
    if body is None or not isinstance(body, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return []
    known = local_names(body)
    return [f"{where}:{fn.line}: @cython.locals names {name!r}, which {fn.name}() neither "
            f"takes nor assigns" for name in fn.locals if name not in known]


def _class_drift(pxd_path: str, pxd: Pxd, py: Py, cls: PxdClass) -> list[str]:
    where = f"{pxd_path}:{cls.line}"
    node = py.classes.get(cls.name)
    if node is None:
        return [f"{where}: cdef class {cls.name} is not a class of the .py"]
    problems = []
    lineage = _lineage(pxd, cls.name)
    declared = {a for c in lineage for a in c.attributes}
    for attr, line in sorted(self_assigned(node).items()):
        if attr not in declared and not any(c.has_dict for c in lineage):
            problems.append(f"{pxd_path}: {cls.name}.{attr} is assigned (.py line {line}) "
                            f"but not declared in cdef class {cls.name}")
        elif attr not in declared and (cls.name, attr) not in IN_DICT:
            problems.append(f"{pxd_path}: {cls.name}.{attr} (.py line {line}) lives in the "
                            f"__dict__: declare it, or list it in IN_DICT with the reason")
    assigned = {a for c in _descendants(py, cls.name) for a in self_assigned(c)}
    problems += [f"{pxd_path}:{line}: {cls.name}.{attr} is declared but no method of "
                 f"{cls.name} (or of a class deriving from it) assigns it"
                 for attr, line in cls.attributes.items()
                 if attr not in assigned and attr not in CYTHON_SLOTS]
    methods = {n.name: n for n in node.body
               if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for fn in cls.methods:
        if fn.name not in methods:
            problems.append(f"{pxd_path}:{fn.line}: {cls.name}.{fn.name} is declared but "
                            f"is not a method of the .py class")
        problems += _check_locals(pxd_path, fn, methods.get(fn.name))
    return problems


def drift(pxd_path: str, pxd_text: str, py_text: str) -> list[str]:
    """What of the ``.pxd`` does not match the ``.py`` (empty: they match)."""
    pxd, py = parse_pxd(pxd_text), parse_py(py_text)
    problems = []
    for cls in pxd.classes.values():
        problems += _class_drift(pxd_path, pxd, py, cls)
    for fn in pxd.functions:
        if fn.name not in py.functions:
            problems.append(f"{pxd_path}:{fn.line}: function {fn.name} is declared but is "
                            f"not a function of the .py")
        problems += _check_locals(pxd_path, fn, py.functions.get(fn.name))
    problems += [f"{pxd_path}:{line}: variable {name} is declared but the .py never "
                 f"assigns it" for name, line in pxd.variables.items() if name not in py.names]
    return problems


@pytest.mark.parametrize("name", _ext.TWINS)
def test_the_pxd_matches_the_py(name: str) -> None:
    base = ROOT.joinpath(*name.split("."))
    pxd_path, py_path = base.with_suffix(".pxd"), base.with_suffix(".py")
    problems = drift(str(pxd_path.relative_to(ROOT)), pxd_path.read_text(), py_path.read_text())
    assert not problems, "\n".join(problems)


def test_the_check_finds_each_kind_of_drift() -> None:
    py = ("class A:\n    def __init__(self):\n        self.a, self.b = 1, 2\n"
          "        def later():\n            self.c = 3\n    def go(self, n):\n"
          "        k = n\n        return k\n\nclass B(A):\n    def __init__(self):\n"
          "        self.d = 4\n\nX = 1\n\ndef f(n):\n    return n\n")
    good = ("cdef class A:\n    cdef public object a, b, c, d\n    @cython.locals(k=object)\n"
            "    cpdef go(self, object n)\n\ncdef object X\ncpdef f(object n)\n")
    assert drift("m.pxd", good, py) == []
    bad = ("cdef class A:\n    cdef public object a, e\n    @cython.locals(j=object)\n"
           "    cpdef go(self, object n)\n    cpdef gone(self)\n\ncdef class Z:\n    pass\n"
           "cdef object Y\ncpdef g(object n)\n")
    found = "\n".join(drift("m.pxd", bad, py))
    for what in ("A.b is assigned", "A.c is assigned", "A.e is declared", "'j'",
                 "A.gone is declared", "cdef class Z", "variable Y", "function g"):
        assert what in found, (what, found)
