"""`make demo` / `make demo-down`: the whole kvpilot path on this machine, left running.

`up` builds (or reuses) the Kubernetes binaries, starts a local control plane with fake GPU nodes,
`helm install`s the chart, runs the chart's operator as a local process under the chart's
ServiceAccount, applies the sample InferenceService for the embedded model, starts its engine
(`kvpilot serve` with the rendered arguments, on the pod's loopback IP), sends it one chat request
and prints how to reach it. Everything it starts is recorded in a state file; `down` stops those
processes by PID, deletes the cluster and removes every file `up` wrote, so the next `up` starts
from nothing (and the operator's kubeconfig is made anew at every start in any case).

    python -m e2e.demo up | down
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from e2e import kvis
from e2e.chart import install
from e2e.cluster import Binaries, Cluster, build_binaries, start_cluster, stop_pids
from e2e.local_engine import key_env, start_engine
from e2e.local_gateway import LocalGateway
from e2e.local_operator import LocalOperator
from e2e.procs import Process

ROOT = Path(os.environ.get("KVPILOT_DEMO_STATE", Path(tempfile.gettempdir()) / "kvpilot-demo"))
STATE_FILE = ROOT / "state.json"
CLUSTER = "kvpilot-demo"
NAMESPACE = "demo"
SAMPLE = "smollm2-135m"
# Under ROOT: the operator's and the gateway's kubeconfigs and logs, the engine's log.
OPERATOR_DIR = "operator"
GATEWAY_DIR = "gateway"
ENGINE_LOG = "engine.log"


def _save(state: dict[str, Any]) -> None:
    ROOT.mkdir(parents=True, exist_ok=True)
    STATE_FILE.write_text(json.dumps(state, indent=2))


def _record(state: dict[str, Any], role: str, process: Process) -> None:
    state["processes"][role] = {"pid": process.pid, "marker": process.marker, "log": str(process.log)}
    _save(state)


def _chat(url: str, model: str, prompt: str, key: str) -> str:
    body = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 32, "temperature": 0}
    ).encode()
    request = urllib.request.Request(  # noqa: S310 - http to an engine on loopback
        f"{url}/v1/chat/completions",
        data=body,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    # No proxy from the environment: the engine is on loopback.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=120) as response:
        return str(json.load(response)["choices"][0]["message"]["content"])


def _clear() -> None:
    """Remove what `up` writes under ROOT besides the cluster's own directory (which
    `Cluster.delete` removes): nothing of one demo may be taken for the next one's."""
    shutil.rmtree(ROOT / OPERATOR_DIR, ignore_errors=True)
    shutil.rmtree(ROOT / GATEWAY_DIR, ignore_errors=True)
    for path in (ROOT / ENGINE_LOG, STATE_FILE):
        path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        ROOT.rmdir()  # only when empty: ROOT may be a directory the user named


def up() -> int:
    if STATE_FILE.exists():
        print(f"a demo is already up (state: {STATE_FILE}); stop it with: make demo-down", file=sys.stderr)
        return 1
    _clear()  # left by a demo stopped some other way
    binaries = build_binaries()
    state: dict[str, Any] = {"cluster": CLUSTER, "bin_dir": str(binaries.bin_dir), "processes": {}}
    _save(state)
    try:
        cluster = start_cluster(binaries, name=CLUSTER, state_root=ROOT)
        installation = install(cluster, [NAMESPACE], values={"gateway": {"replicas": 1}})
        operator = LocalOperator(cluster, installation, ROOT / OPERATOR_DIR)
        _record(state, "operator", operator.start())
        gateway = LocalGateway(cluster, installation, ROOT / GATEWAY_DIR)
        _record(state, "gateway", gateway.start())
        addressed = f"{gateway.url}/namespaces/{NAMESPACE}"

        isvc = kvis.sample(SAMPLE)
        name, model = isvc["metadata"]["name"], isvc["spec"]["model"]["name"]
        isvc["metadata"]["namespace"] = NAMESPACE
        cluster.apply(isvc)
        kvis.wait_condition(cluster, NAMESPACE, name, "Ready", "True", timeout_s=120)
        deployment = cluster.kubectl_json("get", "deployment", name, "-n", NAMESPACE)
        pod = kvis.running_pods(cluster, NAMESPACE, name)[0]
        print(f"starting the engine for pod {pod['metadata']['name']} on {pod['status']['podIP']} ...", file=sys.stderr)
        engine, url = start_engine(deployment, pod, ROOT / ENGINE_LOG, env=key_env(cluster, NAMESPACE, deployment))
        _record(state, "engine", engine)
        # Through the gateway, as a client in the cluster would reach it, with the API key the
        # operator made for the service.
        key = kvis.api_key(cluster, NAMESPACE, name)
        answer = _chat(addressed, model, "In one sentence, what is Kubernetes?", key)
        status = kvis.get(cluster, NAMESPACE, name)["status"]
    except BaseException:
        down()
        raise

    kubectl = f"{cluster.binaries.kubectl} --kubeconfig {cluster.kubeconfig}"
    request = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "Write a haiku about GPUs."}], "max_tokens": 48}
    )
    print(cluster.kubectl("get", "kvis,deploy,svc,pods", "-n", NAMESPACE, "-o", "wide").stdout)
    print(f"""InferenceService {NAMESPACE}/{name}: {status["plan"]["reason"]}
  in-cluster URL  {status["url"]}
  gateway         {addressed}/v1  (`kvpilot gateway`: routes by namespace and model,
                  wakes services the autoscaler scaled to 0; log {state["processes"]["gateway"]["log"]})
  engine          {url}/v1  (kvpilot serve on the pod's loopback IP; log {engine.log})
  operator        pid {state["processes"]["operator"]["pid"]}, log {state["processes"]["operator"]["log"]}
  first answer    {answer!r}

Try it (the API key is in the Secret {name}-api-key):
  KEY=$({kubectl} get secret {name}-api-key -n {NAMESPACE} -o jsonpath='{{.data.api-key}}' | base64 -d)
  curl -s {addressed}/v1/chat/completions -H "Authorization: Bearer $KEY" \\
    -H 'Content-Type: application/json' -d '{request}'
  {kubectl} get kvis -A -o wide
  {kubectl} get kvis {name} -n {NAMESPACE} -o yaml

Stop everything: make demo-down""")
    return 0


def down() -> int:
    if not STATE_FILE.exists():
        print("no demo is up", file=sys.stderr)
        return 0
    state = json.loads(STATE_FILE.read_text())
    alive: dict[str, int] = {}
    for role, process in state["processes"].items():
        alive.update(stop_pids({role: process["pid"]}, marker=process["marker"], grace_s=30.0))
    Cluster(
        name=state["cluster"], binaries=Binaries(Path(state["bin_dir"])), state_dir=ROOT / state["cluster"]
    ).delete()
    if alive:
        print(f"still alive after SIGKILL: {alive}", file=sys.stderr)
        return 1
    _clear()
    print(
        f"demo stopped: {', '.join(state['processes']) or 'no processes'} and cluster {state['cluster']}",
        file=sys.stderr,
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.demo", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["up", "down"])
    return up() if parser.parse_args(argv).command == "up" else down()


if __name__ == "__main__":
    raise SystemExit(main())
