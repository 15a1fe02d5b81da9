"""Packaging for tensorshare. Tool settings live in pyproject.toml.

The modules ``tensorshare/_ext.py`` lists in ``TWINS`` are compiled by Cython from their own
``.py`` sources, each under its twin's name (``frames.py`` -> ``frames_c``) and typed by the
``.pxd`` of that name beside it (a dependency of the build: changing only a ``.pxd`` rebuilds
its module). Where a C compiler is found, a module that fails to compile fails the install:
it never installs quietly slower. Without a compiler (or Cython, or with
``TENSORSHARE_NO_EXTENSIONS=1`` set at install time) the install says so in one line and
tensorshare runs as pure Python, with the same behaviour.
"""

import ast
import os
import shlex
import shutil
import sys
import sysconfig

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

NO_EXTENSIONS_ENV = "TENSORSHARE_NO_EXTENSIONS"


class ParallelBuildExt(build_ext):
    """One compiler per core: the modules build independently."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if not self.parallel:
            self.parallel = os.cpu_count() or 1


def twin_modules() -> list[str]:
    """``TWINS`` from tensorshare/_ext.py, read as a literal (nothing is imported or run)."""
    with open(os.path.join("tensorshare", "_ext.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "TWINS" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise RuntimeError("tensorshare/_ext.py has no TWINS tuple")


def _pure(why: str) -> None:
    print(f"tensorshare: {why}; installing the pure-Python modules only (same behaviour, "
          f"slower per request)", file=sys.stderr)


def _compiler() -> str | None:
    """The C compiler this Python builds extensions with, if it is on this machine."""
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shutil.which(shlex.split(cc)[0]) if cc.strip() else None


def extensions() -> list[Extension]:
    if os.environ.get(NO_EXTENSIONS_ENV, "") not in ("", "0"):
        _pure(f"{NO_EXTENSIONS_ENV} is set")
        return []
    if _compiler() is None:
        _pure("no C compiler was found")
        return []
    try:
        from Cython.Build import cythonize
    except ImportError:
        _pure("Cython is not available")
        return []
    modules = []
    build_dir = os.path.join("build", "twins")
    for name in twin_modules():
        source = name.replace(".", "/")
        # X_c.pxd (the twin's augmenting file) includes X.pxd (the declarations other twins
        # cimport as tensorshare.<room>.X, the module's own name).
        depends = [p for p in (f"{source}_c.pxd", f"{source}.pxd") if os.path.exists(p)]
        # cythonize looks at the .py's own dependencies only (cython#1428): a .pxd newer than
        # the C file it generated makes it generate that file again.
        generated = os.path.join(build_dir, f"{source}.c")
        if os.path.exists(generated) and any(
                os.path.getmtime(p) > os.path.getmtime(generated) for p in depends):
            os.remove(generated)
        modules.append(Extension(f"{name}_c", [f"{source}.py"], depends=depends))
    # annotation_typing=False: annotations document, the .pxd types (the pure modules accept
    # any bytes-like where they say bytes, and so must the compiled ones).
    return cythonize(modules, build_dir=build_dir, quiet=True,
                     compiler_directives={"language_level": 3, "annotation_typing": False,
                                          "binding": True})


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
        # TLS (tensorshare+tls://) through Twisted: pyOpenSSL and service_identity.
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
        # The tests run the Gymnasium examples too (and the fallback, with Gymnasium hidden).
        # kubernetes-validate checks deploy/k8s against the Kubernetes schemas, offline.
        # pytest-xdist: the suite runs on as many workers as tests/conftest.py chooses.
        "test": ["pytest>=7", "pytest-timeout", "pytest-xdist>=3.6", "hypothesis", "ruff", "mypy",
                 "import-linter>=2.17",
                 "trustme",
                 "mypy-zope", "gymnasium>=1.0", "kubernetes-validate==1.37.0", "pyyaml",
                 # a real local Ray cluster in tests/ray (wheels up to Python 3.13)
                 'ray==2.60.0; python_version < "3.14"',
                 # drives the dashboard in Debian's Chromium (.ci/run installs it; the tests
                 # never download a browser)
                 "playwright>=1.50"],
    },
    entry_points={"console_scripts": ["tensorshare=tensorshare.cli.main:main"]},
    ext_modules=extensions(),
    cmdclass={"build_ext": ParallelBuildExt},
    classifiers=[
        "License :: OSI Approved :: MIT License",
        "Programming Language :: Python :: 3",
        "Framework :: Twisted",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
