"""The images we ship, built by `make images` (e2e/images.sh) from engine/Dockerfile and
operator/Dockerfile, run as Kubernetes runs what the operator and the chart render.

- the engine image with the pod the operator renders for a CPU service of the embedded model: its
  command, args, env (the API key from its Secret), uid 65532 on a read-only root with every
  capability dropped, no service-account token, `/tmp` an emptyDir; ready on /ready within the
  rendered startup probe's budget, on the converted model and the prebuilt kernels the image ships
  (nothing converted or built at start-up), answering the `openai` client and /metrics;
- every module of both halves imports in the engine image, every operator module in the operator
  image, and the operator image has no torch;
- the operator image runs `kvpilot operator` and `kvpilot gateway` with the chart's Deployments'
  arguments, env and securityContext against the e2e control plane: it reconciles an
  InferenceService, and the gateway routes a chat completion to the engine image serving its pod;
- the images' sizes stay under the budgets below.

The containers run with podman on the host's network (servers bind loopback addresses of this
machine: 127.79.0.x here, apart from the gateway tests' 127.77.0.x and kwok's pod IPs).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from e2e import kvis
from e2e.chart import Installation
from e2e.cluster import Cluster
from e2e.images import RUN_OPTIONS, TOKEN_DIR, Container, Images, build_images, container_argv, start_container
from e2e.local_gateway import LocalGateway
from e2e.local_operator import LocalOperator
from e2e.local_process import LocalProcess
from e2e.procs import free_port
from kvpilot.operator.api.names import API_KEY_SECRET_KEY, api_key_secret
from kvpilot.operator.api.spec import InferenceServiceSpec
from kvpilot.operator.controller import render
from kvpilot.operator.planning.plan import plan
from tests.test_imports import modules

GiB = 1024**3
# What each image may weigh, all layers unpacked (measured sizes in docs/images.md). The engine:
# PyPI's torch for Linux x86_64 is its CUDA build, and libtorch.so links libtorch_cuda.so, which
# links the CUDA runtime, cuBLAS, cuDNN, NCCL...: `import torch` fails without the nvidia-* wheels
# (~3 GB) even on a CPU; torch itself ~1.2 GB, triton (a torch dependency) ~1 GB: the dependencies'
# layer is 6.2 GB. g++ for the compiled decode step 0.4 GB; the code's layer 0.55 GB, nearly all the
# embedded model converted to fp32 safetensors (135M parameters), and the kernels of every ISA level.
ENGINE_BUDGET = 8 * GiB
# Python, the venv and the operator's dependencies (kubernetes, kopf, pydantic): no torch.
OPERATOR_BUDGET = 512 * 1024**2
HOST = "127.79.0.1"  # the engine's address in the first test
MODEL = "SmolLM2-135M-Instruct"
CPU_SPEC = {
    "model": {"name": MODEL},
    "accelerator": {"type": "cpu", "profile": "amd-epyc-zen5-2c"},
    "load": {"requestsPerSecond": 1, "meanPromptTokens": 128, "meanOutputTokens": 32},
    "slo": {"ttftP95Ms": 2000, "tpotP95Ms": 200},
}


@pytest.fixture(scope="module")
def images() -> Images:
    started = time.monotonic()
    built = build_images()
    print(f"make images: {time.monotonic() - started:.0f} s")
    return built


def _set(args: list[str], flag: str, value: str) -> list[str]:
    args = list(args)
    args[args.index(flag) + 1] = value
    return args


def _chat(base_url: str, key: str) -> str:
    with httpx.Client(trust_env=False, timeout=120) as http:
        client = openai.OpenAI(base_url=base_url, api_key=key, http_client=http, max_retries=0)
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=8
        )
    assert chat.usage is not None and 0 < chat.usage.completion_tokens <= 8
    return chat.choices[0].message.content or ""


def test_the_images_sizes_stay_in_their_budgets(images: Images) -> None:
    for image, budget in ((images.engine, ENGINE_BUDGET), (images.operator, OPERATOR_BUDGET)):
        size = images.size(image)
        largest = sorted(images.layers(image), reverse=True)[:4]
        print(f"{image}: {size / GiB:.2f} GiB; largest layers:")
        print("\n".join(f"  {n / 1024**2:8.0f} MiB  {step[:110]}" for n, step in largest))
        assert size <= budget, f"{image} is {size / GiB:.2f} GiB, over its budget of {budget / GiB:.2f} GiB"


def test_every_module_imports_in_the_images(images: Images) -> None:
    """A module the wheel lacks, or a dependency the image lacks, fails here by name."""
    script = "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)\nprint('ok')"
    as_pods = ["--rm", *RUN_OPTIONS, "--network=none", "--read-only", "--user", "65532:65532", "--cap-drop=ALL"]
    every = sorted(modules())
    engine = images.run("run", *as_pods, "--entrypoint=python", images.engine, "-c", script, *every, check=False)
    assert engine.returncode == 0 and engine.stdout.strip() == "ok", engine.stderr[-3000:]
    light = [m for m in every if m.startswith("kvpilot.operator.")]
    operator = images.run("run", *as_pods, "--entrypoint=python", images.operator, "-c", script, *light, check=False)
    assert operator.returncode == 0 and operator.stdout.strip() == "ok", operator.stderr[-3000:]
    no_torch = "import importlib.util; print(importlib.util.find_spec('torch'))"
    found = images.run("run", *as_pods, "--entrypoint=python", images.operator, "-c", no_torch)
    assert found.stdout.strip() == "None"


@pytest.fixture()
def cpu_engine(images: Images, tmp_path: Path) -> Iterator[tuple[Container, dict[str, Any], float, dict[str, Any]]]:
    """The engine image running the pod the operator renders for CPU_SPEC."""
    spec = InferenceServiceSpec.model_validate(CPU_SPEC)
    result = plan(spec)
    assert result.fits, result.reason
    deployment = render.deployment("smollm2-cpu", "default", "", spec, result, default_image=images.engine)
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == images.engine and "initContainers" not in pod
    probe = container["startupProbe"]
    budget_s = probe["periodSeconds"] * probe["failureThreshold"]
    # Only the address moves, from the pod's 0.0.0.0:8000 to a free loopback port here.
    port = free_port(HOST)
    args = _set(_set(container["args"], "--host", HOST), "--port", str(port))
    name = f"kvpilot-engine-{port}"
    argv = container_argv(
        images,
        pod,
        container,
        name=name,
        volumes_root=tmp_path / "volumes",
        args=args,
        secrets={(api_key_secret("smollm2-cpu"), API_KEY_SECRET_KEY): "image-test-key"},
    )
    started = time.monotonic()
    engine = start_container(argv, name, images, tmp_path / "engine.log", f"http://{HOST}:{port}/ready", budget_s)
    ready_s = time.monotonic() - started
    try:
        yield engine, container, ready_s, pod
    finally:
        assert engine.stop() == 0, engine.process.log_tail()


def test_the_engine_image_runs_the_rendered_cpu_pod(
    cpu_engine: tuple[Container, dict[str, Any], float, dict[str, Any]],
) -> None:
    engine, container, ready_s, pod = cpu_engine
    args = engine.process.argv
    host, port = args[args.index("--host") + 1], int(args[args.index("--port") + 1])
    print(f"engine image ready in {ready_s:.1f} s")
    # The rendered securityContext as the kernel sees it: the pod's uid and gid (not root; the
    # image's own USER is 65532, the operator renders render.RUN_AS_USER), no capabilities, a
    # read-only root; /tmp (its emptyDir) is the one writable place; no service-account token.
    pid = engine.images.run("inspect", "--format", "{{.State.Pid}}", engine.name).stdout.strip()
    assert "kvpilot" in Path(f"/proc/{pid}/cmdline").read_text()
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    uid = str(pod["securityContext"]["runAsUser"])
    assert uid != "0" and fields["Uid"].split() == [uid] * 4 and fields["Gid"].split()[0] == uid
    user = engine.images.run("image", "inspect", "--format", "{{.Config.User}}", engine.images.engine).stdout
    assert user.strip() == "65532:65532"
    assert int(fields["CapEff"].strip(), 16) == 0 and int(fields["CapPrm"].strip(), 16) == 0
    assert fields["NoNewPrivs"].strip() == "1"
    for place in ("/", "/opt/kvpilot", "/var/cache/kvpilot", "/src", "/var/tmp", "/run"):
        wrote = engine.exec("touch", f"{place}/written-by-the-test")
        assert wrote.returncode != 0 and "Read-only file system" in wrote.stderr, (place, wrote)
    assert engine.exec("touch", "/tmp/written-by-the-test").returncode == 0
    assert engine.exec("ls", TOKEN_DIR).returncode != 0
    assert engine.images.run("inspect", "--format", "{{.HostConfig.ReadonlyRootfs}}", engine.name).stdout.strip() == (
        "true"
    )
    # What the image ships is where the engine looks: the converted model, the kernels of this CPU's level.
    log = engine.process.log_text()
    assert "event=cpu_kernels source=prebuilt" in log and "converting" not in log, log[-3000:]
    assert "Read-only file system" not in log and "Permission denied" not in log, log[-3000:]

    base = f"http://{host}:{port}"
    assert _chat(f"{base}/v1", "image-test-key")
    with httpx.Client(trust_env=False, timeout=30) as http:
        assert http.get(f"{base}/v1/models").status_code == 401  # the key from the Secret is required
        metrics = http.get(f"{base}/metrics")
    assert metrics.status_code == 200 and "vllm:time_to_first_token_seconds" in metrics.text
    assert container["env"][0] == {"name": "HOME", "value": "/tmp"}


class _InImage(LocalProcess):
    """The chart's component run from the operator image instead of this checkout's venv: the
    chart's Deployment's container (args, env, securityContext, /tmp emptyDir), with the
    ServiceAccount kubeconfig in place of the token the pod would mount."""

    images: Images
    container: Container | None

    def launch(self, argv: list[str], ready_url: str, timeout_s: float) -> Any:
        fullname = self.installation.fullname
        deployment = self.deployment(fullname if self.component == "operator" else f"{fullname}-{self.component}")
        pod = deployment["spec"]["template"]["spec"]
        container = next(c for c in pod["containers"] if c["name"] == self.component)
        assert argv[0].endswith("/kvpilot") and container["command"] == ["kvpilot"]
        self.starts += 1
        kubeconfig = self.workdir / f"{self.component}-{self.starts}-kubeconfig.yaml"
        shutil.copyfile(self.kubeconfig, kubeconfig)
        kubeconfig.chmod(0o444)  # the pod's uid reads it, as it reads a mounted token
        name = f"kvpilot-{self.component}-{self.starts}-{free_port()}"
        run = container_argv(
            self.images,
            {**pod, "automountServiceAccountToken": False},
            {**container, "image": self.images.operator},
            name=name,
            volumes_root=self.workdir / f"volumes-{self.starts}",
            args=argv[1:],
            field_refs={"metadata.namespace": self.installation.namespace},
            extra=[
                "--volume",
                f"{kubeconfig}:/etc/kvpilot/kubeconfig:ro",
                "--env",
                "KUBECONFIG=/etc/kvpilot/kubeconfig",
            ],
        )
        log = self.workdir / f"{self.component}-{self.starts}.log"
        self.container = start_container(run, name, self.images, log, ready_url, timeout_s)
        return self.container.process

    def stop(self) -> None:
        if self.container is not None:
            self.container.stop()


class ImageOperator(_InImage, LocalOperator):
    def __init__(self, images: Images, cluster: Cluster, installation: Installation, workdir: Path) -> None:
        super().__init__(cluster, installation, workdir)
        self.images, self.container = images, None


class ImageGateway(_InImage, LocalGateway):
    def __init__(self, images: Images, cluster: Cluster, installation: Installation, workdir: Path) -> None:
        super().__init__(cluster, installation, workdir)
        self.images, self.container = images, None


@pytest.fixture()
def in_images(
    images: Images,
    k8s: Cluster,
    kvpilot: Installation,
    operator: LocalOperator,
    gateway: LocalGateway,
    tmp_path: Path,
) -> Iterator[tuple[ImageOperator, ImageGateway]]:
    """The session's operator and gateway (this venv's) stopped, and the images' in their place;
    the session's started again after."""
    operator.stop()
    gateway.stop()
    in_operator = ImageOperator(images, k8s, kvpilot, tmp_path / "operator")
    in_gateway = ImageGateway(images, k8s, kvpilot, tmp_path / "gateway")
    try:
        in_gateway.start()
        in_operator.start()
        yield in_operator, in_gateway
    finally:
        in_operator.stop()
        in_gateway.stop()
        gateway.start()
        operator.start()


