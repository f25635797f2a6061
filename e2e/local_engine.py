"""A real `kvpilot serve` standing behind a kwok-simulated engine pod.

kwok gives the pod a loopback IP (e.g. 127.1.2.1) but runs nothing; this starts the engine the
operator rendered into the Deployment, with exactly its arguments, bound to that IP. Substitutions
only: `--host` becomes the pod IP (the pod's 0.0.0.0); given a folder for the pod's volumes, a path
under a container's volume mount becomes the same path under that folder (`PodVolumes`), so the init
containers (an hf:// download) really fill what the engine then loads; and `--model` becomes the
embedded model when the rendered one is a model this machine does not have (a catalog name, not
an absolute path that exists here).
"""

from __future__ import annotations

import base64
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from e2e.cluster import Cluster
from e2e.procs import Process, kvpilot_executable, start_http
from kvpilot.operator.api.names import CONTAINER
from kvpilot.operator.controller.render import Manifest
from kvpilot.operator.runtimes import RUNTIMES


@dataclass(frozen=True)
class PodVolumes:
    """One pod's volumes as folders here: volume `v` is `root/v`, whichever container mounts it
    (emptyDir and PVC alike; the folder outlives a restarted container, as a PVC does). This
    machine's own files stand for the image's."""

    root: Path

    def path(self, container: Manifest, value: str) -> str:
        """`value` with a prefix that is one of `container`'s mount paths moved under `root`, unless
        it names a file of the image (one that exists here, such as a model under /tmp that a test
        put there: a real pod's emptyDir would hide it, this stand-in does not)."""
        if Path(value).is_absolute() and Path(value).exists():
            return value
        for mount in sorted(container.get("volumeMounts", []), key=lambda m: -len(m["mountPath"])):
            mount_path = mount["mountPath"].rstrip("/")
            if value == mount_path or value.startswith(f"{mount_path}/"):
                return str(self.root / mount["name"]) + value[len(mount_path) :]
        return value

    def run_init_containers(
        self, cluster: Cluster, namespace: str, deployment: Manifest, log: Path, timeout_s: float = 600.0
    ) -> None:
        """Each init container of the pod template to completion, in order, with its env (values
        and Secret keys) over this process's; a failing one raises with its output."""
        template = deployment["spec"]["template"]["spec"]
        for volume in template.get("volumes", []):
            (self.root / volume["name"]).mkdir(parents=True, exist_ok=True)
        for container in template.get("initContainers", []):
            env = {
                **os.environ,
                **{
                    e["name"]: self.path(container, _env_value(cluster, namespace, e)) for e in container.get("env", [])
                },
            }
            done = subprocess.run(
                container_argv(container, self), env=env, capture_output=True, text=True, timeout=timeout_s, check=False
            )
            with log.open("a") as out:
                out.write(done.stdout + done.stderr)
            if done.returncode != 0:
                raise RuntimeError(
                    f"init container {container['name']} exited with {done.returncode}:\n{done.stderr[-4000:]}"
                )


def container_argv(container: Manifest, volumes: PodVolumes | None = None) -> list[str]:
    """The container's command line, its `kvpilot` the one installed here, its paths moved under
    `volumes` when given."""
    command = container["command"]
    if command[0] != "kvpilot":
        raise ValueError(f"unexpected command {command} in container {container['name']}")
    args = container.get("args", [])
    return [kvpilot_executable(), *command[1:], *(volumes.path(container, a) if volumes else a for a in args)]


def _env_value(cluster: Cluster, namespace: str, entry: Manifest) -> str:
    if "value" in entry:
        return str(entry["value"])
    ref = entry["valueFrom"]["secretKeyRef"]
    secret = cluster.kubectl_json("get", "secret", ref["name"], "-n", namespace)
    return base64.b64decode(secret["data"][ref["key"]]).decode()


def _engine_container(deployment: Manifest) -> Manifest:
    found: Manifest = next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == CONTAINER)
    return found


def key_env(cluster: Cluster, namespace: str, deployment: Manifest) -> dict[str, str]:
    """The engine container's API-key variable, resolved from its Secret as the kubelet would: the
    engine here then requires the key the operator made. Only that variable: the rest of the pod's
    env (HOME=/tmp, say) would move this machine's model cache."""
    container = _engine_container(deployment)
    keys = {runtime.api_key_env for runtime in RUNTIMES.values()}
    return {e["name"]: _env_value(cluster, namespace, e) for e in container.get("env", []) if e["name"] in keys}


def _set_flag(args: list[str], flag: str, value: str) -> None:
    args[args.index(flag) + 1] = value


def _flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def grace_period_s(deployment: Manifest) -> float:
    """The engine's rendered drain: how long it waits for streams in flight after SIGTERM."""
    return float(_flag(container_argv(_engine_container(deployment)), "--grace-period"))


def engine_argv(deployment: Manifest, pod_ip: str, volumes: PodVolumes | None = None) -> list[str]:
    """The engine container's command line for the pod at `pod_ip`, its volumes under `volumes` when
    given (else the rendered paths, as a model baked into the image would be)."""
    # Imported here: the engine's model loader pulls in torch, which only this path needs.
    from kvpilot.engine.contract.config import EMBEDDED_MODEL

    container = _engine_container(deployment)
    argv = container_argv(container, volumes)
    _set_flag(argv, "--host", pod_ip)
    model = _flag(argv, "--model")
    # A path that exists here (a model "baked into the image", or a pod volume's) is used as it is.
    if model.lower() != EMBEDDED_MODEL.lower() and not (Path(model).is_absolute() and Path(model).exists()):
        _set_flag(argv, "--model", EMBEDDED_MODEL)
    return argv


def base_url(argv: list[str]) -> str:
    """http://<host>:<port> of an engine command line."""
    return f"http://{_flag(argv, '--host')}:{_flag(argv, '--port')}"


def start_engine(
    deployment: Manifest,
    pod: Manifest,
    log: Path,
    volumes: PodVolumes | None = None,
    ready_timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
) -> tuple[Process, str]:
    """Start the engine for `pod` (its volumes under `volumes` when given, `env` over this
    process's: key_env) and wait until it serves /ready; return it and its base URL."""
    argv = engine_argv(deployment, pod["status"]["podIP"], volumes)
    url = base_url(argv)
    process = start_http(
        argv, log, f"{url}/ready", ready_timeout_s, {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    )
    return process, url
