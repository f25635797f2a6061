"""Smoke tests of the local control plane itself: real API server, fake GPU nodes, loopback only."""

from __future__ import annotations

import ipaddress
from typing import Any

import pytest

from e2e.cluster import (
    Cluster,
    ClusterError,
    fleet_products,
    is_loopback,
    k8s_version,
    listening_sockets,
    non_loopback_ips,
)
from e2e.polling import poll


def _wait_pod(k8s: Cluster, ns: str, name: str, timeout_s: float = 60.0) -> dict[str, Any]:
    k8s.kubectl(
        "wait", "-n", ns, "--for=condition=Ready", f"pod/{name}", f"--timeout={int(timeout_s)}s", timeout=timeout_s + 10
    )
    pod: dict[str, Any] = k8s.kubectl_json("get", "pod", "-n", ns, name)
    return pod


def _gpu_pod(name: str, ns: str, product: str, gpus: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "nodeSelector": {"nvidia.com/gpu.product": product},
            "containers": [
                {
                    "name": "engine",
                    "image": "kvpilot/engine:never-pulled",
                    "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
                }
            ],
        },
    }


@pytest.fixture()
def namespace(k8s: Cluster, request: pytest.FixtureRequest) -> Any:
    ns = "t-" + request.node.name.lower().replace("_", "-")[:50]
    k8s.kubectl("create", "namespace", ns)
    # the ServiceAccount admission plugin needs the namespace's default ServiceAccount
    poll(
        lambda: k8s.kubectl("get", "serviceaccount", "default", "-n", ns, check=False).returncode == 0,
        30,
        f"the default ServiceAccount in {ns}",
        interval_s=0.2,
    )
    yield ns
    k8s.kubectl("delete", "namespace", ns, "--wait=false")


def test_api_server_answers(k8s: Cluster) -> None:
    assert k8s.kubeconfig.is_file()
    assert k8s.kubectl("get", "--raw", "/readyz").stdout.strip() == "ok"
    version = k8s.kubectl_json("version")
    assert version["serverVersion"]["gitVersion"] == k8s_version() == version["clientVersion"]["gitVersion"]
    # the kubeconfig points at loopback only
    server = k8s.kubectl("config", "view", "--minify", "-o", "jsonpath={.clusters[0].cluster.server}").stdout
    assert server.startswith("https://127.0.0.1:"), server
    # RBAC is on: an unprivileged ServiceAccount may not list nodes
    denied = k8s.kubectl("auth", "can-i", "list", "nodes", "--as=system:serviceaccount:default:default", check=False)
    assert denied.stdout.strip() == "no"


def test_gpu_nodes_ready_with_capacity(k8s: Cluster) -> None:
    nodes = {n["metadata"]["name"]: n for n in k8s.kubectl_json("get", "nodes")["items"]}
    assert len(k8s.nodes) >= 4
    products = set()
    for spec in k8s.nodes:
        node = nodes[spec.name]
        conditions = {c["type"]: c["status"] for c in node["status"]["conditions"]}
        assert conditions.get("Ready") == "True", (spec.name, conditions)
        assert node["status"]["capacity"][spec.resource] == str(spec.gpus)
        assert node["status"]["allocatable"][spec.resource] == str(spec.gpus)
        assert node["metadata"]["labels"][spec.product_label] == spec.product
        products.add(spec.product)
    assert products == fleet_products() and len(products) >= 4