def test_the_operator_image_reconciles_and_its_gateway_routes_to_the_engine_image(
    images: Images,
    k8s: Cluster,
    kvpilot: Installation,
    in_images: tuple[ImageOperator, ImageGateway],
    apply_isvc: Any,
    tmp_path: Path,
) -> None:
    in_operator, in_gateway = in_images
    name = "smollm2-image"
    apply_isvc(name, kvis.sample("smollm2-135m")["spec"])
    namespace = kvpilot.watch_namespaces[0]
    kvis.wait_condition(k8s, namespace, name, "Ready", "True", timeout_s=60)
    deployment = k8s.kubectl_json("get", "deployment", name, "-n", namespace)
    (pod,) = kvis.running_pods(k8s, namespace, name)
    ip, key = pod["status"]["podIP"], kvis.api_key(k8s, namespace, name)
    (container,) = pod["spec"]["containers"]
    assert container["args"] == deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    probe = container["startupProbe"]
    engine_name = f"kvpilot-engine-{name}-{free_port()}"
    argv = container_argv(
        images,
        pod["spec"],
        {**container, "image": images.engine},
        name=engine_name,
        volumes_root=tmp_path / "engine-volumes",
        args=_set(container["args"], "--host", ip),
        secrets={(api_key_secret(name), API_KEY_SECRET_KEY): key},
    )
    port = container["ports"][0]["containerPort"]
    budget_s = probe["periodSeconds"] * probe["failureThreshold"]
    engine = start_container(argv, engine_name, images, tmp_path / "engine.log", f"http://{ip}:{port}/ready", budget_s)
    try:
        assert _chat(in_gateway.base_url(namespace), key)
        with httpx.Client(trust_env=False, timeout=30) as http:
            assert http.get(in_operator.metrics_url).status_code == 200
    finally:
        assert engine.stop() == 0, engine.process.log_tail()
    # Both ran from the image, not from this checkout, as the chart's securityContext says.
    for component in (in_operator, in_gateway):
        assert component.container is not None and component.container.process.argv[0] == "podman"
        inspect = "{{.HostConfig.ReadonlyRootfs}} {{.Config.User}} {{.ImageName}}"
        found = images.run("inspect", "--format", inspect, component.container.name).stdout.split()
        assert found[0] == "true" and not found[1].startswith("0") and found[2] == images.operator, found
