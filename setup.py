"""Packaging for tensorshare. Tool settings live in pyproject.toml.

The modules ``tensorshare/_ext.py`` lists in ``TWINS`` are compiled by Cython from their own
``.py`` sources, each under its twin's name (``frames.py`` -> ``frames_c``) and typed by the
``.pxd`` of the module's name beside it (``frames.pxd``: the declarations other twins cimport).
Cython types the module ``frames_c`` by a file named after it, ``frames_c.pxd``: the build
writes that one-line file (``include "tensorshare/wire/frames.pxd"``) under
``build/twins/pxd``, so it is never committed. The ``.py`` and the ``.pxd`` are dependencies
of the build: changing either rebuilds its module (and a ``.pxd``, the twins that cimport it).

Where a C compiler is found, a module that fails to compile fails the install: it never
installs quietly slower. Without a compiler (or Cython, or with ``TENSORSHARE_NO_EXTENSIONS=1``
set at install time) the install says so in one line and tensorshare runs as pure Python, with
the same behaviour.

The build is quick and does not repeat itself: Cython translates and the compiler compiles
the modules in parallel (one job per core, the longest first), without debug information;
the C files persist in ``build/twins``; and a module whose compiled file in the tree is newer
than its ``.py``, its ``.pxd`` and its C file is reused as it is. The README's second command
(``pip install -e ".[test]"`` after ``pip install -e .``) compiles nothing again.
"""

import ast
import os
import re
import shlex
import shutil
import sys
import sysconfig

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

NO_EXTENSIONS_ENV = "TENSORSHARE_NO_EXTENSIONS"
BUILD_DIR = os.path.join("build", "twins")  # Cython's C files, kept between builds
GENERATED_PXD = os.path.join(BUILD_DIR, "pxd")  # the one-line X_c.pxd files
# annotation_typing=False: annotations document, the .pxd types (the pure modules accept any
# bytes-like where they say bytes, and so must the compiled ones).
DIRECTIVES = {"language_level": 3, "annotation_typing": False, "binding": True}


def newer(sources: list[str], target: str) -> bool:
    """Whether any of ``sources`` (a missing one counts) is newer than ``target``."""
    when = os.path.getmtime(target)
    return any(not os.path.exists(p) or os.path.getmtime(p) > when for p in sources)


