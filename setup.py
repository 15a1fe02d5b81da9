"""Packaging for tensorshare. Tool settings live in pyproject.toml."""

from setuptools import find_packages, setup

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
    package_data={"tensorshare": ["py.typed"]},
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
                 'ray==2.60.0; python_version < "3.14"'],
    },
    entry_points={"console_scripts": ["tensorshare=tensorshare.cli.main:main"]},
    classifiers=[
        "License :: OSI Approved :: MIT License",
        "Programming Language :: Python :: 3",
        "Framework :: Twisted",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
