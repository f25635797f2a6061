"""A real, local Kubernetes control plane for the end-to-end tests.

kube-apiserver, etcd, kube-controller-manager and kube-scheduler are the real binaries, built from
the Go module proxy by ``e2e/build-binaries.sh``; kwok (driven by ``kwokctl --runtime binary``)
simulates the nodes and the pods' lifecycle, so no kubelet or container runtime is needed.

Network rule: nothing may connect outside 127.0.0.0/8. Every component binds 127.0.0.1
(``bindAddress``), the fake nodes' InternalIPs are loopback addresses, each node carries a loopback
``spec.podCIDR`` from which kwok hands out pod IPs (with a loopback default CIDR behind it), the
Service ClusterIP range is loopback, and the API server advertises 127.0.0.1 (with the endpoint
reconciler off, which refuses loopback). kwokctl's download locations are compiled to a closed
loopback port, so a missing binary fails at once.

One consequence: the API server refuses loopback addresses in EndpointSlices, so Services over
these pods get no endpoints (kube-controller-manager logs FailedToUpdateEndpointSlices). Code that
needs an engine's address reads the Pod's ``status.podIP``.

Command line (the cluster outlives the command; ``down`` stops every process it started)::

    python -m e2e.cluster up [--name NAME]      # prints the kubeconfig path
    python -m e2e.cluster down --name NAME
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from e2e.polling import poll

E2E_DIR = Path(__file__).resolve().parent
BUILD_SCRIPT = E2E_DIR / "build-binaries.sh"

GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"

# Loopback ranges. 127.0.0.1 is where the components listen; the rest never collide with it.
NODE_IP_BASE = ipaddress.IPv4Address("127.0.1.1")  # node i gets 127.0.1.(1+i)
NODE_POD_CIDR_BASE = ipaddress.IPv4Network("127.1.0.0/16")  # node i gets 127.1.(1+i).0/24
DEFAULT_POD_CIDR = "127.2.0.0/16"  # kwok's fallback pool for nodes without a podCIDR
SERVICE_CIDR = "127.3.0.0/16"  # Service ClusterIPs (nothing dials them: there is no kube-proxy)
LOOPBACK = ipaddress.IPv4Network("127.0.0.0/8")


def k8s_version(go_mod: Path = E2E_DIR / "k8s-bins" / "kubernetes" / "go.mod") -> str:
    """The Kubernetes release the binaries are built from, e.g. v1.37.2."""
    for line in go_mod.read_text().splitlines():
        parts = line.split()
        if parts[:1] == ["k8s.io/kubernetes"] and len(parts) >= 2 and parts[1].startswith("v"):
            return parts[1]
        if parts[:2] == ["require", "k8s.io/kubernetes"]:
            return parts[2]
    raise ClusterError(f"k8s.io/kubernetes is not required in {go_mod}")


BINARIES = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kwok",
    "kwokctl",
    "kubectl",
    "helm",
    "prometheus",
)


class ClusterError(RuntimeError):
    """The local cluster could not be built, started, checked or stopped."""


# --------------------------------------------------------------------------------------- binaries


@dataclass(frozen=True)
class Binaries:
    """The directory that build-binaries.sh filled; one attribute per binary path."""

    bin_dir: Path

    def path(self, name: str) -> Path:
        return self.bin_dir / name

    @property
    def kubectl(self) -> Path:
        return self.path("kubectl")

    @property
    def helm(self) -> Path:
        return self.path("helm")

    @property
    def kwokctl(self) -> Path:
        return self.path("kwokctl")

    def missing(self) -> list[str]:
        return [n for n in BINARIES if not os.access(self.path(n), os.X_OK)]

    def check(self) -> Binaries:
        missing = self.missing()
        if missing:
            raise ClusterError(f"missing binaries in {self.bin_dir}: {', '.join(missing)} (run {BUILD_SCRIPT})")
        return self


def build_binaries(script: Path = BUILD_SCRIPT, timeout_s: float = 3600.0) -> Binaries:
    """Run build-binaries.sh (a no-op when everything is cached) and return its bin dir.

    The script's progress is echoed to stderr as it comes; its last stdout line is the bin dir.
    A failure raises ClusterError with the end of the script's output (the go command's error).
    """
    tail: deque[str] = deque(maxlen=60)
    deadline = time.monotonic() + timeout_s
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(["bash", str(script)], stdout=out, stderr=subprocess.PIPE, text=True)
        assert proc.stderr is not None
        try:
            for line in proc.stderr:
                sys.stderr.write(line)
                tail.append(line.rstrip("\n"))
                if time.monotonic() > deadline:
                    raise ClusterError(f"{script} did not finish within {timeout_s:.0f}s")
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        out.seek(0)
        lines = out.read().strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise ClusterError(f"{script} failed with exit code {proc.returncode}:\n" + "\n".join(tail))
    return Binaries(Path(lines[-1])).check()


# ------------------------------------------------------------------------------------ fake nodes


@dataclass(frozen=True)
class GPUNodeSpec:
    """One fake GPU node: what the scheduler and the operator see."""

    name: str
    product: str  # value of the product label, e.g. NVIDIA-L4
    gpus: int
    gpu_memory_mib: int
    product_label: str = GPU_PRODUCT_LABEL
    resource: str = GPU_RESOURCE
    cpu: str = "96"
    memory: str = "1024Gi"
    pods: str = "110"
    extra_labels: Mapping[str, str] = field(default_factory=dict)


# (catalog name, GPUs per node) of the default fake fleet; the products come from the catalog.
DEFAULT_FLEET: tuple[tuple[str, int], ...] = (
    ("A10G", 4),
    ("L4", 8),
    ("A100-80GB", 8),
    ("H100-80GB", 8),
)


def _catalog_gpu(name: str) -> tuple[str, str, str, float]:
    """(product, product label, resource, memory GiB) of a GPU in the operator's catalog."""
    from kvpilot.operator.planning.gpus import GPUS

    gpu = GPUS[name]
    return gpu.product, gpu.product_label, gpu.resource, gpu.memory_gib


