"""The images `make images` builds (e2e/images.sh), and their containers run as a kubelet runs a pod's.

`build_images()` runs the script (it builds what changed, else returns in seconds) and returns the
images' names with the storage flags podman needs. `container_argv` turns a container of a rendered
pod spec into a `podman run` command line: its command, args and env (Secret keys resolved from a
mapping), the pod's and the container's securityContext (uid/gid, fsGroup, read-only root, dropped
capabilities, no privilege escalation), its volumes (an emptyDir, a claim: a folder of this machine
the pod's group can write, as the kubelet's fsGroup makes it; a memory emptyDir: a tmpfs; an image
volume: podman's image mount), and no service-account token where the pod says so. It runs on the
host's network, so a server binds a loopback address of this machine (the caller moves
`--host`/`--listen` there), runc as the runtime (crun fails on this sandbox's cgroup layout) with
ulimits at the shell's (no CAP_SYS_RESOURCE here); CPU and memory limits are not applied (no cgroup
delegation here).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from e2e.procs import Process, start_http

SCRIPT = Path(__file__).with_name("images.sh")
# Every `podman run` here: runc (crun fails on this sandbox's cgroup layout), and ulimits at or
# below this machine's (podman may not raise them without CAP_SYS_RESOURCE).
RUN_OPTIONS = ["--pull=never", "--runtime=runc", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=4096:4096"]
# How long a container must stay up after it first answers (start_container).
SETTLE_S = 2.0
# Where a Pod's service-account token would be: nothing may be there when the pod opts out.
TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"

Manifest = dict[str, Any]


@dataclass(frozen=True)
class Images:
    engine: str
    operator: str
    base: str
    storage: tuple[str, ...]

    def podman(self, *args: str) -> list[str]:
        return ["podman", *self.storage, *args]

    def run(self, *args: str, check: bool = True, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.podman(*args), capture_output=True, text=True, check=check, timeout=timeout_s)

    def size(self, image: str) -> int:
        """The image's size in bytes, all layers unpacked."""
        return int(self.run("image", "inspect", "--format", "{{.Size}}", image).stdout)

    def layers(self, image: str) -> list[tuple[int, str]]:
        """(bytes, the step that made it) of each layer, newest first (`podman history`)."""
        rows = json.loads(self.run("history", "--format", "json", image).stdout)
        return [(int(row["size"]), str(row["CreatedBy"])) for row in rows]


def build_images(timeout_s: float = 3000) -> Images:
    """Build (or reuse from the layer cache) the base, engine and operator images; fail with the
    script's output when it fails."""
    # This interpreter's pip fills the wheelhouse: a python3.11 on PATH may have none.
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, timeout=timeout_s, check=False, env=env
    )
    if done.returncode != 0:
        raise RuntimeError(f"{SCRIPT} failed ({done.returncode}):\n{done.stderr[-6000:]}")
    found = json.loads(done.stdout.strip().splitlines()[-1])
    # By ID: a run from another checkout may move the tags while this one's tests run.
    return Images(found["engine_id"], found["operator_id"], found["base"], tuple(found["storage"]))


def _security(pod: Manifest, container: Manifest) -> list[str]:
    pod_ctx, ctx = pod.get("securityContext", {}), container.get("securityContext", {})
    uid = ctx.get("runAsUser", pod_ctx.get("runAsUser"))
    gid = ctx.get("runAsGroup", pod_ctx.get("runAsGroup", uid))
    if uid is None:
        raise ValueError("no runAsUser: the image's USER would decide who runs it, which a test cannot check")
    if (ctx.get("runAsNonRoot") or pod_ctx.get("runAsNonRoot")) and uid == 0:
        raise ValueError("runAsNonRoot with runAsUser 0: the kubelet refuses to start it")
    argv = ["--user", f"{uid}:{gid}"]
    if "fsGroup" in pod_ctx:
        argv += ["--group-add", str(pod_ctx["fsGroup"])]
    if ctx.get("readOnlyRootFilesystem"):
        # Only the pod's volumes are writable: no tmpfs of podman's own on /tmp, /run, /var/tmp.
        argv += ["--read-only", "--read-only-tmpfs=false"]
    caps = ctx.get("capabilities", {})
    argv += [f"--cap-drop={cap}" for cap in caps.get("drop", [])] + [f"--cap-add={cap}" for cap in caps.get("add", [])]
    if ctx.get("allowPrivilegeEscalation") is False:
        argv += ["--security-opt", "no-new-privileges"]
    return argv


