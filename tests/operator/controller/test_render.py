import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpilot.engine.contract.config import EngineCapabilities
from kvpilot.operator.api import names
from kvpilot.operator.api.spec import InferencePoolSpec, InferenceServiceSpec
from kvpilot.operator.controller import render
from kvpilot.operator.planning.plan import PlanContext, plan

UID = "0b7c6e1e-0000-4000-8000-000000000001"
CHART = Path(__file__).resolve().parents[3] / "helm" / "kvpilot" / "Chart.yaml"


def spec(**overrides: Any) -> InferenceServiceSpec:
    body: dict[str, Any] = {
        "model": {"name": "llama-2-7b", "source": "hf://meta-llama/Llama-2-7b-hf"},
        "accelerator": {"type": "A10G"},
        **overrides,
    }
    return InferenceServiceSpec.model_validate(body)


def engine(deployment: dict[str, Any]) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def test_engine_args_carry_the_plans_numbers() -> None:
    s = spec(serving={"maxContextLength": 4096, "speculative": "off"})
    p = plan(s)
    container = engine(render.deployment("chat", "ml", UID, s, p))
    assert container["command"] == ["kvpilot", "serve"]
    # The engine's serve_argv orders them: server flags, then engine flags, in field order.
    assert container["args"] == [
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--served-model-name",
        "llama-2-7b",
        "--vllm-compatible-metrics",
        "--grace-period",
        repr(float(render.drain_seconds(s, p))),
        "--model",
        "/model-cache/hf/meta-llama/Llama-2-7b-hf@main",  # the download's folder
        "--block-size",
        "16",
        "--max-num-seqs",
        str(p.max_num_seqs),
        "--max-num-batched-tokens",
        str(p.max_num_batched_tokens),
        "--max-model-len",
        "4096",
        "--gpu-memory-utilization",
        "0.9",
        "--quantization",
        "none",
        "--speculative",
        "off",
    ]
    assert p.max_num_seqs == 20  # at the mean context of 640 tokens (3 at the full 4096)


def test_a_plan_the_engine_cannot_run_is_refused_not_rendered(fuller: EngineCapabilities) -> None:
    # Only a planner given a fuller engine than this one makes such a plan (W8A8 on a GPU: this
    # engine runs it on CPUs only); rendering it would give a pod that exits at start, so it raises.
    s = spec(serving={"quantization": "w8a8"})
    p = plan(s, PlanContext(capabilities=fuller))
    assert p.fits and p.quantization == "w8a8"
    with pytest.raises(ValueError, match="runs on CPUs only"):
        render.deployment("chat", "ml", UID, s, p)
    assert plan(s).failure == "UnsupportedByRuntime" and "serving.quantization w8a8 runs on CPUs only" in plan(s).reason