def twin_modules() -> list[str]:
    """``TWINS`` from tensorshare/_ext.py, read as a literal (nothing is imported or run)."""
    with open(os.path.join("tensorshare", "_ext.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "TWINS" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise RuntimeError("tensorshare/_ext.py has no TWINS tuple")


def augmenting_pxd(source: str) -> str:
    """The path of ``<source>_c.pxd`` under :data:`GENERATED_PXD`, which includes
    ``<source>.pxd``; written when missing or different (else left alone, its time kept)."""
    path = os.path.join(GENERATED_PXD, f"{source}_c.pxd")
    leaf = os.path.basename(source)
    text = (f"# Written by setup.py: the compiled twin {leaf}_c is typed by {leaf}.pxd.\n"
            f'include "{source}.pxd"\n')
    try:
        with open(path, encoding="utf-8") as f:
            if f.read() == text:
                return path
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def cythonized(modules: list[Extension], jobs: int) -> list[Extension]:
    """``modules`` (sources: their ``.py``) translated to C by Cython, ``jobs`` at a time."""
    from Cython.Build import cythonize

    modules = [ext for ext in modules if ext.sources[0].endswith(".py")]  # (not yet C)
    for ext in modules:
        source = ext.sources[0][:-len(".py")]
        augmenting_pxd(source)
        # cythonize looks at the .py's own dependencies only (cython#1428): a .pxd newer than
        # the C file it generated makes it generate that file again.
        generated = os.path.join(BUILD_DIR, f"{source}.c")
        if os.path.exists(generated) and newer(ext.depends, generated):
            os.remove(generated)
    return cythonize(modules, build_dir=BUILD_DIR, include_path=[GENERATED_PXD, "."],
                     nthreads=jobs if jobs > 1 else 0, quiet=True,
                     compiler_directives=DIRECTIVES)


class TwinBuildExt(build_ext):
    """Builds the twins: Cython and the compiler in parallel, reusing what is up to date."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if not self.parallel:
            self.parallel = os.cpu_count() or 1

    def build_extensions(self) -> None:
        # (here, not when setup.py is read: pip reads it twice for metadata first)
        translated = {e.name: e.sources for e in cythonized(self.extensions, int(self.parallel))}
        for ext in self.extensions:
            # (the same objects keep their sources' C: setuptools marked them)
            ext.sources = translated.get(ext.name, ext.sources)
            if self.compiler.compiler_type == "unix" and "-g0" not in ext.extra_compile_args:
                ext.extra_compile_args.append("-g0")  # no debug information: a third faster
        # The longest first, so that no core waits at the end on a long one started last.
        self.extensions.sort(key=lambda e: os.path.getsize(e.sources[0]), reverse=True)
        super().build_extensions()

    def build_extension(self, ext: Extension) -> None:
        if not self.force and self._reuse(ext):
            return
        super().build_extension(ext)

    def _reuse(self, ext: Extension) -> bool:
        """Whether the module compiled in the tree (where ``--inplace`` and an editable install
        put it) is newer than all ``ext`` is built from: then it is copied to where this build
        puts its output, and not compiled again. (An editable install builds in a new
        temporary folder each time, so the build's own check never finds it.)"""
        in_tree = self.get_ext_filename(ext.name)  # (relative to the project's root)
        out = self.get_ext_fullpath(ext.name)
        if not os.path.exists(in_tree) or os.path.abspath(in_tree) == os.path.abspath(out):
            return False
        if newer([*ext.sources, *ext.depends], in_tree):
            return False
        sys.stderr.write(f"tensorshare: {in_tree} is up to date; not compiled again\n")
        self.mkpath(os.path.dirname(out))
        shutil.copy2(in_tree, out)
        return True


def _pure(why: str) -> None:
    print(f"tensorshare: {why}; installing the pure-Python modules only (same behaviour, "
          f"slower per request)", file=sys.stderr)


def _compiler() -> str | None:
    """The C compiler this Python builds extensions with, if it is on this machine."""
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shutil.which(shlex.split(cc)[0]) if cc.strip() else None


def extensions() -> list[Extension]:
    """The twins to compile (their ``.py`` sources: :class:`TwinBuildExt` runs Cython)."""
    if os.environ.get(NO_EXTENSIONS_ENV, "") not in ("", "0"):
        _pure(f"{NO_EXTENSIONS_ENV} is set")
        return []
    if _compiler() is None:
        _pure("no C compiler was found")
        return []
    try:
        import Cython.Build  # noqa: F401 (imported again where it runs)
    except ImportError:
        _pure("Cython is not available")
        return []
    return [twin_extension(name) for name in twin_modules()]


def twin_extension(name: str) -> Extension:
    """Module ``name``'s twin, from its ``.py``, depending on everything that types it: its
    ``.pxd``, the ``X_c.pxd`` that includes it, and every ``.pxd`` of the package it cimports,
    directly or not (a twin compiled against another's old declarations fails to load)."""
    source = name.replace(".", "/")
    depends = [f"{source}.py", f"{source}.pxd", os.path.join(GENERATED_PXD, f"{source}_c.pxd"),
               *cimported(f"{source}.pxd")]
    return Extension(f"{name}_c", [f"{source}.py"], depends=depends)


def cimported(pxd: str) -> list[str]:
    """The ``.pxd`` files of the package that ``pxd`` cimports, and those they cimport."""
    found: list[str] = []
    todo = [pxd]
    while todo:
        with open(todo.pop(), encoding="utf-8") as f:
            text = f.read()
        for module in re.findall(r"^from\s+(tensorshare(?:\.\w+)+)\s+cimport\b", text, re.M):
            path = module.replace(".", "/") + ".pxd"
            if path not in found:
                found.append(path)
                todo.append(path)
    return found


# (Run as a script, as pip and setuptools run it; tests/test_build.py imports the functions.)
if __name__ == "__main__":
    setup(
        name="tensorshare",
        version="0.1.0",
        description="Share PyTorch tensors between processes and machines: a Twisted server of named "
        "in-memory bins, thread-safe clients, and helpers for distributed deep RL.",
        long_description=open("README.md", encoding="utf-8").read(),
        long_description_content_type="text/markdown",
        license="MIT",
        python_requires=">=3.11",
        packages=find_packages(include=["tensorshare", "tensorshare.*"]),
        # The dashboard's page, script and style ship with the package (no build step, no CDN).
        package_data={"tensorshare": ["py.typed"],
                      "tensorshare.dashboard": ["static/*.html", "static/*.js", "static/*.css",
                                                "static/*.svg"]},
        install_requires=[
            # TLS (tensorshare+tls://) through Twisted: pyOpenSSL and service_identity. Verified
            # from the lower bound (tests/server/test_reactor.py runs the server's tests on it) to
            # the newest release (26.10). No upper bound: the server checks at start that the
            # Twisted privates its lean reactor uses are there and behave (server/reactor.py), and
            # otherwise runs Twisted's own epoll reactor, saying so.
            "twisted[tls]>=23.10",
            "msgpack>=1.0",
            "lz4>=4.0",
            # torch is needed to send and receive tensors; the server itself never imports it.
            # Install the build you want first (CPU or CUDA); any 2.x satisfies this.
            "torch>=2.1",
            # Tensors are sent from and received into their own memory through numpy views
            # (Tensor.numpy() / torch.from_numpy), the zero-copy path torch supports; the CPU
            # torch wheel does not pull numpy in by itself.
            "numpy>=1.24",
            "rich>=13",  # the CLI's tables, trees and live monitor
            "prometheus-client>=0.17",  # serve --metrics-port (0.17+ hands back its HTTP server)
        ],
        extras_require={
            # The RL demo and examples on Gymnasium's environments (without it: a built-in CartPole).
            "rl": ["gymnasium>=1.0"],
            # tensorshare.ray: shard servers as Ray actors (start_shards).
            "ray": ["ray>=2.60"],
            # tensorshare.aio runs on any asyncio loop; this only installs uvloop (the library
            # never sets a loop policy: uvloop.run(main()) is the caller's choice).
            "uvloop": ["uvloop"],
            # The tests run the Gymnasium examples too (and the fallback, with Gymnasium hidden).
            # kubernetes-validate checks deploy/k8s against the Kubernetes schemas, offline.
            "test": ["pytest>=7", "pytest-timeout", "hypothesis", "ruff", "mypy", "import-linter>=2.17",
                     "trustme",
                     # the suite runs on several worker processes (tests/parallel.py)
                     "pytest-xdist>=3.6",
                     # tests/aio: both event loops, and Starlette and FastAPI gateways (the
                     # README's) driven by httpx
                     "uvloop", "starlette", "fastapi", "httpx",
                     # tests/test_build.py builds two twins as pip does (the build's own Cython is
                     # in pip's isolated build environment, not here)
                     "Cython>=3.1",  # (as pyproject.toml builds with)
                     "mypy-zope", "gymnasium>=1.0", "kubernetes-validate==1.37.0", "pyyaml",
                     # a real local Ray cluster in tests/ray (wheels up to Python 3.13)
                     'ray==2.60.0; python_version < "3.14"',
                     # drives the dashboard in Debian's Chromium (.ci/run installs it; the tests
                     # never download a browser)
                     "playwright>=1.50"],
        },
        entry_points={"console_scripts": ["tensorshare=tensorshare.cli.main:main"]},
        ext_modules=extensions(),
        cmdclass={"build_ext": TwinBuildExt},
        classifiers=[
            "License :: OSI Approved :: MIT License",
            "Programming Language :: Python :: 3",
            "Framework :: Twisted",
            "Topic :: Scientific/Engineering :: Artificial Intelligence",
        ],
    )