def fleet_products(fleet: Sequence[tuple[str, int]] = DEFAULT_FLEET) -> set[str]:
    return {_catalog_gpu(name)[0] for name, _ in fleet}


def default_gpu_nodes(fleet: Sequence[tuple[str, int]] = DEFAULT_FLEET) -> list[GPUNodeSpec]:
    """One fake node per (catalog GPU name, count), named gpu-<name>-<i>, i counting that type's
    nodes from 0 (a fleet may name a type twice: nodes of one type in two capacity classes)."""
    nodes = []
    for name, count in fleet:
        product, label, resource, mem_gib = _catalog_gpu(name)
        nodes.append(
            GPUNodeSpec(
                name=f"gpu-{name.lower()}-{sum(n.product == product for n in nodes)}",
                product=product,
                gpus=count,
                gpu_memory_mib=int(mem_gib * 1024),
                product_label=label,
                resource=resource,
            )
        )
    return nodes


def node_ip(index: int) -> str:
    ip = NODE_IP_BASE + index
    assert ip in LOOPBACK
    return str(ip)


def node_pod_cidr(index: int) -> str:
    if not 0 <= index < 254:
        raise ValueError(f"node index {index} out of range")
    net = list(NODE_POD_CIDR_BASE.subnets(new_prefix=24))[index + 1]
    return str(net)