def test_pod_runs_non_root_with_probes_metrics_port_and_gpu() -> None:
    s = spec(
        resources={"requests": {"cpu": "4", "memory": "32Gi"}},
        nodeSelector={"pool": "gpu"},
        tolerations=[{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}],
    )
    deployment = render.deployment("chat", "ml", UID, s, plan(s))
    pod = deployment["spec"]["template"]["spec"]
    container = engine(deployment)
    assert container["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    # The startup probe waits for the model, not just the process.
    assert container["startupProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert all(container[probe]["timeoutSeconds"] >= 5 for probe in ("startupProbe", "readinessProbe", "livenessProbe"))
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    # The hf:// download goes to an emptyDir on the node's disk: 12.6 GiB x 1.1 + 1 GiB, rounded up.
    assert container["resources"]["requests"] == {
        "cpu": "4",
        "memory": "32Gi",
        "nvidia.com/gpu": "1",
        "ephemeral-storage": "15Gi",
    }
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    assert {"name": "tmp", "emptyDir": {}} in pod["volumes"]
    assert pod["nodeSelector"] == {"pool": "gpu", "nvidia.com/gpu.product": "NVIDIA-A10G"}
    assert {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"} in pod["tolerations"]
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/path"] == "/metrics"


def test_pods_request_host_memory_for_the_weights_and_drain_for_the_predicted_latency() -> None:
    s = spec()
    p = plan(s)
    deployment = render.deployment("chat", "ml", UID, s, p)
    container, pod = engine(deployment), deployment["spec"]["template"]["spec"]
    # 12.6 GiB of FP16 weights + 2 GiB margin, rounded up; and a CPU request.
    assert container["resources"]["requests"] == {
        "cpu": "2",
        "memory": "15Gi",
        "nvidia.com/gpu": "1",
        "ephemeral-storage": "15Gi",
    }
    drain = render.drain_seconds(s, p)
    assert drain >= 2 * p.predicted_latency_ms / 1000 and drain >= 10
    args = container["args"]
    assert float(args[args.index("--grace-period") + 1]) == drain
    assert container["lifecycle"] == {"preStop": {"sleep": {"seconds": render.PRESTOP_SLEEP_S}}}
    assert pod["terminationGracePeriodSeconds"] == render.PRESTOP_SLEEP_S + drain + 5


def test_gpus_without_bf16_run_float16() -> None:
    t4, a10g = (
        spec(accelerator={"type": "T4"}, model={"name": "llama-3-8b"}, serving={"maxContextLength": 2048}),
        spec(),
    )
    t4_args = engine(render.deployment("chat", "ml", UID, t4, plan(t4)))["args"]
    assert t4_args[t4_args.index("--dtype") + 1] == "float16"
    assert "--dtype" not in engine(render.deployment("chat", "ml", UID, a10g, plan(a10g)))["args"]  # auto: bf16


def test_engine_image_is_the_specs_else_the_operators_default() -> None:
    unset, pinned = spec(), spec(image="registry.example/kvpilot:pinned")
    configured = "mirror.example/kvpilot:1.2.3"
    assert (
        engine(render.deployment("chat", "ml", UID, unset, plan(unset), default_image=configured))["image"]
        == configured
    )
    assert (
        engine(render.deployment("chat", "ml", UID, pinned, plan(pinned), default_image=configured))["image"]
        == "registry.example/kvpilot:pinned"
    )
    (deployment, *_) = render.children("chat", "ml", UID, unset, plan(unset), default_image=configured)
    assert engine(deployment)["image"] == configured
    assert engine(render.deployment("chat", "ml", UID, unset, plan(unset)))["image"] == render.DEFAULT_ENGINE_IMAGE


def test_built_in_engine_image_is_the_charts_app_version() -> None:
    app_version = yaml.safe_load(CHART.read_text())["appVersion"]
    assert render.DEFAULT_ENGINE_IMAGE == f"ghcr.io/kvpilot/kvpilot:{app_version}"


def test_replicas_come_from_the_plan_unless_scaled() -> None:
    s = spec(load={"requestsPerSecond": 4})
    p = plan(s)
    assert render.deployment("chat", "ml", UID, s, p)["spec"]["replicas"] == p.replicas == 4
    scaled = spec(replicas=5, autoscaling={"maxReplicas": 8})  # within the autoscaler's bounds
    assert render.deployment("chat", "ml", UID, scaled, plan(scaled))["spec"]["replicas"] == 5


def test_a_plan_that_speculates_renders_its_draft_count() -> None:
    # A light load at temperature 0.7 with a TPOT-bound SLO: the planner speculates with n-grams.
    s = spec(load={"requestsPerSecond": 0.5}, serving={"numSpeculativeTokens": 6})
    p = plan(s)
    assert (p.speculative, p.num_speculative_tokens) == ("ngram", 6)
    args = " ".join(engine(render.deployment("chat", "ml", UID, s, p))["args"])
    assert "--speculative ngram --num-speculative-tokens 6" in args


def test_pvc_source_is_mounted_read_only() -> None:
    s = spec(model={"name": "llama-2-7b", "source": "pvc://weights/llama-2-7b"})
    deployment = render.deployment("chat", "ml", UID, s, plan(s))
    container = engine(deployment)
    assert container["args"][container["args"].index("--model") + 1] == "/models/weights/llama-2-7b"
    assert container["volumeMounts"][0] == {"name": "model", "mountPath": "/models/weights", "readOnly": True}
    assert deployment["spec"]["template"]["spec"]["volumes"][0] == {
        "name": "model",
        "persistentVolumeClaim": {"claimName": "weights", "readOnly": True},
    }


def test_children_are_owned_labelled_and_selected_consistently() -> None:
    s = spec()
    pooled = s.model_copy(update={"inference_pool": InferencePoolSpec(enabled=True)})
    objects = render.children("chat", "ml", UID, pooled, plan(s))
    kinds = ["Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy", "InferencePool"]
    assert [o["kind"] for o in objects] == kinds
    for obj in objects:
        assert obj["metadata"]["namespace"] == "ml" and obj["metadata"]["name"] == "chat"
        (owner,) = obj["metadata"]["ownerReferences"]
        assert owner == {
            "apiVersion": "kvpilot.dev/v1alpha1",
            "kind": "InferenceService",
            "name": "chat",
            "uid": UID,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    deployment, service, pdb, policy, pool = objects
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    for selector in (
        deployment["spec"]["selector"]["matchLabels"],
        service["spec"]["selector"],
        pdb["spec"]["selector"]["matchLabels"],
        policy["spec"]["podSelector"]["matchLabels"],
        pool["spec"]["selector"]["matchLabels"],
    ):
        assert selector.items() <= pod_labels.items()
    assert names.selector("chat") == ",".join(
        f"{k}={v}" for k, v in sorted(deployment["spec"]["selector"]["matchLabels"].items())
    )
    assert service["spec"]["ports"][0]["targetPort"] == "http"


def test_no_deployment_for_a_plan_that_does_not_fit() -> None:
    s = spec(model={"name": "llama-3-70b"})
    p = plan(s)
    assert not p.fits
    kinds = [o["kind"] for o in render.children("big", "ml", UID, s, p)]
    assert kinds == ["Service", "PodDisruptionBudget", "NetworkPolicy"]


def test_amd_gpus_use_amd_resource_and_label() -> None:
    s = spec(accelerator={"type": "MI300X"})
    deployment = render.deployment("chat", "ml", UID, s, plan(s))
    assert engine(deployment)["resources"]["limits"] == {"amd.com/gpu": "1"}
    assert deployment["spec"]["template"]["spec"]["nodeSelector"] == {"amd.com/gpu.product-name": "AMD_Instinct_MI300X"}


def test_pod_settings_pass_through_and_rollout_surges_by_default() -> None:
    env = [{"name": "KVPILOT_API_KEY", "valueFrom": {"secretKeyRef": {"name": "llm", "key": "api-key"}}}]
    affinity = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}}
    spread = [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway"}]
    s = spec(
        env=env,
        envFrom=[{"secretRef": {"name": "hf-token"}}],
        imagePullSecrets=[{"name": "registry"}],
        affinity=affinity,
        topologySpreadConstraints=spread,
        priorityClassName="inference",
        podLabels={"team": "ml", "app.kubernetes.io/instance": "hijack"},
        podAnnotations={"owner": "ml"},
    )
    deployment = render.deployment("chat", "ml", UID, s, plan(s))
    pod = deployment["spec"]["template"]
    container = engine(deployment)
    # A key of the user's own in env: the operator hands out none (the engine reads theirs).
    assert container["env"][1:] == env and container["envFrom"] == [{"secretRef": {"name": "hf-token"}}]
    assert pod["spec"]["imagePullSecrets"] == [{"name": "registry"}]
    assert pod["spec"]["affinity"] == affinity and pod["spec"]["topologySpreadConstraints"] == spread
    assert pod["spec"]["priorityClassName"] == "inference"
    # The operator's labels win: the Deployment's selector depends on them.
    assert (
        pod["metadata"]["labels"]["team"] == "ml" and pod["metadata"]["labels"]["app.kubernetes.io/instance"] == "chat"
    )
    assert pod["metadata"]["annotations"]["owner"] == "ml"
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    full_nodes = spec(rollout={"maxSurge": 0, "maxUnavailable": 1})
    assert render.deployment("chat", "ml", UID, full_nodes, plan(full_nodes))["spec"]["strategy"]["rollingUpdate"] == {
        "maxSurge": 0,
        "maxUnavailable": 1,
    }
    plain = engine(render.deployment("chat", "ml", UID, spec(), plan(spec())))
    assert (
        "envFrom" not in plain
        and "priorityClassName"
        not in render.deployment("chat", "ml", UID, spec(), plan(spec()))["spec"]["template"]["spec"]
    )


def test_a_gpu_with_several_product_strings_is_required_by_node_affinity() -> None:
    s = spec(accelerator={"type": "A100-80GB"})
    pod = render.deployment("chat", "ml", UID, s, plan(s))["spec"]["template"]["spec"]
    assert "nvidia.com/gpu.product" not in pod["nodeSelector"]
    (term,) = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term["matchExpressions"] == [
        {
            "key": "nvidia.com/gpu.product",
            "operator": "In",
            "values": ["NVIDIA-A100-SXM4-80GB", "NVIDIA-A100-80GB-PCIe"],
        }
    ]
    # A user's own alternatives each keep the GPU requirement.
    zones = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]},
                ]
            }
        }
    }
    user = spec(accelerator={"type": "A100-80GB"}, affinity=zones)
    terms = render.deployment("chat", "ml", UID, user, plan(user))["spec"]["template"]["spec"]["affinity"][
        "nodeAffinity"
    ]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert [len(t["matchExpressions"]) for t in terms] == [2, 2]
    assert all(t["matchExpressions"][1]["key"] == "nvidia.com/gpu.product" for t in terms)
    assert user.affinity == zones  # the spec itself is not changed


