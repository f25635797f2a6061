"""Real engines behind kwok's pods, following the Deployment as it scales.

kwok runs no containers: a pod of an engine Deployment is Running with a loopback IP and nothing
behind it. A `PodRunner` watches one InferenceService's engine pods and, for every Running pod,
starts a real `kvpilot serve` with the Deployment's rendered arguments on the pod's IP
(local_engine.engine_argv) and the API key of the pod's Secret (local_engine.key_env); when the pod
goes away (deleted, scaled down, no longer Running) it stops that engine by its PID. Scaling the
Deployment therefore really adds and removes engines, and the operator's autoscaler reads real
/metrics from the pod IPs it knows.

Every engine gets OMP_NUM_THREADS=1: a pod requests its own cores, and here the engines of all
pods share the machine's two.

A mixed pool's pods (several GPU types) belong to one Deployment per type: each pod's engine runs
its own type's Deployment's arguments (`<name>-<variant label>`), so the runner follows them all.

kwok now and then hands two pods created together the same IP (measured: a CI run where two
replicas of one Deployment both got 127.1.2.1, so the second engine could not bind and the first
answered for both pods). No real cluster does that, and every test here addresses engines by pod
IP, so the runner deletes the later pod of such a pair (its ReplicaSet makes another, with an IP of
its own) instead of running a second engine on a taken address; `duplicates` counts them. A pod whose
engine a test broke still holds its address (measured: a CI run where a new pod got the broken pod's
IP, its engine answered the broken pod's /metrics, and the autoscaler saw no unknown pod).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from e2e import kvis
from e2e.cluster import Cluster
from e2e.local_engine import base_url, engine_argv, key_env
from e2e.polling import Background
from e2e.procs import Process, http_ok, start
from kvpilot.operator.api.names import VARIANT_LABEL


@dataclass
class Engine:
    pod: str
    ip: str
    url: str
    process: Process
    ready: bool = False


class PodRunner(Background):
    """Engines for the Running pods of `namespace/name`'s Deployment, kept in step every `poll_s`.
    Use as a context manager: leaving it stops every engine it started."""

    def __init__(self, cluster: Cluster, namespace: str, name: str, log_dir: Path, poll_s: float = 1.0) -> None:
        super().__init__(f"pod-runner-{name}")
        self.cluster, self.namespace, self.name = cluster, namespace, name
        self.log_dir, self.poll_s = log_dir, poll_s
        self._engines: dict[str, Engine] = {}
        # Pods whose engine was stopped on purpose (a test breaking one): not restarted.
        self._left_alone: set[str] = set()
        self._lock = threading.Lock()
        self.errors: list[str] = []
        self.last_error: str | None = None
        self.started = 0
        self.stopped = 0
        self.duplicates: list[str] = []  # pods deleted for an IP another pod already had
        # A slow-loading engine: a pod's engine starts this long after the pod is first seen
        # Running (a test sets it; kwok's pod is Running at once, a real image pulls and loads).
        self.start_delay_s = 0.0
        self._first_seen: dict[str, float] = {}

    def close(self) -> None:
        with self._lock:
            engines, self._engines = list(self._engines.values()), {}
        for engine in engines:
            self._stop_engine(engine)

    def serving(self) -> dict[str, str]:
        """Pod name -> base URL of the engines that answer /ready now."""
        with self._lock:
            return {e.pod: e.url for e in self._engines.values() if e.ready}

    def engines(self) -> dict[str, Engine]:
        with self._lock:
            return dict(self._engines)

    def break_engine(self, pod: str) -> None:
        """Stop `pod`'s engine and leave the pod Running without one: its /metrics (and all else)
        are refused from now on, as for an engine that hangs or crashes under its pod."""
        with self._lock:
            engine = self._engines.pop(pod)
            self._left_alone.add(pod)
        self._stop_engine(engine)

    def _start_engine(self, deployment: dict[str, Any], pod: str, ip: str) -> Engine:
        argv = engine_argv(deployment, ip)
        env = {
            **self.cluster.env(),
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            **key_env(self.cluster, self.namespace, deployment),
        }
        process = start(argv, self.log_dir / f"engine-{pod}.log", env)
        self.started += 1
        return Engine(pod=pod, ip=ip, url=base_url(argv), process=process)

    def _stop_engine(self, engine: Engine) -> None:
        code = engine.process.stop()
        self.stopped += 1
        if code not in (0, -15):
            self.errors.append(f"engine of {engine.pod} exited with {code}:\n{engine.process.log_tail()}")

    def _deployment(self, pod: dict[str, Any]) -> str:
        """The name of `pod`'s Deployment: the service's, or its GPU type's in a mixed pool."""
        variant = (pod["metadata"].get("labels") or {}).get(VARIANT_LABEL)
        return f"{self.name}-{variant}" if variant else self.name

    def _sync(self) -> None:
        pods = {p["metadata"]["name"]: p for p in kvis.running_pods(self.cluster, self.namespace, self.name)}
        running = {pod: p["status"]["podIP"] for pod, p in pods.items()}
        with self._lock:
            gone = [e for pod, e in self._engines.items() if pod not in running]
            for engine in gone:
                del self._engines[engine.pod]
            now = time.monotonic()
            self._first_seen = {pod: self._first_seen.get(pod, now) for pod in running}
            new = [
                (pod, ip)
                for pod, ip in running.items()
                if pod not in self._engines
                and pod not in self._left_alone
                and now - self._first_seen[pod] >= self.start_delay_s
            ]
        for engine in gone:
            self._stop_engine(engine)
        deployments = {
            name: self.cluster.kubectl_json("get", "deployment", name, "-n", self.namespace)
            for name in {self._deployment(pods[pod]) for pod, _ in new}
        }
        with self._lock:
            # A broken pod's address is still its own: an engine started there would answer for it.
            taken = {e.ip for e in self._engines.values()} | {running[p] for p in self._left_alone if p in running}
        for pod, ip in new:
            if ip in taken:
                if pod not in self.duplicates:
                    self.cluster.kubectl("delete", "pod", pod, "-n", self.namespace, "--wait=false", check=False)
                    self.duplicates.append(pod)
                continue
            taken.add(ip)
            engine = self._start_engine(deployments[self._deployment(pods[pod])], pod, ip)
            with self._lock:
                self._engines[pod] = engine
        with self._lock:
            starting = [e for e in self._engines.values() if not e.ready]
        for engine in starting:
            if not engine.process.alive():
                self.errors.append(f"engine of {engine.pod} exited:\n{engine.process.log_tail()}")
                with self._lock:
                    self._engines.pop(engine.pod, None)
                    self._left_alone.add(engine.pod)
            elif http_ok(f"{engine.url}/ready", timeout_s=1.0):
                engine.ready = True

    def loop(self) -> None:
        while not self.stopping.is_set():
            try:
                self._sync()
            except Exception as error:  # noqa: BLE001 - a failed kubectl read: the next poll tries again
                self.last_error = repr(error)
            self.stopping.wait(self.poll_s)

    def snapshot(self) -> dict[str, Any]:
        """What the runner holds, for a failing test's message."""
        with self._lock:
            return {
                "engines": {
                    p: {"url": e.url, "ready": e.ready, "pid": e.process.pid} for p, e in self._engines.items()
                },
                "left_alone": sorted(self._left_alone),
                "duplicates": list(self.duplicates),
                "last_error": self.last_error,
                "started": self.started,
                "stopped": self.stopped,
                "errors": self.errors,
            }