def _volume_dir(root: Path, volume: Manifest, fs_group: int | None) -> Path:
    """A pod volume's folder here, as the kubelet leaves it: an emptyDir world-writable (0777), a
    claim root's; with an fsGroup, the group's and group-writable, setgid."""
    name = volume["persistentVolumeClaim"]["claimName"] if "persistentVolumeClaim" in volume else volume["name"]
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    mode = 0o777 if "emptyDir" in volume else 0o755
    if fs_group is not None:
        os.chown(folder, -1, fs_group)
        mode |= 0o2770
    folder.chmod(mode)
    return folder


def _mounts(pod: Manifest, container: Manifest, root: Path) -> list[str]:
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    fs_group = pod.get("securityContext", {}).get("fsGroup")
    argv = []
    for mount in container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        read_only = mount.get("readOnly") or volume.get("persistentVolumeClaim", {}).get("readOnly")
        if volume.get("emptyDir", {}).get("medium") == "Memory":
            size = volume["emptyDir"].get("sizeLimit", "64Mi").replace("i", "")
            argv += ["--tmpfs", f"{mount['mountPath']}:rw,size={size.lower()},mode=1777"]
            continue
        if "image" in volume:
            # An image volume: the image's files, read-only (the kubelet mounts it so whatever the mount says).
            argv += ["--mount", f"type=image,source={volume['image']['reference']},destination={mount['mountPath']}"]
            continue
        if "emptyDir" not in volume and "persistentVolumeClaim" not in volume:
            raise ValueError(f"volume {mount['name']}: only emptyDir, persistentVolumeClaim and image are mapped here")
        source = _volume_dir(root, volume, fs_group)
        if mount.get("subPath"):
            # A missing subPath the kubelet creates as root (render.py's compile-cache init container).
            source = source / mount["subPath"]
            source.mkdir(mode=0o755, exist_ok=True)
        argv += ["--volume", f"{source}:{mount['mountPath']}:{'ro' if read_only else 'rw'}"]
    return argv


def _env(container: Manifest, secrets: Mapping[tuple[str, str], str], field_refs: Mapping[str, str]) -> list[str]:
    """The container's env: values, Secret keys from `secrets`, the downward API from `field_refs`."""
    argv = []
    for entry in container.get("env", []):
        source = entry.get("valueFrom", {})
        if "value" in entry:
            value = str(entry["value"])
        elif "secretKeyRef" in source:
            value = secrets[(source["secretKeyRef"]["name"], source["secretKeyRef"]["key"])]
        else:
            value = field_refs[source["fieldRef"]["fieldPath"]]
        argv += ["--env", f"{entry['name']}={value}"]
    return argv


def container_argv(
    images: Images,
    pod: Manifest,
    container: Manifest,
    *,
    name: str,
    volumes_root: Path,
    args: Sequence[str] | None = None,
    secrets: Mapping[tuple[str, str], str] | None = None,
    field_refs: Mapping[str, str] | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """`podman run` of `container` of the pod spec `pod` (its args, or `args`), as container `name`;
    `extra`: podman's options for what a kubelet would add (a kubeconfig in place of a token)."""
    if pod.get("automountServiceAccountToken", True):
        raise ValueError("the pod mounts a service-account token: give the container a kubeconfig instead")
    command = container.get("command")
    return images.podman(
        "run",
        "--rm",
        "--name",
        name,
        *RUN_OPTIONS,
        "--network=host",
        *_security(pod, container),
        *_mounts(pod, container, volumes_root),
        *_env(container, secrets or {}, field_refs or {}),
        *([f"--entrypoint={json.dumps(command)}"] if command else []),
        *extra,
        container["image"],
        *(container.get("args", []) if args is None else args),
    )


@dataclass
class Container:
    """A container started by `podman run` in the foreground: stopping the podman process stops the
    container (podman passes SIGTERM on) and `remove` makes sure it is gone."""

    images: Images
    name: str
    process: Process

    def exec(self, *argv: str, check: bool = False) -> subprocess.CompletedProcess[str]:
        return self.images.run("exec", self.name, *argv, check=check)

    def stop(self, grace_s: float = 30.0) -> int:
        code = self.process.stop(grace_s)
        self.remove()
        return code

    def remove(self) -> None:
        self.images.run("rm", "--force", "--ignore", "--time", "5", self.name, check=False)


def start_container(
    argv: list[str], name: str, images: Images, log: Path, ready_url: str, timeout_s: float
) -> Container:
    """Run `argv` (a `podman run` from container_argv) until `ready_url` answers 200."""
    try:
        process = start_http(argv, log, ready_url, timeout_s)
        # Still running a moment later: another run's server on the same loopback address (two e2e
        # runs on one machine get the same kwok pod IPs) answers for a container that could not bind.
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.popen.wait(timeout=SETTLE_S)
        process.raise_if_exited()
    except BaseException:
        images.run("rm", "--force", "--ignore", name, check=False)
        raise
    return Container(images, name, process)