def test_node_discovery_knows_every_product_string() -> None:
    from kvpilot.operator.planning.gpus import find_gpu

    assert find_gpu("NVIDIA-A100-80GB-PCIe").name == find_gpu("NVIDIA-A100-SXM4-80GB").name == "A100-80GB"


def test_the_accelerator_node_selector_replaces_the_product_label() -> None:
    gke = {"cloud.google.com/gke-accelerator": "nvidia-l4"}
    s = spec(accelerator={"type": "L4", "nodeSelector": gke}, nodeSelector={"pool": "llm"})
    pod = render.deployment("chat", "ml", UID, s, plan(s))["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "llm", **gke}
    assert "affinity" not in pod


def test_engine_pods_are_hardened_for_long_loads_and_drains() -> None:
    """Issue 24, item 12: no API token in the engine, disk for what is downloaded, evictable when
    unhealthy, and a progress deadline past the startup budget."""
    s = spec()
    children = {c["kind"]: c for c in render.children("chat", "ml", UID, s, plan(s))}
    deployment, pdb = children["Deployment"], children["PodDisruptionBudget"]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    startup = engine(deployment)["startupProbe"]
    budget = startup["periodSeconds"] * startup["failureThreshold"]
    planned = plan(s)
    assert planned.startup_budget_s <= budget < planned.startup_budget_s + startup["periodSeconds"]
    # The startup budget, the 12.6 GiB download at 50 MB/s (270 s) and a 300 s margin.
    assert planned.download_budget_s == math.ceil(planned.checkpoint_bytes / 50e6) == 270
    assert deployment["spec"]["progressDeadlineSeconds"] == budget + 270 + 300 > budget
    # A model in the image: nothing to download, no disk asked for, the budget and the margin.
    local = spec(model={"name": "llama-2-7b", "source": "/opt/llama"})
    rendered = render.deployment("chat", "ml", UID, local, plan(local))
    assert "ephemeral-storage" not in engine(rendered)["resources"]["requests"]
    assert rendered["spec"]["progressDeadlineSeconds"] == budget + 300
    # A cache claim holds the download: no emptyDir, no ephemeral storage for it.
    claimed = spec(
        model={"name": "llama-2-7b", "source": "hf://meta-llama/Llama-2-7b-hf", "cache": {"claimName": "models"}}
    )
    rendered = render.deployment("chat", "ml", UID, claimed, plan(claimed))
    assert "ephemeral-storage" not in engine(rendered)["resources"]["requests"]
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "models"}} in rendered["spec"]["template"][
        "spec"
    ]["volumes"]


def test_the_drain_covers_the_longest_request_the_engine_accepts_up_to_the_spec_s_cap() -> None:
    """Issue 24, item 10: sized for a mean request (2 x the predicted latency: ~20 s for
    llama-3-8b on an H100), a scale-down or rollout cut a full-length generation."""
    s = spec(model={"name": "llama-3-8b"}, accelerator={"type": "H100-80GB"})
    p = plan(s)
    longest = (p.predicted_ttft_ms + p.max_model_len * p.predicted_tpot_ms) / 1000
    assert render.drain_seconds(s, p) == math.ceil(longest) > 2 * p.predicted_latency_ms / 1000
    pod = render.deployment("chat", "ml", UID, s, p)["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == render.PRESTOP_SLEEP_S + math.ceil(longest) + 5
    capped = spec(model={"name": "llama-3-8b"}, accelerator={"type": "H100-80GB"}, rollout={"maxDrainSeconds": 30})
    assert render.drain_seconds(capped, plan(capped)) == 30
