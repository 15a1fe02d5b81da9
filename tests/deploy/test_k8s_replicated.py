"""deploy/k8s-replicated stays true: a primary and its replica, valid Kubernetes, command
lines the ``tensorshare`` command accepts, and a readiness probe that is Ready on the primary
only (checked against real servers)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tensorshare import Client, EmbeddedServer
from tensorshare.cli.main import _parser, main
from tests.conftest import wait_until

ROOT = Path(__file__).resolve().parents[2]
HA = ROOT / "deploy" / "k8s-replicated"
DOCS = [d for d in yaml.safe_load_all((HA / "replicated.yaml").read_text()) if d is not None]


def _sts(name: str) -> dict[str, Any]:
    (doc,) = [d for d in DOCS if d["kind"] == "StatefulSet" and d["metadata"]["name"] == name]
    return doc


def _container(name: str) -> dict[str, Any]:
    return dict(_sts(name)["spec"]["template"]["spec"]["containers"][0])


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: f"{d['kind']}-{d['metadata']['name']}")
def test_every_manifest_is_valid_kubernetes(doc: dict[str, Any]) -> None:
    try:
        kubernetes_validate.validate(doc, "1.30", strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{doc['kind']} {doc['metadata']['name']}: {exc.message}")


def test_a_primary_and_its_replica_whose_readiness_says_primary() -> None:
    a, b = (_parser().parse_args(_container(n)["args"]) for n in ("tensorshare-a",
                                                                    "tensorshare-b"))
    assert a.command == b.command == "serve" and a.replica_of is None
    assert b.replica_of == "tensorshare-a-0.tensorshare-ha:7000"
    assert b.upstream_token_file == a.token_file
    for name in ("tensorshare-a", "tensorshare-b"):
        c = _container(name)
        ready = _parser().parse_args(c["readinessProbe"]["exec"]["command"][1:])
        assert ready.command == "health" and ready.role == "primary" and ready.port == 7000
        live = _parser().parse_args(c["livenessProbe"]["exec"]["command"][1:])
        assert live.command == "health" and live.role is None
    services = {d["metadata"]["name"]: d for d in DOCS if d["kind"] == "Service"}
    assert services["tensorshare-ha"]["spec"]["publishNotReadyAddresses"] is True
    assert "publishNotReadyAddresses" not in services["tensorshare-primary"]["spec"]


def test_the_readmes_commands_parse() -> None:
    text = (HA / "README.md").read_text()
    commands = re.findall(r"`(?:kubectl exec \S+ -- )?(tensorshare [^`]+)`", text)
    assert any(c.startswith("tensorshare promote") for c in commands)
    for command in commands:
        argv = shlex.split(command)[1:]
        if argv[0] in ("health", "promote", "stats"):
            _parser().parse_args(argv)


def test_health_with_role_is_ready_on_the_primary_only(capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    with EmbeddedServer(0) as primary, \
            EmbeddedServer(0, replica_of=f"127.0.0.1:{primary.port}") as replica:
        c = Client("127.0.0.1", replica.port, timeout=5)
        wait_until(lambda: c.stats()["server"]["replication"]["synced"], 10, "in sync")
        health = ["health", "--host", "127.0.0.1", "--timeout", "3", "--role", "primary"]
        assert main([*health, "--port", str(primary.port)]) == 0
        assert main([*health, "--port", str(replica.port)]) == 1
        assert "is a replica, not a primary" in capsys.readouterr().err
        assert main(["promote", "--host", "127.0.0.1", "--port", str(replica.port)]) == 0
        assert main([*health, "--port", str(replica.port)]) == 0
        c.close()