def node_manifest(spec: GPUNodeSpec, index: int) -> dict[str, Any]:
    """The Node object kwok takes over: GPU capacity, GPU feature-discovery labels, loopback IPs."""
    labels = {
        "kubernetes.io/hostname": spec.name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "kubernetes.io/role": "agent",
        "node-role.kubernetes.io/agent": "",
        "type": "kwok",
        spec.product_label: spec.product,
        **(
            {"nvidia.com/gpu.count": str(spec.gpus), "nvidia.com/gpu.memory": str(spec.gpu_memory_mib)}
            if spec.resource == GPU_RESOURCE
            else {}
        ),
        **spec.extra_labels,
    }
    resources = {
        "cpu": spec.cpu,
        "memory": spec.memory,
        "pods": spec.pods,
        "ephemeral-storage": "1Ti",
        spec.resource: str(spec.gpus),
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": spec.name,
            "labels": labels,
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {"podCIDR": node_pod_cidr(index), "podCIDRs": [node_pod_cidr(index)]},
        "status": {
            "capacity": dict(resources),
            "allocatable": dict(resources),
            "addresses": [
                {"type": "InternalIP", "address": node_ip(index)},
                {"type": "Hostname", "address": spec.name},
            ],
            "nodeInfo": {
                "architecture": "amd64",
                "operatingSystem": "linux",
                "kubeletVersion": "fake",
                "kubeProxyVersion": "fake",
                "osImage": "kwok",
                "kernelVersion": "fake",
                "containerRuntimeVersion": "fake",
            },
        },
    }


# ------------------------------------------------------------------------------- kwokctl config


def kwokctl_config(binaries: Binaries, *, audit_policy: Path | None = None) -> list[dict[str, Any]]:
    """The kwokctl configuration document (a KwokctlConfiguration)."""
    options: dict[str, Any] = {
        "runtime": "binary",
        "bindAddress": "127.0.0.1",
        "securePort": True,
        "kubeAuthorization": True,  # RBAC is real: the chart's ServiceAccount is tested with it
        "kubeAdmission": True,
        "quietPull": True,
        "kubeApiserverBinary": str(binaries.path("kube-apiserver")),
        "kubeControllerManagerBinary": str(binaries.path("kube-controller-manager")),
        "kubeSchedulerBinary": str(binaries.path("kube-scheduler")),
        "kubectlBinary": str(binaries.path("kubectl")),
        "etcdBinary": str(binaries.path("etcd")),
        "kwokControllerBinary": str(binaries.path("kwok")),
    }
    if audit_policy is not None:
        options["kubeAuditPolicy"] = str(audit_policy)

    # kwokctl's `override` replaces an argument it already passes; without it the arg is appended.
    def arg(key: str, value: str, override: bool = False) -> dict[str, Any]:
        return {"key": key, "value": value, "override": override}

    return [
        {
            "apiVersion": "config.kwok.x-k8s.io/v1alpha1",
            "kind": "KwokctlConfiguration",
            "options": options,
            "componentsPatches": [
                {
                    "name": "kube-apiserver",
                    "extraArgs": [
                        # a loopback advertise address is only allowed without the endpoint
                        # reconciler; nothing here dials the `kubernetes` Service anyway
                        arg("advertise-address", "127.0.0.1"),
                        arg("endpoint-reconciler-type", "none"),
                        arg("service-cluster-ip-range", SERVICE_CIDR),
                    ],
                },
                {
                    # The cluster lives for one test run: a crash loses nothing worth an fsync, and
                    # on a shared VM's disk one WAL fsync stalled etcd 4 s, long enough for
                    # kube-controller-manager to give up on the API server's health and exit.
                    "name": "etcd",
                    "extraArgs": [arg("unsafe-no-fsync", "true")],
                },
                {
                    "name": "kwok-controller",
                    # kwokctl passes an empty --node-ip in the binary runtime
                    "extraArgs": [arg("node-ip", "127.0.0.1", override=True), arg("cidr", DEFAULT_POD_CIDR)],
                },
            ],
        },
    ]


def unique_name(prefix: str = "kvpilot-e2e") -> str:
    return f"{prefix}-{os.getpid()}-{secrets.token_hex(3)}"


def default_state_root() -> Path:
    return Path(os.environ.get("KVPILOT_E2E_STATE", Path(tempfile.gettempdir()) / "kvpilot-e2e"))


