"""Packaging for tensorshare. Tool settings live in pyproject.toml.

The modules ``tensorshare/_ext.py`` lists in ``COMPILED`` are compiled from their own ``.py``
sources by Cython when a C compiler is found: the compiled hot path, with the pure-Python
modules as its twin. Without a compiler (or with ``TENSORSHARE_NO_EXTENSIONS=1`` set at
install time) the install says so in one line and tensorshare runs as pure Python.
"""

import ast
import os
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

NO_EXTENSIONS_ENV = "TENSORSHARE_NO_EXTENSIONS"


def compiled_modules() -> list[str]:
    """``COMPILED`` from tensorshare/_ext.py, read as a literal (nothing is imported or run)."""
    with open(os.path.join("tensorshare", "_ext.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "COMPILED" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise RuntimeError("tensorshare/_ext.py has no COMPILED tuple")


def _pure(why: str) -> None:
    print(f"tensorshare: {why}; installing the pure-Python modules only (same behaviour, "
          f"slower per request)", file=sys.stderr)


def extensions() -> list[Extension]:
    if os.environ.get(NO_EXTENSIONS_ENV, "") not in ("", "0"):
        _pure(f"{NO_EXTENSIONS_ENV} is set")
        return []
    try:
        from Cython.Build import cythonize
    except ImportError:
        _pure("Cython is not available")
        return []
    modules = [Extension(name, [name.replace(".", "/") + ".py"]) for name in compiled_modules()]
    # annotation_typing=False: annotations document, they are not enforced (the pure modules
    # accept any bytes-like where they say bytes, and so must the compiled ones).
    return cythonize(modules, build_dir=os.path.join("build", "cython"), quiet=True,
                     compiler_directives={"language_level": 3, "annotation_typing": False,
                                          "binding": True})


class OptionalBuildExt(build_ext):
    """Build the compiled modules where a C compiler works; otherwise carry on without them."""

    failed = False

    def finalize_options(self) -> None:
        super().finalize_options()
        if not self.parallel:  # one compiler per core: the modules build independently
            self.parallel = os.cpu_count() or 1

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # no compiler, no Python headers, ...: pure Python it is
            self._failed(exc)

    def build_extension(self, ext: Extension) -> None:
        if self.failed:
            return
        try:
            super().build_extension(ext)
        except Exception as exc:
            self._failed(exc)

    def _failed(self, exc: Exception) -> None:
        if not OptionalBuildExt.failed:
            OptionalBuildExt.failed = True
            _pure(f"the compiled hot path could not be built ({str(exc).splitlines()[0]})")


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
        "test": ["pytest>=7", "pytest-timeout", "hypothesis", "ruff", "mypy", "import-linter",
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
    cmdclass={"build_ext": OptionalBuildExt},
    classifiers=[
        "License :: OSI Approved :: MIT License",
        "Programming Language :: Python :: 3",
        "Framework :: Twisted",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
