"""deploy/k8s stays true: the manifests are valid Kubernetes, their command lines are ones the
``tensorshare`` command accepts, and the server keeps the promise they rely on (SIGTERM: a
clean exit with the final snapshot written, and a restart on the same volume has the bins).

The manifests are validated offline against a fixed Kubernetes version's schema with
``kubernetes-validate`` in strict mode (an unknown or misspelled field is an error), and every
container's command and probe, and every ``tensorshare`` command of deploy/k8s/README.md, is
parsed by the CLI's own argument parser, so that neither the manifests nor the README nor the
CLI can change without the others.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import torch
import yaml

from tensorshare import Client
from tensorshare.cli.main import _parser
from tensorshare.server.persist import LOG_MAGIC

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.30"  # the schema the manifests are checked against
MANIFESTS = sorted(K8S.glob("*.yaml"))


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]


def _all() -> list[tuple[str, dict[str, Any]]]:
    return [(p.name, d) for p in MANIFESTS for d in _docs(p)]


def _one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for _, d in _all() if d["kind"] == kind
             and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''} in deploy/k8s, found {len(found)}"
    return found[0]


def _parse(argv: list[str], where: str) -> argparse.Namespace:
    """Parse a container's command line as the ``tensorshare`` command would."""
    assert argv[:1] == ["tensorshare"], f"{where}: not a tensorshare command: {argv}"
    try:
        return _parser().parse_args(argv[1:])
    except SystemExit:  # argparse said why on stderr
        pytest.fail(f"{where}: `tensorshare` does not accept {argv[1:]}")


def _containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return list(doc["spec"]["template"]["spec"]["containers"])


def _port(container: dict[str, Any], name: str) -> int:
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    assert name in ports, f"container {container['name']} has no port named {name!r}"
    return int(ports[name])


def _mount_of(pod: dict[str, Any], container: dict[str, Any], path: str) -> tuple[str, str]:
    """The (volume name, mount path) of the mount ``path`` lies in."""
    for m in container.get("volumeMounts", []):
        mount = m["mountPath"].rstrip("/")
        if path == mount or path.startswith(mount + "/"):
            return m["name"], mount
    raise AssertionError(f"{path} is on no volume of container {container['name']}")


# The Secret and key the README's kubectl create secret makes (no manifest holds a token).
TOKEN_SECRET = ("tensorshare-token", "token")


def _token_secret(pod: dict[str, Any], container: dict[str, Any], path: str) -> tuple[str, str]:
    """The (Secret, key) a container's ``--token-file`` reads; the Secret must exist for the
    pod to start (not optional)."""
    volume, mount = _mount_of(pod, container, path)
    (secret_volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == volume]
    assert not secret_volume["secret"].get("optional", False)
    return secret_volume["secret"]["secretName"], os.path.relpath(path, mount)


# --------------------------------------------------------------------------- the schema


def test_the_manifests_are_there() -> None:
    kinds = sorted(d["kind"] for _, d in _all())
    # No Secret: a placeholder token in the applied directory would overwrite the real one
    # (made with kubectl create secret, see test_the_token_secret_is_made_before_the_apply).
    assert kinds == sorted(["DaemonSet", "PodDisruptionBudget", "Service", "Service",
                            "StatefulSet"])
    assert (K8S / "relay-daemonset.yaml").exists()  # in its own file: it can be left out
    assert {d["kind"] for d in _docs(K8S / "relay-daemonset.yaml")} == {"DaemonSet", "Service"}


@pytest.mark.parametrize("name, doc", _all(), ids=lambda v: v if isinstance(v, str) else
                         f"{v['kind']}-{v['metadata']['name']}")
def test_every_manifest_is_valid_kubernetes(name: str, doc: dict[str, Any]) -> None:
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{name}: {doc['kind']} {doc['metadata']['name']}: {exc.message}")


def test_the_validator_would_catch_a_misspelled_field() -> None:
    doc = _one("StatefulSet")
    container = _containers(doc)[0]
    container["livenesProbe"] = container.pop("livenessProbe")
    with pytest.raises(kubernetes_validate.ValidationError, match="livenesProbe"):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