def test_pod_schedules_onto_requested_gpu_with_loopback_ip(k8s: Cluster, namespace: str) -> None:
    by_product = {spec.product: spec for spec in k8s.nodes}
    for i, product in enumerate(["NVIDIA-L4", "NVIDIA-H100-80GB-HBM3"]):
        name = f"engine-{i}"
        k8s.apply(_gpu_pod(name, namespace, product))
        pod = _wait_pod(k8s, namespace, name)
        node = k8s.kubectl_json("get", "node", pod["spec"]["nodeName"])
        assert pod["spec"]["nodeName"] == by_product[product].name
        assert node["metadata"]["labels"]["nvidia.com/gpu.product"] == product
        assert pod["status"]["phase"] == "Running"
        pod_ip = ipaddress.ip_address(pod["status"]["podIP"])
        assert pod_ip.is_loopback, pod_ip
        assert pod_ip in ipaddress.ip_network(node["spec"]["podCIDR"])
        assert is_loopback(pod["status"]["hostIP"])

    wide = k8s.kubectl("get", "pods", "-n", namespace, "-o", "wide").stdout
    print(wide)
    assert wide.count(" 127.1.") == 2, wide

    # the real scheduler enforces GPU capacity: 9 GPUs fit on no node
    k8s.apply(_gpu_pod("too-big", namespace, "NVIDIA-H100-80GB-HBM3", gpus=9))

    def unschedulable() -> dict[str, Any] | None:
        pod = k8s.kubectl_json("get", "pod", "-n", namespace, "too-big")
        conds = {c["type"]: c for c in pod["status"].get("conditions", [])}
        return pod if conds.get("PodScheduled", {}).get("reason") == "Unschedulable" else None

    pod = poll(unschedulable, 30, "pod too-big to be Unschedulable")
    conds = {c["type"]: c for c in pod["status"]["conditions"]}
    assert "nvidia.com/gpu" in conds["PodScheduled"]["message"]
    assert not pod["spec"].get("nodeName")


def test_controller_manager_runs_deployments(k8s: Cluster, namespace: str) -> None:
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "engine", "namespace": namespace},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "engine"}},
            "template": {
                "metadata": {"labels": {"app": "engine"}},
                "spec": _gpu_pod("x", namespace, "NVIDIA-A10G")["spec"],
            },
        },
    }
    k8s.apply(deployment)
    k8s.kubectl("rollout", "status", "-n", namespace, "deployment/engine", "--timeout=60s", timeout=70)
    pods = k8s.kubectl_json("get", "pods", "-n", namespace, "-l", "app=engine")["items"]
    assert len(pods) == 2
    assert {p["spec"]["nodeName"] for p in pods} == {"gpu-a10g-0"}
    pod_ips = {p["status"]["podIP"] for p in pods}
    assert len(pod_ips) == 2

    # A Service gets a loopback ClusterIP, but the API server refuses loopback addresses in
    # EndpointSlices ("may not be in the loopback range"), so a Service over these pods has no
    # endpoints: anything that needs the engines' addresses must read the Pods' status.podIP.
    k8s.apply(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "engine", "namespace": namespace},
            "spec": {"selector": {"app": "engine"}, "ports": [{"port": 8000, "targetPort": 8000}]},
        }
    )
    svc = k8s.kubectl_json("get", "service", "-n", namespace, "engine")
    assert is_loopback(svc["spec"]["clusterIP"])

    def failed_endpoint_slices() -> list[str]:
        events = k8s.kubectl_json(
            "get",
            "events",
            "-n",
            namespace,
            "--field-selector",
            "involvedObject.kind=Service,involvedObject.name=engine",
        )
        return [e["message"] for e in events["items"] if e["reason"] == "FailedToUpdateEndpointSlices"]

    messages = poll(failed_endpoint_slices, 30, "a FailedToUpdateEndpointSlices event for Service engine")
    assert "may not be in the loopback range" in messages[0]
    assert k8s.kubectl_json("get", "endpointslices", "-n", namespace)["items"] == []


def test_nothing_outside_loopback(k8s: Cluster) -> None:
    assert non_loopback_ips(k8s) == []
    pids = k8s.pids()
    assert {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok-controller"} <= set(pids)
    for component, pid in pids.items():
        for ip, port in listening_sockets(pid):
            assert is_loopback(ip), f"{component} (pid {pid}) listens on {ip}:{port}"


def test_kubectl_errors_are_clear(k8s: Cluster) -> None:
    with pytest.raises(ClusterError, match="NotFound|not found"):
        k8s.kubectl("get", "pod", "-n", "default", "does-not-exist")
