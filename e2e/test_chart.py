"""Scenario 1: the Helm chart lints, renders, and installs the CRDs, the operator and its RBAC."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.chart import CHART_DIR, CRD, Installation
from e2e.cluster import Binaries, Cluster
from kvpilot.operator import cli
from kvpilot.operator.api import names
from kvpilot.operator.controller import render
from kvpilot.operator.controller.handlers import ENGINE_IMAGE_ENV

REPO_CRDS = CHART_DIR.parent.parent / "crds"
# The gateway's own objects (e2e/test_gateway_chart.py checks them).
GATEWAY_KINDS = [("Deployment", "ops"), ("ServiceAccount", "ops"), ("ClusterRole", ""), ("ClusterRoleBinding", "")]
# Rendered whatever the namespaces watched: the CRD, the operator's Service, ServiceAccount and
# Deployment, and the gateway's objects.
ALWAYS_KINDS = [
    ("CustomResourceDefinition", ""),
    ("Service", "ops"),
    *GATEWAY_KINDS,
    ("ServiceAccount", "ops"),
    ("Deployment", "ops"),
    # The operator reads CPU device profiles from ConfigMaps of its own namespace.
    ("Role", "ops"),
    ("RoleBinding", "ops"),
]


def _helm(binaries: Binaries, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        "HELM_CACHE_HOME": str(tmp_path / "cache"),
        "HELM_CONFIG_HOME": str(tmp_path / "config"),
        "HELM_DATA_HOME": str(tmp_path / "data"),
        "PATH": "/usr/bin:/bin",
    }
    return subprocess.run([str(binaries.helm), *args], capture_output=True, text=True, env=env, check=True, timeout=60)


def _docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


@pytest.mark.parametrize(
    "values", [[], ["--set", "watchNamespaces={ml,prod}"]], ids=["all-namespaces", "two-namespaces"]
)
def test_chart_lints_and_renders(k8s_binaries: Binaries, tmp_path: Path, values: list[str]) -> None:
    lint = _helm(k8s_binaries, tmp_path, "lint", "--strict", str(CHART_DIR), *values)
    assert "1 chart(s) linted, 0 chart(s) failed" in lint.stdout
    rendered = _template(k8s_binaries, tmp_path, *values)
    kinds = sorted((d["kind"], d["metadata"].get("namespace", "")) for d in rendered)
    operator = next(d for d in rendered if d["kind"] == "Deployment")
    args = operator["spec"]["template"]["spec"]["containers"][0]["args"]
    if values:
        per_namespace = [(kind, ns) for ns in ("ml", "prod") for kind in ("Role", "RoleBinding", "KopfPeering")]
        # And in the release namespace: watching the gateway pods (their held queues).
        gateway_pods = [("Role", "ops"), ("RoleBinding", "ops")]
        assert kinds == sorted(
            [*ALWAYS_KINDS, ("ClusterRole", ""), ("ClusterRoleBinding", ""), *per_namespace, *gateway_pods]
        )
        assert args[:3] == ["operator", "--namespace=ml", "--namespace=prod"]
    else:
        cluster_wide = [("ClusterRole", ""), ("ClusterRoleBinding", "")] * 2 + [("ClusterKopfPeering", "")]
        assert kinds == sorted([*ALWAYS_KINDS, *cluster_wide])
        assert args[:2] == ["operator", "--all-namespaces"]
    assert "--peering=kvpilot" in args
    assert "--autoscale-interval=15" in args
    # The gateway is its own Deployment; the operator only watches its pods for their held queues.
    assert [a for a in args if a.startswith("--gateway")] == [
        "--gateway-pods=ops:app.kubernetes.io/name=kvpilot-gateway,app.kubernetes.io/instance=kvpilot"
    ]


def test_the_gateway_can_be_left_out(k8s_binaries: Binaries, tmp_path: Path) -> None:
    rendered = _template(k8s_binaries, tmp_path, "--set", "gateway.enabled=false")
    assert not [d for d in rendered if "gateway" in d["metadata"]["name"]]
    operator = next(d for d in rendered if d["kind"] == "Deployment")
    (container,) = operator["spec"]["template"]["spec"]["containers"]
    assert [p["name"] for p in container["ports"]] == ["healthz", "metrics"]


def test_gpu_prices_reach_the_operator_as_its_own_flags(k8s_binaries: Binaries, tmp_path: Path) -> None:
    values = tmp_path / "prices.yaml"
    values.write_text("gpuPrices:\n  L4: 0.45\n  H100-80GB: 4.2\n")
    operator = next(d for d in _template(k8s_binaries, tmp_path, "-f", str(values)) if d["kind"] == "Deployment")
    args = operator["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith("--gpu-price")] == ["--gpu-price=H100-80GB=4.2", "--gpu-price=L4=0.45"]
    # What `kvpilot operator` parses them into: the prices the reconcile ranks a mixed pool by.
    top = argparse.ArgumentParser(prog="kvpilot")
    cli.register(top.add_subparsers(dest="command", required=True))
    assert dict(top.parse_args(args).gpu_price) == {"H100-80GB": 4.2, "L4": 0.45}
    with pytest.raises(subprocess.CalledProcessError) as refused:
        _template(k8s_binaries, tmp_path, "--set-json", 'gpuPrices={"L4": -1}')
    assert "gpuPrices" in refused.value.stderr


def test_capacity_classes_reach_the_operator_as_its_own_flags(k8s_binaries: Binaries, tmp_path: Path) -> None:
    values = tmp_path / "classes.yaml"
    values.write_text(
        "gpuPrices: {L4: 0.45}\n"
        "capacityClasses:\n"
        "  spot:\n"
        "    nodeSelector: {karpenter.sh/capacity-type: spot, example.com/pool: gpu}\n"
        "    gpuPrices: {L4: 0.2, H100-80GB: 2.1}\n"
        "  on-demand:\n"
        "    nodeSelector: {karpenter.sh/capacity-type: on-demand}\n"
    )
    operator = next(d for d in _template(k8s_binaries, tmp_path, "-f", str(values)) if d["kind"] == "Deployment")
    args = operator["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith(("--capacity-class", "--gpu-price"))] == [
        "--gpu-price=L4=0.45",
        "--capacity-class=on-demand=karpenter.sh/capacity-type=on-demand",
        "--capacity-class=spot=example.com/pool=gpu,karpenter.sh/capacity-type=spot",
        "--gpu-price=H100-80GB@spot=2.1",
        "--gpu-price=L4@spot=0.2",
    ]
    # What `kvpilot operator` makes of them: each class's node labels, and its own prices beside the types'.
    top = argparse.ArgumentParser(prog="kvpilot")
    cli.register(top.add_subparsers(dest="command", required=True))
    prices, classes = cli.pool_settings(top.parse_args(args))
    assert classes == {
        "spot": {"karpenter.sh/capacity-type": "spot", "example.com/pool": "gpu"},
        "on-demand": {"karpenter.sh/capacity-type": "on-demand"},
    }
    assert prices == {"L4": 0.45, "L4@spot": 0.2, "H100-80GB@spot": 2.1}
    # A class without node labels would select every node: the chart refuses it, and a class name no label takes.
    for bad in (
        'capacityClasses={"spot": {"gpuPrices": {"L4": 0.2}}}',
        'capacityClasses={"Spot!": {"nodeSelector": {"a": "b"}}}',
    ):
        with pytest.raises(subprocess.CalledProcessError) as refused:
            _template(k8s_binaries, tmp_path, "--set-json", bad)
        assert "capacityClasses" in refused.value.stderr


def _template(binaries: Binaries, tmp_path: Path, *values: str) -> list[dict[str, Any]]:
    return _docs(_helm(binaries, tmp_path, "template", "kvpilot", str(CHART_DIR), "-n", "ops", *values).stdout)


def _operator_env(rendered: list[dict[str, Any]]) -> dict[str, str]:
    operator = next(d for d in rendered if d["kind"] == "Deployment")
    (container,) = operator["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value") or e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]}


def test_engine_image_value_reaches_the_operator(k8s_binaries: Binaries, tmp_path: Path) -> None:
    app_version = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())["appVersion"]
    default = _operator_env(_template(k8s_binaries, tmp_path))
    assert default[ENGINE_IMAGE_ENV] == f"ghcr.io/kvpilot/kvpilot:{app_version}" == render.DEFAULT_ENGINE_IMAGE
    chosen = _operator_env(_template(k8s_binaries, tmp_path, "--set", "engine.image=mirror.example/kvpilot:1.2.3"))
    assert chosen[ENGINE_IMAGE_ENV] == "mirror.example/kvpilot:1.2.3"
    # The operator learns its namespace from its pod (the engines' NetworkPolicies let it in).
    assert default[names.OPERATOR_NAMESPACE_ENV] == "metadata.namespace"


@pytest.mark.parametrize(
    "values, namespaces",
    [([], {"any": True}), (["--set", "watchNamespaces={ml,prod}"], {"matchNames": ["ml", "prod"]})],
    ids=["all-namespaces", "two-namespaces"],
)
def test_service_monitor_scrapes_the_engine_services(
    k8s_binaries: Binaries, tmp_path: Path, values: list[str], namespaces: dict[str, Any]
) -> None:
    enabled = [
        "--set",
        "serviceMonitor.enabled=true",
        "--set",
        "serviceMonitor.interval=15s",
        "--set",
        "serviceMonitor.labels.release=prom",
        *values,
    ]
    lint = _helm(k8s_binaries, tmp_path, "lint", "--strict", str(CHART_DIR), *enabled)
    assert "1 chart(s) linted, 0 chart(s) failed" in lint.stdout
    rendered = _template(k8s_binaries, tmp_path, *enabled)
    (monitor,) = [d for d in rendered if d["kind"] == "ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["namespace"] == "ops" and monitor["metadata"]["labels"]["release"] == "prom"
    spec = monitor["spec"]
    assert spec["namespaceSelector"] == namespaces
    assert spec["endpoints"] == [{"port": names.PORT_NAME, "path": "/metrics", "interval": "15s"}]
    # It selects every engine Service the operator renders, and nothing of the operator's own.
    selector = spec["selector"]["matchLabels"]
    for name in ("chat", "llama-3-8b"):
        service = render.service(name, "ml", "uid")
        assert selector.items() <= service["metadata"]["labels"].items()
        assert service["spec"]["ports"][0]["name"] == names.PORT_NAME
    operator = next(d for d in rendered if d["kind"] == "Deployment")
    assert not selector.items() <= operator["metadata"]["labels"].items()

    # The operator's own /metrics: a PodMonitor of its pods' `metrics` port.
    (pods,) = [d for d in rendered if d["kind"] == "PodMonitor" and d["metadata"]["name"].endswith("-operator")]
    template_labels = operator["spec"]["template"]["metadata"]["labels"]
    assert pods["spec"]["selector"]["matchLabels"].items() <= template_labels.items()
    (container,) = operator["spec"]["template"]["spec"]["containers"]
    assert pods["spec"]["podMetricsEndpoints"][0]["port"] in [p["name"] for p in container["ports"]]

    # And the gateways', whose series name the InferenceService too (honorLabels).
    (gateway_pods,) = [d for d in rendered if d["kind"] == "PodMonitor" and d["metadata"]["name"].endswith("-gateway")]
    gateway = next(d for d in rendered if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-gateway"))
    assert gateway_pods["spec"]["selector"]["matchLabels"] == gateway["spec"]["selector"]["matchLabels"]
    assert all(
        e["honorLabels"] for d in rendered if d["kind"] == "PodMonitor" for e in d["spec"]["podMetricsEndpoints"]
    )

    disabled = _template(k8s_binaries, tmp_path, *values)
    assert [d for d in disabled if d["kind"] in ("ServiceMonitor", "PodMonitor")] == []


def test_chart_crds_are_the_repository_crds(k8s_binaries: Binaries, tmp_path: Path) -> None:
    # One source: the chart's CRD files are links to the repository's crds/. kopf's peering CRDs ship
    # in crds/ (installed before the templates, which create peering objects); the InferenceService
    # CRD is a template, so `helm upgrade` upgrades it, and Helm keeps it on uninstall.
    assert (CHART_DIR / "crds" / "kopf-peering.yaml").resolve() == (REPO_CRDS / "kopf-peering.yaml").resolve()
    assert (CHART_DIR / "files" / "inferenceservice.yaml").resolve() == (REPO_CRDS / "inferenceservice.yaml").resolve()
    out = _helm(k8s_binaries, tmp_path, "template", "kvpilot", str(CHART_DIR), "--include-crds").stdout
    shipped = {d["metadata"]["name"]: d for d in _docs(out) if d["kind"] == "CustomResourceDefinition"}
    repo = {d["metadata"]["name"]: d for f in sorted(REPO_CRDS.glob("*.yaml")) for d in _docs(f.read_text())}
    assert set(shipped) == set(repo) == {CRD, "kopfpeerings.kopf.dev", "clusterkopfpeerings.kopf.dev"}
    for name, crd in repo.items():
        assert shipped[name]["spec"] == crd["spec"], name
    assert shipped[CRD]["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


def test_helm_upgrade_upgrades_the_inference_service_crd(k8s: Cluster, kvpilot: Installation, tmp_path: Path) -> None:
    # A newer chart whose CRD has one more printer column: `helm upgrade` must bring it.
    newer = tmp_path / "kvpilot"
    shutil.copytree(CHART_DIR, newer, symlinks=False)
    crd_file = newer / "files" / "inferenceservice.yaml"
    crd = yaml.safe_load(crd_file.read_text())
    crd["spec"]["versions"][0]["additionalPrinterColumns"].append(
        {"name": "Upgraded", "type": "string", "jsonPath": ".spec.model.name", "priority": 1}
    )
    crd_file.unlink()
    crd_file.write_text(yaml.safe_dump(crd, sort_keys=False))
    values = ["--reuse-values", "--wait", "--timeout=120s"]
    try:
        k8s.helm("upgrade", kvpilot.release, str(newer), "-n", kvpilot.namespace, *values, timeout=150)
        columns = [
            c["name"] for c in k8s.kubectl_json("get", "crd", CRD)["spec"]["versions"][0]["additionalPrinterColumns"]
        ]
        assert "Upgraded" in columns
    finally:
        k8s.helm("upgrade", kvpilot.release, str(CHART_DIR), "-n", kvpilot.namespace, *values, timeout=150)
    columns = [
        c["name"] for c in k8s.kubectl_json("get", "crd", CRD)["spec"]["versions"][0]["additionalPrinterColumns"]
    ]
    assert "Upgraded" not in columns


def test_helm_install_creates_crd_operator_and_rbac(k8s: Cluster, kvpilot: Installation) -> None:
    release = k8s.helm("status", kvpilot.release, "-n", kvpilot.namespace, "-o", "json").stdout
    assert '"status":"deployed"' in release.replace(" ", "")
    crd = k8s.kubectl_json("get", "crd", CRD)
    established = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert established["Established"] == "True" and established["NamesAccepted"] == "True"
    assert crd["status"]["acceptedNames"]["shortNames"] == ["kvis"]
    k8s.kubectl("wait", "--for=condition=Established", "crd/kopfpeerings.kopf.dev", "--timeout=30s")

    # The operator Deployment rolls out (kwok runs its pod), under the chart's ServiceAccount.
    k8s.kubectl(
        "rollout", "status", f"deployment/{kvpilot.fullname}", "-n", kvpilot.namespace, "--timeout=60s", timeout=70
    )
    deployment = k8s.kubectl_json("get", "deployment", kvpilot.fullname, "-n", kvpilot.namespace)
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == kvpilot.service_account
    assert pod["containers"][0]["command"] == ["kvpilot"]
    assert pod["containers"][0]["args"][:2] == ["operator", f"--namespace={kvpilot.watch_namespaces[0]}"]
    k8s.kubectl("get", "serviceaccount", kvpilot.service_account, "-n", kvpilot.namespace)

    # RBAC: cluster-wide read-only bits, everything else in the watched namespace only.
    k8s.kubectl("get", "clusterrole,clusterrolebinding", f"{kvpilot.fullname}-cluster")
    for ns in kvpilot.watch_namespaces:
        k8s.kubectl("get", "role,rolebinding", kvpilot.fullname, "-n", ns)
        k8s.kubectl("get", "kopfpeering", "kvpilot", "-n", ns)
    binding = k8s.kubectl_json("get", "rolebinding", kvpilot.fullname, "-n", kvpilot.watch_namespaces[0])
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": kvpilot.service_account, "namespace": kvpilot.namespace}
    ]
    notes = k8s.helm("get", "notes", kvpilot.release, "-n", kvpilot.namespace).stdout
    assert "kind: InferenceService" in notes and "kubectl get kvis" in notes


@pytest.mark.parametrize(
    "values, message",
    [
        (["--set", "replicaCount=0"], "replicaCount"),
        (["--set", "logLevel=verbose"], "logLevel"),
        (["--set", "watchNamespaces={Not_A_Namespace}"], "watchNamespaces"),
        (["--set", "typoKey=1"], "typoKey"),
    ],
)
def test_values_schema_refuses_bad_values(
    k8s_binaries: Binaries, tmp_path: Path, values: list[str], message: str
) -> None:
    with pytest.raises(subprocess.CalledProcessError) as refused:
        _helm(k8s_binaries, tmp_path, "template", "kvpilot", str(CHART_DIR), "-n", "ops", *values)
    assert message in refused.value.stderr


def test_several_operator_replicas_get_a_disruption_budget(k8s_binaries: Binaries, tmp_path: Path) -> None:
    assert not [d for d in _template(k8s_binaries, tmp_path) if d["kind"] == "PodDisruptionBudget"]
    (pdb,) = [
        d for d in _template(k8s_binaries, tmp_path, "--set", "replicaCount=2") if d["kind"] == "PodDisruptionBudget"
    ]
    operator = next(
        d for d in _template(k8s_binaries, tmp_path, "--set", "replicaCount=2") if d["kind"] == "Deployment"
    )
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == operator["spec"]["selector"]["matchLabels"]


def test_the_dashboard_is_a_configmap_for_grafanas_sidecar_when_asked(k8s_binaries: Binaries, tmp_path: Path) -> None:
    assert not [d for d in _template(k8s_binaries, tmp_path) if d["kind"] == "ConfigMap"]
    rendered = _template(
        k8s_binaries, tmp_path, "--set", "dashboards.enabled=true", "--set", "dashboards.namespace=monitoring"
    )
    (config,) = [d for d in rendered if d["kind"] == "ConfigMap"]
    assert config["metadata"]["namespace"] == "monitoring"
    assert config["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = (CHART_DIR / "dashboards" / "kvpilot.json").read_text()
    assert json.loads(config["data"]["kvpilot.json"]) == json.loads(shipped)