# --------------------------------------------------------------------------- the shards


def test_the_shards_run_tensorshare_serve_as_the_cli_parses_it() -> None:
    sts = _one("StatefulSet", "tensorshare")
    pod = sts["spec"]["template"]
    (container,) = _containers(sts)
    args = _parse([*container["command"], *container.get("args", [])], "statefulset.yaml")
    assert args.command == "serve"
    assert args.host == "0.0.0.0" and args.port == _port(container, "tensorshare")
    # --data-dir is the volume each pod gets from the claim template.
    volume, _ = _mount_of(pod, container, args.data_dir)
    assert volume in {t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]}
    # The token is a file of the Secret (the server refuses 0.0.0.0 without one).
    assert args.token_file is not None and not args.insecure
    assert _token_secret(pod, container, args.token_file) == TOKEN_SECRET
    # Metrics: the port the server serves them on is the one annotated for Prometheus.
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert args.metrics_port == int(annotations["prometheus.io/port"]) \
        == _port(container, "metrics")
    assert args.metrics_host in (None, "0.0.0.0")  # (default: --host's)
    assert annotations.get("prometheus.io/path", "/metrics") == "/metrics"


def test_the_headless_service_names_every_shard() -> None:
    sts = _one("StatefulSet", "tensorshare")
    svc = _one("Service", sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None"  # headless: one DNS record per pod
    assert svc["spec"]["publishNotReadyAddresses"] is True
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (container,) = _containers(sts)
    named = {p["name"] for p in container["ports"]}
    for port in svc["spec"]["ports"]:
        assert port["targetPort"] in named
        assert port["port"] == _port(container, port["targetPort"])
    pdb = _one("PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_the_pods_have_resources_and_time_to_write_the_final_snapshot() -> None:
    for name, doc in _all():
        if doc["kind"] not in ("StatefulSet", "DaemonSet"):
            continue
        spec = doc["spec"]["template"]["spec"]
        assert spec["terminationGracePeriodSeconds"] >= 30, name
        for container in spec["containers"]:
            res = container["resources"]
            assert {"cpu", "memory"} <= res["requests"].keys(), name
            assert "memory" in res["limits"], name
    shards = _one("StatefulSet")["spec"]["template"]["spec"]
    assert shards["terminationGracePeriodSeconds"] >= 60


def test_every_probe_is_tensorshare_health_against_its_own_server() -> None:
    probes = 0
    for name, doc in _all():
        if doc["kind"] not in ("StatefulSet", "DaemonSet"):
            continue
        for container in _containers(doc):
            own = [*container["command"], *container.get("args", [])]
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = container.get(kind)
                if probe is None:
                    assert kind == "startupProbe", f"{name}: {container['name']} has no {kind}"
                    continue
                where = f"{name}: {container['name']}'s {kind}"
                args = _parse(probe["exec"]["command"], where)
                assert args.command == "health", where
                port = int(own[own.index("--port") + 1])
                assert args.host in (None, "127.0.0.1") and args.port == port, where
                token = own[own.index("--token-file") + 1]
                assert args.token_file == token, where
                # The command answers (exit 1, one line) before the kubelet gives up on it.
                assert args.timeout + 2 <= probe["timeoutSeconds"], where
                probes += 1
    assert probes >= 5


def test_the_readme_names_the_shards_as_the_manifests_do() -> None:
    from tensorshare.client.sharded import expand_servers

    readme = (K8S / "README.md").read_text(encoding="utf-8")
    assert "kubectl apply -f deploy/k8s/" in readme
    sts = _one("StatefulSet", "tensorshare")
    name, service = sts["metadata"]["name"], sts["spec"]["serviceName"]
    assert f"kubectl scale statefulset {name} --replicas=" in readme
    port = _port(_containers(sts)[0], "tensorshare")
    shards = [f"{name}-{i}.{service}:{port}" for i in range(sts["spec"]["replicas"])]
    listed = re.findall(r"value: (\S+)", readme.split("TENSORSHARE_SERVERS", 1)[1])[0]
    assert listed.split(",") == shards
    # A list of several names is taken as written (no DNS look-up), as placement needs.
    assert expand_servers(listed) == [f"tensorshare://{s}" for s in shards]


def _readme_commands() -> list[list[str]]:
    """Every ``tensorshare`` command line in the README's bash blocks, also those run in a
    pod (``kubectl exec POD -- tensorshare ...``), continuation lines joined."""
    readme = (K8S / "README.md").read_text(encoding="utf-8")
    found = []
    for block in re.findall(r"```bash\n(.*?)```", readme, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if not re.match(r"\s*(kubectl exec \S+ -- )?tensorshare ", line):
                continue  # (a multi-line python3 -c "..." is not one)
            argv = shlex.split(line, comments=True)
            if argv[:2] == ["kubectl", "exec"] and "--" in argv:
                argv = argv[argv.index("--") + 1:]
            if argv[:1] == ["tensorshare"]:
                found.append(argv)
    return found


def test_the_readmes_commands_parse_and_removing_a_shard_drains_the_last_one() -> None:
    parsed = [_parse(argv, "deploy/k8s/README.md") for argv in _readme_commands()]
    assert {"health", "ls", "rebalance"} <= {a.command for a in parsed}
    # Scaling down removes the highest-numbered pod: that is the shard drained, into the
    # others, before the scale command the README gives next.
    (drain,) = [a for a in parsed if a.command == "rebalance"]
    sts = _one("StatefulSet", "tensorshare")
    name, service = sts["metadata"]["name"], sts["spec"]["serviceName"]
    port, n = _port(_containers(sts)[0], "tensorshare"), sts["spec"]["replicas"]
    shards = [f"{name}-{i}.{service}:{port}" for i in range(n)]
    assert drain.drain == shards[-1:] and drain.servers.split(",") == shards[:-1]
    readme = (K8S / "README.md").read_text(encoding="utf-8")
    after = readme.split("--drain", 1)[1]
    assert f"kubectl scale statefulset {name} --replicas={n - 1}" in after
    # In the pod the command finds the token where the manifest says it is.
    (container,) = _containers(sts)
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    args = [*container["command"], *container.get("args", [])]
    assert env.get("TENSORSHARE_TOKEN_FILE") == args[args.index("--token-file") + 1]


# --------------------------------------------------------------------------- the relays


def test_the_relays_command_line_parses() -> None:
    ds = _one("DaemonSet", "tensorshare-relay")
    (container,) = _containers(ds)
    argv = [*container["command"], *container.get("args", [])]
    assert argv[:2] == ["tensorshare", "relay"]
    svc = _one("Service", "tensorshare-relay")
    assert svc["spec"]["internalTrafficPolicy"] == "Local"  # the relay on the worker's node
    assert svc["spec"]["selector"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    port = int(argv[argv.index("--port") + 1])
    assert svc["spec"]["ports"][0]["port"] == port == _port(container, "relay")
    args = _parse(argv, "relay-daemonset.yaml")
    assert args.command == "relay" and args.bins == ["rl/parameters"]  # RLTrainer's bin
    assert args.upstream.startswith("tensorshare://") and args.token_file
    # (the upstream's token is the shards' Secret)
    assert _token_secret(ds["spec"]["template"], container, args.token_file) == TOKEN_SECRET


def test_the_token_secret_is_made_before_the_apply_and_nothing_applied_overwrites_it() -> None:
    """The README makes the Secret the pods mount, with the key their --token-file reads,
    before ``kubectl apply -f deploy/k8s/``; no manifest that apply applies holds a Secret
    (it would put a placeholder over the real token), and a pod does not start without it."""
    readme = (K8S / "README.md").read_text(encoding="utf-8")
    blocks = "\n".join(re.findall(r"```bash\n(.*?)```", readme, re.S)).replace("\\\n", " ")
    create = [line for line in blocks.splitlines() if "kubectl create secret" in line]
    assert len(create) == 1, create
    argv = shlex.split(create[0])
    name, key = TOKEN_SECRET
    assert argv[:4] == ["kubectl", "create", "secret", "generic"] and argv[4] == name
    assert any(a.startswith(f"--from-literal={key}=") or a.startswith(f"--from-file={key}=")
               for a in argv[5:])
    assert blocks.index("kubectl create secret") < blocks.index("kubectl apply -f deploy/k8s/")
    applied = [p for p in K8S.iterdir() if p.suffix in (".yaml", ".yml", ".json")]
    assert applied and all(d["kind"] != "Secret" for p in applied for d in _docs(p))


# --------------------------------------------------------------------------- SIGTERM


class _Serve:
    """``tensorshare serve --port 0 --data-dir DIR`` in a subprocess, as a pod runs it."""

    def __init__(self, data_dir: Path, log: Path) -> None:
        self.log = log
        with open(log, "a", encoding="utf-8") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tensorshare", "serve", "--host", "127.0.0.1",
                 "--port", "0", "--data-dir", str(data_dir)],
                stdout=subprocess.PIPE, stderr=err, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if "listening on 127.0.0.1:" not in line:
            self.proc.kill()
            self.proc.wait(30)
            raise AssertionError(f"the server did not start: {line!r}\n{self.errors()}")
        self.port = int(line.rsplit(":", 1)[1])

    def errors(self) -> str:
        return self.log.read_text(encoding="utf-8")

    def terminate(self) -> tuple[int, float]:
        """SIGTERM, as the kubelet sends it; the exit status and how long it took."""
        start = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
            raise AssertionError(f"no exit 30 s after SIGTERM\n{self.errors()}") from None
        return code, time.monotonic() - start

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


def test_sigterm_writes_the_final_snapshot_and_a_restart_has_the_bins(tmp_path: Path) -> None:
    data, log = tmp_path / "data", tmp_path / "server.log"
    server = _Serve(data, log)
    try:
        params = {"w": torch.randn(64, 32), "b": torch.arange(32.0)}
        with Client("127.0.0.1", server.port, timeout=30) as c:
            for step in range(3):
                c.put("params", {**params, "step": step})
            for i in range(5):
                c.append("rollouts", torch.full((4,), float(i)))
            c.append("{run7}scores", 1.5)
            before = {name: b["version"] for name, b in c.stats()["bins"].items()}
            # A client still connected when SIGTERM comes (pods' clients are).
            lingering = Client("127.0.0.1", server.port, timeout=30, reconnect=False)
            lingering.ping()
            code, took = server.terminate()
            lingering.close()
        assert code == 0, server.errors()
        assert took < 10, took  # well within terminationGracePeriodSeconds
    finally:
        server.kill()

    # The final snapshot is written and the log compacted as a clean shutdown does: only the
    # snapshot and a fresh, empty segment after it remain.
    files = sorted(os.listdir(data))
    snapshots = [f for f in files if re.fullmatch(r"snapshot-\d{12}\.tss", f)]
    logs = [f for f in files if re.fullmatch(r"log-\d{12}\.tsl", f)]
    assert len(snapshots) == 1, files
    number = int(snapshots[0][9:21])
    assert logs == [f"log-{number + 1:012d}.tsl"], files
    assert (data / logs[0]).read_bytes() == LOG_MAGIC
    assert not [f for f in files if f.endswith(".tmp")], files

    server = _Serve(data, log)
    try:
        with Client("127.0.0.1", server.port, timeout=30) as c:
            assert {name: b["version"] for name, b in c.stats()["bins"].items()} == before
            got = c.peek("params")
            assert got["step"] == 2
            assert torch.equal(got["w"], params["w"]) and torch.equal(got["b"], params["b"])
            rollouts = c.get("rollouts", max_items=None)
            assert [float(t[0]) for t in rollouts] == [0.0, 1.0, 2.0, 3.0, 4.0]
            assert c.peek("{run7}scores") == [1.5]
        code, _ = server.terminate()
        assert code == 0, server.errors()
    finally:
        server.kill()
    # Loaded from the snapshot alone: nothing was left to replay.
    assert re.search(r"loaded .*: 3 bins, \d+ sessions \(0 log records replayed after "
                     rf"{snapshots[0]}\)", server.errors()), server.errors()
