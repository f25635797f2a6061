"""The images we ship, built by `make images` (e2e/images.sh) from engine/Dockerfile and
operator/Dockerfile, run as Kubernetes runs what the operator and the chart render.

- the engine image with the pod the operator renders for a CPU service of the embedded model: its
  command, args, env (the API key from its Secret), uid 65532 on a read-only root with every
  capability dropped, no service-account token, `/tmp` an emptyDir; ready on /ready within the
  rendered startup probe's budget, on the converted model and the prebuilt kernels the image ships
  (nothing converted or built at start-up), answering the `openai` client and /metrics;
- the engine image runs the inspection Job the operator renders for a model baked into another image
  (FROM scratch: no Python, no kvpilot), mounted as an image volume, and reports its architecture;
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

import filecmp
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from e2e import kvis
from e2e.chart import Installation
from e2e.cluster import Cluster
from e2e.hub_server import HubServer
from e2e.images import RUN_OPTIONS, TOKEN_DIR, Container, Images, build_images, container_argv, start_container
from e2e.local_gateway import LocalGateway
from e2e.local_operator import LocalOperator
from e2e.local_process import LocalProcess
from e2e.polling import poll
from e2e.procs import free_port
from kvpilot.operator.api.names import API_KEY_SECRET_KEY, api_key_secret
from kvpilot.operator.api.spec import InferenceServiceSpec
from kvpilot.operator.controller import inspection, render
from kvpilot.operator.controller.checkpoint import inspect_folder
from kvpilot.operator.planning.model_config import ModelConfig
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
HOST = "127.79.0.1"  # the engines' address in the tests of the rendered pod
API_KEY = "image-test-key"  # the value of the API-key Secret the pod's env names
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


@dataclass
class RenderedPod:
    """The engine image running the pod render.deployment makes for a spec."""

    engine: Container
    pod: dict[str, Any]  # the pod spec
    url: str
    ready_s: float  # from `podman run` to /ready answering 200
    predicted_ready_s: float  # the plan's typical time to ready


@contextmanager
def rendered_pod(
    images: Images, name: str, spec: dict[str, Any], workdir: Path, env: dict[str, str] | None = None
) -> Iterator[RenderedPod]:
    """Run the pod's init containers to completion, then its engine until /ready answers, within
    the startup probe's budget; `env` overrides values of the rendered env (the hub's address)."""
    parsed = InferenceServiceSpec.model_validate(spec)
    result = plan(parsed)
    assert result.fits, result.reason
    pod = render.deployment(name, "default", "", parsed, result, default_image=images.engine)["spec"]["template"][
        "spec"
    ]
    secrets = {(api_key_secret(name), API_KEY_SECRET_KEY): API_KEY}
    volumes = workdir / "volumes"
    for init in pod.get("initContainers", []):
        init_name = f"kvpilot-{name}-{init['name']}-{free_port()}"
        argv = container_argv(images, pod, init, name=init_name, volumes_root=volumes, secrets=secrets)
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, f"init container {init['name']}: {done.stderr[-3000:]}"
    (container,) = pod["containers"]
    assert container["image"] == images.engine
    probe = container["startupProbe"]
    budget_s = probe["periodSeconds"] * probe["failureThreshold"]
    # Only the address moves, from the pod's 0.0.0.0:8000 to a free loopback port here.
    port = free_port(HOST)
    args = _set(_set(container["args"], "--host", HOST), "--port", str(port))
    engine_name = f"kvpilot-{name}-{port}"
    argv = container_argv(images, pod, container, name=engine_name, volumes_root=volumes, args=args, secrets=secrets)
    url = f"http://{HOST}:{port}"
    started = time.monotonic()
    engine = start_container(argv, engine_name, images, workdir / "engine.log", f"{url}/ready", budget_s)
    try:
        yield RenderedPod(engine, pod, url, time.monotonic() - started, result.predicted_ready_s)
    finally:
        assert engine.stop() == 0, engine.process.log_tail()


def _check_as_rendered(running: RenderedPod) -> None:
    """The rendered securityContext as the kernel sees it: the pod's uid and gid (not root; the
    image's own USER is 65532, the operator renders render.RUN_AS_USER), no capabilities, no
    privilege escalation, a read-only root where only the volumes are writable, no token; the
    engine logged no failed write, and answers the openai client with the key and /metrics."""
    engine, pod = running.engine, running.pod
    print(f"engine image ready in {running.ready_s:.1f} s; the plan predicted {running.predicted_ready_s:g} s")
    # The startup probe's budget bounds it (start_container's timeout); twice the plan's typical time
    # catches an image that converts the model (~30 s) or builds its kernels (~40 s) at every start.
    assert 0 < running.ready_s <= 2 * running.predicted_ready_s
    pid = engine.images.run("inspect", "--format", "{{.State.Pid}}", engine.name).stdout.strip()
    assert "kvpilot" in Path(f"/proc/{pid}/cmdline").read_text()
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    uid = str(pod["securityContext"]["runAsUser"])
    assert uid != "0" and fields["Uid"].split() == [uid] * 4 and fields["Gid"].split()[0] == uid
    assert int(fields["CapEff"].strip(), 16) == 0 and int(fields["CapPrm"].strip(), 16) == 0
    assert fields["NoNewPrivs"].strip() == "1"
    readonly = engine.images.run("inspect", "--format", "{{.HostConfig.ReadonlyRootfs}}", engine.name).stdout
    assert readonly.strip() == "true"
    for place in ("/", "/opt/kvpilot", "/var/cache/kvpilot", "/src", "/var/tmp", "/run"):
        wrote = engine.exec("touch", f"{place}/written-by-the-test")
        assert wrote.returncode != 0 and "Read-only file system" in wrote.stderr, (place, wrote)
    assert engine.exec("touch", "/tmp/written-by-the-test").returncode == 0
    assert engine.exec("ls", TOKEN_DIR).returncode != 0
    log = engine.process.log_text()
    assert "Read-only file system" not in log and "Permission denied" not in log, log[-3000:]
    assert _chat(f"{running.url}/v1", API_KEY)
    with httpx.Client(trust_env=False, timeout=30) as http:
        assert http.get(f"{running.url}/v1/models").status_code == 401  # the key from the Secret is required
        metrics = http.get(f"{running.url}/metrics")
    assert metrics.status_code == 200 and "vllm:time_to_first_token_seconds" in metrics.text


def test_the_engine_image_runs_the_rendered_cpu_pod(images: Images, tmp_path: Path) -> None:
    with rendered_pod(images, "smollm2-cpu", CPU_SPEC, tmp_path) as running:
        assert "initContainers" not in running.pod
        assert [v["name"] for v in running.pod["volumes"]] == ["tmp"]
        _check_as_rendered(running)
        # What the image ships is where the engine looks: the converted model, the kernels of this CPU's level.
        log = running.engine.process.log_text()
        assert "event=cpu_kernels source=prebuilt" in log and "converting" not in log, log[-3000:]
    user = images.run("image", "inspect", "--format", "{{.Config.User}}", images.engine).stdout
    assert user.strip() == "65532:65532"


def test_the_engine_image_reads_a_model_baked_into_another_image_as_the_inspection_job_runs(
    images: Images, tmp_path: Path
) -> None:
    import torch
    from safetensors.torch import save_file

    context = tmp_path / "baked"
    folder = context / "srv" / "models" / "qwen3-8b"
    folder.mkdir(parents=True)
    shutil.copy(
        Path(__file__).parents[1] / "tests/operator/planning/hf_configs/Qwen--Qwen3-8B.json", folder / "config.json"
    )
    save_file({"w": torch.zeros(4, 4)}, str(folder / "model.safetensors"))  # 64 bytes of weights
    # Readable by the pods' non-root users, as a baked model must be for the engine too.
    for path in folder.iterdir():
        path.chmod(0o644)
    (context / "Containerfile").write_text("FROM scratch\nCOPY srv /srv\n")
    baked = "localhost/kvpilot-e2e-baked:qwen3-8b"
    images.run("build", "-q", "--isolation", "chroot", "-t", baked, "-f", str(context / "Containerfile"), str(context))
    spec = InferenceServiceSpec.model_validate(
        {"model": {"name": "my-qwen3", "source": "/srv/models/qwen3-8b"}, "runtime": "vllm", "image": baked}
    )
    inspected = inspection.inspected_source(spec.model.source, spec, images.engine)
    assert inspected == inspection.Inspected("/srv/models/qwen3-8b", baked)
    job = inspection.job("baked", "ml", "uid-1", spec, inspected, images.engine)
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    # The kubelet's termination-message file, which the container writes and the operator reads.
    log = tmp_path / "termination-log"
    log.touch(mode=0o666)
    log.chmod(0o666)
    argv = container_argv(
        images,
        pod,
        container,
        name="kvpilot-e2e-inspect-baked",
        volumes_root=tmp_path / "volumes",
        extra=["--volume", f"{log}:{container['terminationMessagePath']}:rw"],
    )
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    ended = {"exitCode": 0, "message": log.read_text()}
    status = {"containerStatuses": [{"name": inspection.CONTAINER, "state": {"terminated": ended}}]}
    found = inspection.result(job, [{"metadata": {}, "status": status}], "ml", "baked-inspect", inspected)
    assert isinstance(found, ModelConfig), found
    here = inspect_folder(folder)
    assert not isinstance(here, tuple)
    assert found.architecture.checkpoint_bytes == 64
    assert found.architecture.model_copy(update={"source": ""}) == here.architecture.model_copy(update={"source": ""})
    assert found.architecture.source == "config.json of /inspected-image/srv/models/qwen3-8b"


def test_the_engine_image_downloads_into_the_model_cache_claim_and_serves_from_it(
    images: Images, tmp_path: Path
) -> None:
    """An hf:// source on a model.cache claim: the compile-cache and download init containers run in
    the engine image (`kvpilot download` from a hub stand-in on loopback), the engine reads the
    claim read-only and keeps its compile cache in its writable folder of it."""
    from kvpilot.engine.model.loader import embedded_model_dir

    repo = "HuggingFaceTB/SmolLM2-135M-Instruct"
    with HubServer(repo, embedded_model_dir()) as hub:
        spec = {
            **CPU_SPEC,
            "model": {"name": MODEL, "source": f"hf://{repo}", "cache": {"claimName": "models"}},
            "env": [{"name": "HF_ENDPOINT", "value": hub.url}],
        }
        with rendered_pod(images, "smollm2-hub", spec, tmp_path) as running:
            inits = [c["name"] for c in running.pod["initContainers"]]
            assert inits == ["compile-cache", "download"]
            claim = tmp_path / "volumes" / "models"
            served = claim / "hf" / f"{repo}@main"
            assert filecmp.cmp(served / "model.safetensors", embedded_model_dir() / "model.safetensors", shallow=False)
            uid = running.pod["securityContext"]["runAsUser"]
            assert (claim / "kvpilot-compiled").stat().st_uid == uid  # made by the init container, as the pod's user
            _check_as_rendered(running)
            wrote = running.engine.exec("touch", "/model-cache/written-by-the-test")
            assert wrote.returncode != 0 and "Read-only file system" in wrote.stderr
        weights = [r for r in hub.requests if r.method == "GET" and r.path.endswith("/model.safetensors")]
        assert len(weights) == 1


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
        # The gateway checks the key against the digest in the service's status, which its watch
        # brings a moment after Ready: wait until it lists the model to the key.
        base = in_gateway.base_url(namespace)

        def listed() -> bool | None:
            with httpx.Client(trust_env=False, timeout=10) as http:
                found = http.get(f"{base}/models", headers={"Authorization": f"Bearer {key}"})
            return found.status_code == 200 and MODEL in [m["id"] for m in found.json()["data"]] or None

        poll(listed, 30, f"the gateway listing {MODEL} to the service's key")
        assert _chat(base, key)
        with httpx.Client(trust_env=False, timeout=30) as http:
            assert http.get(in_operator.metrics_url).status_code == 200
    finally:
        assert engine.stop() == 0, engine.process.log_tail()
    # Both ran from the image, not from this checkout, as the chart's securityContext says.
    for component in (in_operator, in_gateway):
        assert component.container is not None and component.container.process.argv[0] == "podman"
        inspect = "{{.HostConfig.ReadonlyRootfs}} {{.Config.User}} {{.Image}}"
        found = images.run("inspect", "--format", inspect, component.container.name).stdout.split()
        assert found[0] == "true" and not found[1].startswith("0") and found[2] == images.operator, found