def _clean_env(extra: Mapping[str, str]) -> dict[str, str]:
    """This process's environment without KWOK_* / KUBECONFIG leaking in, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KWOK_") and k != "KUBECONFIG"}
    env.update(extra)
    return env


# ------------------------------------------------------------------------------------- cluster


@dataclass
class Cluster:
    """A running local cluster. `kubectl`/`helm` run against it with its kubeconfig."""

    name: str
    binaries: Binaries
    state_dir: Path  # everything of this cluster lives here (KWOK_WORKDIR)
    nodes: list[GPUNodeSpec] = field(default_factory=list)

    @property
    def workdir(self) -> Path:
        return self.state_dir / "clusters" / self.name

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig.yaml"

    @property
    def logs_dir(self) -> Path:
        return self.workdir / "logs"

    @property
    def audit_log(self) -> Path:
        """Where kwokctl points the API server's audit log (written only with an audit policy)."""
        return self.logs_dir / "audit.log"

    @property
    def _marker(self) -> str:
        """Every component's command line names a path under this prefix."""
        return str(self.state_dir) + os.sep

    def env(self, **extra: str) -> dict[str, str]:
        """Environment for a child process that talks to this cluster (KUBECONFIG set)."""
        return _clean_env({"KWOK_WORKDIR": str(self.state_dir), "KUBECONFIG": str(self.kubeconfig), **extra})

    def _run(
        self,
        argv: Sequence[str],
        *,
        input: str | None = None,
        check: bool = True,
        timeout: float = 60.0,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        try:
            proc = subprocess.run(
                list(argv),
                input=input,
                capture_output=True,
                text=True,
                env=self.env(**(env or {})),
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise ClusterError(f"timed out after {timeout:.0f}s: {' '.join(argv)}") from exc
        if check and proc.returncode != 0:
            raise ClusterError(
                f"exit {proc.returncode}: {' '.join(argv)}\n"
                f"stdout: {proc.stdout.strip()}\nstderr: {proc.stderr.strip()}"
            )
        return proc

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        return self._run(
            [str(self.binaries.kubectl), "--kubeconfig", str(self.kubeconfig), *args],
            input=input,
            check=check,
            timeout=timeout,
        )

    def kubectl_json(self, *args: str, timeout: float = 60.0) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json", timeout=timeout).stdout)

    def apply(self, *objects: Mapping[str, Any], timeout: float = 60.0) -> str:
        doc = yaml.safe_dump_all([dict(o) for o in objects], sort_keys=False)
        return self.kubectl("apply", "-f", "-", input=doc, timeout=timeout).stdout

    def helm(self, *args: str, check: bool = True, timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
        # Helm's own state (repositories, cache) stays inside this cluster's state dir.
        home = self.state_dir / "helm"
        return self._run(
            [str(self.binaries.helm), "--kubeconfig", str(self.kubeconfig), *args],
            check=check,
            timeout=timeout,
            env={
                "HELM_CACHE_HOME": str(home / "cache"),
                "HELM_CONFIG_HOME": str(home / "config"),
                "HELM_DATA_HOME": str(home / "data"),
            },
        )

    def kwokctl(self, *args: str, check: bool = True, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return self._run([str(self.binaries.kwokctl), *args, "--name", self.name], check=check, timeout=timeout)

    # -- diagnostics

    def pids(self) -> dict[str, int]:
        """PIDs of the component processes kwokctl started (from its pid files)."""
        out: dict[str, int] = {}
        pid_dir = self.workdir / "pids"
        if pid_dir.is_dir():
            for f in pid_dir.glob("*.pid"):
                with contextlib.suppress(ValueError, OSError):
                    out[f.stem] = int(f.read_text().strip())
        return out

    def log_tail(self, lines: int = 30) -> str:
        chunks = []
        if self.logs_dir.is_dir():
            for f in sorted(self.logs_dir.glob("*.log")):
                with contextlib.suppress(OSError):
                    tail = f.read_text(errors="replace").splitlines()[-lines:]
                    chunks.append(f"--- {f.name} (last {len(tail)} lines)\n" + "\n".join(tail))
        return "\n".join(chunks) or f"(no logs in {self.logs_dir})"

    # -- lifecycle

    def dead_components(self) -> list[str]:
        """Components whose pid file exists but whose process is gone."""
        return sorted(n for n, pid in self.pids().items() if not pid_belongs(pid, self._marker))

    def _raise_if_dead(self) -> None:
        dead = self.dead_components()
        if dead:
            raise ClusterError(f"component(s) of {self.name} exited: {', '.join(dead)}")

    def not_ready_nodes(self) -> list[str]:
        items = self.kubectl_json("get", "nodes", timeout=20)["items"]
        ready = {
            n["metadata"]["name"]
            for n in items
            if any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"].get("conditions", []))
        }
        return [n.name for n in self.nodes if n.name not in ready]

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """API server ready, default ServiceAccount present, every fake node Ready.

        Fails fast when a component process has exited.
        """
        last = ""

        def ready() -> bool:
            nonlocal last
            self._raise_if_dead()
            p = self.kubectl("get", "--raw", "/readyz", check=False, timeout=10)
            if p.returncode == 0 and p.stdout.strip() == "ok":
                p = self.kubectl("get", "serviceaccount", "default", "-n", "default", check=False, timeout=10)
                if p.returncode == 0:
                    pending = self.not_ready_nodes()
                    if not pending:
                        return True
                    p = subprocess.CompletedProcess([], 1, "", f"nodes not Ready: {', '.join(pending)}")
            last = (p.stdout + p.stderr).strip()
            return False

        try:
            poll(ready, timeout_s, f"cluster {self.name} ready")
        except TimeoutError:
            raise ClusterError(f"cluster {self.name} not ready after {timeout_s:.0f}s: {last}") from None

    def add_nodes(self, nodes: Sequence[GPUNodeSpec]) -> None:
        start = len(self.nodes)
        manifests = [node_manifest(spec, start + i) for i, spec in enumerate(nodes)]
        # `create`, not `apply`: a Node's status is kept on create, which is what kwok builds on.
        doc = yaml.safe_dump_all(manifests, sort_keys=False)
        self.kubectl("create", "-f", "-", input=doc)
        self.nodes.extend(nodes)

    def delete(self, timeout_s: float = 60.0) -> None:
        """Stop every process of this cluster and remove its state; safe to call twice."""
        pids = self.pids()
        errors = []
        if self.workdir.exists():
            try:
                p = self.kwokctl("delete", "cluster", check=False, timeout=timeout_s)
                if p.returncode != 0:
                    errors.append(f"kwokctl delete cluster: exit {p.returncode}: {p.stderr.strip()}")
            except ClusterError as exc:  # timed out: the processes are still stopped below
                errors.append(str(exc))
        leftover = stop_pids(pids, marker=self._marker)
        if leftover:
            errors.append(f"processes still alive after SIGKILL: {leftover}")
        shutil.rmtree(self.state_dir, ignore_errors=True)
        if errors:
            raise ClusterError(f"deleting cluster {self.name}: " + "; ".join(errors))


def pid_belongs(pid: int, marker: str) -> bool:
    """True when `pid` is alive and its command line names this cluster's state dir."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    state = stat.rsplit(")", 1)[-1].split()[0]
    return state != "Z" and marker in cmdline


def stop_pids(pids: Mapping[str, int], marker: str, grace_s: float = 10.0) -> dict[str, int]:
    """SIGTERM, then SIGKILL, the given processes that still belong to the cluster."""
    alive = {n: p for n, p in pids.items() if pid_belongs(p, marker)}
    for pid in alive.values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)

    def gone() -> bool:
        nonlocal alive
        alive = {n: p for n, p in alive.items() if pid_belongs(p, marker)}
        return not alive

    with contextlib.suppress(TimeoutError):
        poll(gone, grace_s, "processes to exit on SIGTERM", interval_s=0.2)
    for pid in alive.values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    time.sleep(0.2)
    return {n: p for n, p in alive.items() if pid_belongs(p, marker)}


def start_cluster(
    binaries: Binaries,
    *,
    name: str | None = None,
    nodes: Sequence[GPUNodeSpec] | None = None,
    state_root: Path | None = None,
    audit_policy: Path | None = None,
    timeout_s: float = 180.0,
) -> Cluster:
    """Create a cluster with kwokctl's binary runtime and the fake GPU nodes; wait until Ready.

    With `audit_policy`, the API server writes an audit log to `Cluster.audit_log`.
    On any failure the partial cluster is deleted and ClusterError carries the components' logs.
    """
    binaries.check()
    name = name or unique_name()
    state_dir = (state_root or default_state_root()) / name
    if state_dir.exists():
        raise ClusterError(f"{state_dir} already exists: is cluster {name} running? (down it first)")
    state_dir.mkdir(parents=True)
    cluster = Cluster(name=name, binaries=binaries, state_dir=state_dir)
    config_path = state_dir / "kwokctl.yaml"
    config_path.write_text(yaml.safe_dump_all(kwokctl_config(binaries, audit_policy=audit_policy), sort_keys=False))
    try:
        _kwokctl_create(cluster, config_path, timeout_s)
        if not cluster.kubeconfig.exists():
            raise ClusterError(f"kwokctl created no kubeconfig at {cluster.kubeconfig}")
        cluster.wait_ready(timeout_s=timeout_s)
        cluster.add_nodes(default_gpu_nodes() if nodes is None else nodes)
        cluster.wait_ready(timeout_s=timeout_s)
    except BaseException as exc:
        logs = cluster.log_tail()
        with contextlib.suppress(Exception):
            cluster.delete()
        if isinstance(exc, ClusterError):
            raise ClusterError(f"{exc}\n\ncomponent logs:\n{logs}") from exc
        raise
    return cluster


def _kwokctl_create(cluster: Cluster, config_path: Path, timeout_s: float) -> None:
    """Run `kwokctl create cluster`, failing fast when one of the components it started dies."""
    argv = [
        str(cluster.binaries.kwokctl),
        "--config",
        str(config_path),
        "create",
        "cluster",
        "--name",
        cluster.name,
        "--kubeconfig=",  # never touch ~/.kube/config
        f"--timeout={int(timeout_s)}s",
        "--wait=0s",
    ]
    log_path = cluster.state_dir / "kwokctl-create.log"

    def finished() -> bool:
        cluster._raise_if_dead()
        return proc.poll() is not None

    with log_path.open("w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=cluster.env())
        try:
            poll(finished, timeout_s + 30, "kwokctl create cluster", interval_s=0.3)
        except TimeoutError:
            raise ClusterError(f"kwokctl create cluster did not finish within {timeout_s + 30:.0f}s") from None
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    if proc.returncode != 0:
        out = log_path.read_text(errors="replace").strip().splitlines()[-20:]
        raise ClusterError(f"kwokctl create cluster failed (exit {proc.returncode}):\n" + "\n".join(out))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_stale_clusters(binaries: Binaries, state_root: Path | None = None, prefix: str = "kvpilot-e2e") -> list[str]:
    """Delete clusters left behind by test runs that were killed (SIGKILL skips teardown).

    A cluster named by unique_name() carries the PID of the process that started it; when that
    process is gone, its cluster is deleted. Returns the names reaped.
    """
    root = state_root or default_state_root()
    reaped = []
    for d in sorted(root.glob(f"{prefix}-*-*")) if root.is_dir() else []:
        owner = d.name[len(prefix) + 1 :].split("-", 1)[0]
        if d.is_dir() and owner.isdigit() and not _pid_alive(int(owner)):
            with contextlib.suppress(ClusterError):
                Cluster(name=d.name, binaries=binaries, state_dir=d).delete()
            reaped.append(d.name)
    return reaped


@contextlib.contextmanager
def running_cluster(binaries: Binaries | None = None, **kwargs: Any) -> Iterator[Cluster]:
    """Build (or reuse) the binaries, start a cluster, yield it, and always delete it."""
    cluster = start_cluster(binaries or build_binaries(), **kwargs)
    try:
        yield cluster
    finally:
        cluster.delete()


def non_loopback_ips(cluster: Cluster) -> list[str]:
    """Every pod IP, host IP, node address and Service ClusterIP that is not in 127.0.0.0/8."""
    bad: list[str] = []

    def check(what: str, ip: str | None) -> None:
        if ip and ip != "None" and not is_loopback(ip):
            bad.append(f"{what}={ip}")

    for pod in cluster.kubectl_json("get", "pods", "-A")["items"]:
        ref = f"pod/{pod['metadata']['namespace']}/{pod['metadata']['name']}"
        status = pod.get("status", {})
        check(ref + " podIP", status.get("podIP"))
        check(ref + " hostIP", status.get("hostIP"))
        for ip in status.get("podIPs") or []:
            check(ref + " podIPs", ip.get("ip"))
    for node in cluster.kubectl_json("get", "nodes")["items"]:
        for addr in node.get("status", {}).get("addresses", []):
            if addr["type"].endswith("IP"):
                check(f"node/{node['metadata']['name']} {addr['type']}", addr["address"])
    for svc in cluster.kubectl_json("get", "services", "-A")["items"]:
        for ip in svc.get("spec", {}).get("clusterIPs") or []:
            check(f"service/{svc['metadata']['namespace']}/{svc['metadata']['name']}", ip)
    for eps in cluster.kubectl_json("get", "endpointslices", "-A")["items"]:
        for ep in eps.get("endpoints") or []:
            for ip in ep.get("addresses") or []:
                check(f"endpointslice/{eps['metadata']['namespace']}/{eps['metadata']['name']}", ip)
    return bad


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    with contextlib.suppress(OSError):
        for fd in fd_dir.iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    return inodes


def _decode_proc_addr(hex_addr: str) -> tuple[str, int]:
    ip_hex, port_hex = hex_addr.split(":")
    raw = bytes.fromhex(ip_hex)
    if len(raw) == 4:
        ip = ipaddress.IPv4Address(raw[::-1])
    else:  # /proc/net/tcp6: four little-endian 32-bit words
        ip = ipaddress.IPv6Address(b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
    return str(ip), int(port_hex, 16)


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket that process `pid` listens on (Linux /proc)."""
    inodes = _socket_inodes(pid)
    found = []
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A = LISTEN
                    found.append(_decode_proc_addr(cols[1]))
    return found


def is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


# ----------------------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.cluster", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="build/reuse binaries, start a cluster, print its kubeconfig")
    up.add_argument("--name", default=None)
    down = sub.add_parser("down", help="stop a cluster started with `up` and remove its state")
    down.add_argument("--name", required=True)
    for p in (up, down):
        p.add_argument("--state-root", type=Path, default=None, help="default: $TMPDIR/kvpilot-e2e")
    args = parser.parse_args(argv)
    state_root = args.state_root or default_state_root()
    if args.cmd == "up":
        cluster = start_cluster(build_binaries(), name=args.name or unique_name("kvpilot"), state_root=state_root)
        print(
            f"cluster {cluster.name} is up; stop it with: python -m e2e.cluster down --name {cluster.name}",
            file=sys.stderr,
        )
        print(cluster.kubeconfig)
        return 0
    bin_dir = Binaries(Path(os.environ.get("KVPILOT_BIN_DIR", ""))) if os.environ.get("KVPILOT_BIN_DIR") else None
    if bin_dir is None:
        bin_dir = build_binaries()
    Cluster(name=args.name, binaries=bin_dir, state_dir=state_root / args.name).delete()
    print(f"cluster {args.name} deleted", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
