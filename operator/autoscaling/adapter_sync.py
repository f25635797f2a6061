"""LoRA adapters on running engines: every autoscaler period, for each InferenceService with
spec.adapters, read what each ready engine pod holds (`GET /v1/models`: the entries with a
`parent`, the base model), load what it lacks and unload what was removed, through the runtime
API vLLM serves with VLLM_ALLOW_RUNTIME_LORA_UPDATING and our engine serves as vLLM does
(`POST /v1/load_lora_adapter`, `/v1/unload_lora_adapter`), and write status.adapters when it
changed. No pod restarts. A pod of a service with adapters carries a readiness gate
(`kvpilot.dev/adapters-loaded`, render.py): its engine answers (its containers are ready) but
Kubernetes keeps it out of the Service until this sync has tried every adapter there and set the
gate's condition on the pod, so a pod started later serves only once it holds the list; the gateway
routes an adapter's requests by status.adapters[].loadedOn besides.

What to call is decided by adapters.py (pure); this module is the I/O. The engines require the
service's API key on /v1 (auth.apiKey), so it is read once from the Secret the status names and
kept while status.auth.apiKeySha256 stays the same. Every call has a total deadline, follows no
redirect and reads a bounded answer, as the /metrics reads do (loop.py). A load the engine refuses
(a malformed adapter, a rank above max_lora_rank) or that fails is an error on that adapter and
pod, in the status and retried after a backoff; the other adapters and pods go on.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import aiohttp
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvpilot.operator.api.names import API_KEY_SECRET_KEY, API_VERSION, KIND
from kvpilot.operator.api.spec import InferenceServiceSpec
from kvpilot.operator.api.status import status_of
from kvpilot.operator.autoscaling.adapters import (
    Failures,
    Step,
    adapter_rows,
    gate_condition,
    gate_written,
    steps,
    wanted,
)
from kvpilot.operator.kube.cluster import WriteConflict, WriteRefused
from kvpilot.operator.kube.indexes import started_engine_urls

# /v1/models and an unload answer at once; a load reads the adapter's files (and vLLM may fetch a
# hub repository), so it gets longer.
CALL_TIMEOUT_SECONDS = 3.0
LOAD_TIMEOUT_SECONDS = 60.0
# A model list of a few dozen adapters is a few KiB; anything far larger is not one.
MAX_ANSWER_BYTES = 1024 * 1024
STATUS_KEY = "adapters"

log = logging.getLogger(__name__)


class EngineModel(BaseModel):
    """One entry of an engine's /v1/models (ours and vLLM's): an adapter has the base model as
    `parent` and the path it was loaded from as `root`."""

    model_config = ConfigDict(extra="ignore")

    id: str
    parent: str | None = None
    root: str | None = None


class EngineModels(BaseModel):
    model_config = ConfigDict(extra="ignore")

    data: list[EngineModel] = Field(max_length=10_000)


class LoadAdapter(BaseModel):
    """POST /v1/load_lora_adapter's body (vLLM's LoadLoRAAdapterRequest)."""

    lora_name: str
    lora_path: str
    # In place of the adapter served under this name (vLLM's and ours: the old one serves on if
    # the new one fails), for a source that changed.
    load_inplace: bool = False


class UnloadAdapter(BaseModel):
    """POST /v1/unload_lora_adapter's body (vLLM's UnloadLoRAAdapterRequest)."""

    lora_name: str


class CallFailed(Exception):
    """An engine call that did not succeed, and why (for the status); `status`: the engine's HTTP
    answer, None when there was none."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status

    @property
    def refused(self) -> bool:
        """The engine said no to the call itself: not a 503 (not ready yet) and not silence."""
        return self.status is not None and self.status != 503


class StatusWriter(Protocol):
    def patch_status(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        patch: dict[str, Any],
        resource_version: str | None = None,
    ) -> str: ...

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None: ...

    def set_pod_condition(self, namespace: str, name: str, condition: dict[str, Any]) -> None: ...


def _message(status: int, body: bytes) -> str:
    """An engine's refusal for people: its OpenAI-shaped error message, else the start of its body."""
    try:
        text = str(json.loads(body)["error"]["message"])
    except (ValueError, TypeError, KeyError):
        text = body[:300].decode("utf-8", errors="replace").strip()
    return f"HTTP {status}: {text}" if text else f"HTTP {status}"


async def call(
    session: aiohttp.ClientSession,
    url: str,
    key: str | None,
    body: BaseModel | None = None,
    deadline: float = CALL_TIMEOUT_SECONDS,
) -> bytes:
    """The answer to a GET (`body` None) or a JSON POST of `url`, within `deadline` seconds in all,
    no redirect followed; CallFailed unless the engine answered 200."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    method, data = ("GET", None) if body is None else ("POST", body.model_dump(mode="json"))
    try:
        async with (
            asyncio.timeout(deadline),
            session.request(method, url, json=data, headers=headers, allow_redirects=False) as response,
        ):
            answer = await response.content.read(MAX_ANSWER_BYTES + 1)
            if response.status != 200:
                raise CallFailed(_message(response.status, answer), response.status)
            if len(answer) > MAX_ANSWER_BYTES:
                raise CallFailed(f"the answer is larger than {MAX_ANSWER_BYTES} bytes")
            return answer
    except TimeoutError:
        raise CallFailed(f"no complete answer within {deadline:g} s") from None
    except (aiohttp.ClientError, OSError, ValueError) as error:
        raise CallFailed(f"{type(error).__name__}: {error}") from None


async def held_by(session: aiohttp.ClientSession, base_url: str, key: str | None) -> dict[str, str]:
    """name -> path of the adapters an engine serves (its /v1/models entries with a parent)."""
    answer = await call(session, f"{base_url}/v1/models", key)
    try:
        models = EngineModels.model_validate_json(answer)
    except ValidationError as error:
        raise CallFailed(f"/v1/models is not a model list: {error.errors()[0]['msg']}") from None
    return {m.id: m.root or "" for m in models.data if m.parent is not None}


async def apply(session: aiohttp.ClientSession, base_url: str, key: str | None, step: Step) -> None:
    """One load or unload on an engine (CallFailed: the engine's refusal or why there was none)."""
    if step.action == "unload":
        await call(session, f"{base_url}/v1/unload_lora_adapter", key, UnloadAdapter(lora_name=step.name))
        return
    assert step.path is not None  # steps() gives every load a path
    body = LoadAdapter(lora_name=step.name, lora_path=step.path, load_inplace=step.action == "reload")
    await call(session, f"{base_url}/v1/load_lora_adapter", key, body, LOAD_TIMEOUT_SECONDS)


def secret_key(secret: Mapping[str, Any] | None) -> str | None:
    """The API key in the service's Secret (data.api-key, base64 UTF-8); None when there is none."""
    try:
        text = base64.b64decode(((secret or {}).get("data") or {}).get(API_KEY_SECRET_KEY) or "", validate=True)
        return text.decode() or None
    except (binascii.Error, UnicodeDecodeError):
        return None


class AdapterSync:
    """Keeps every ready engine pod of each service holding exactly its spec.adapters. `cluster`
    reads the API-key Secret and writes the status (blocking: used from threads); `http` gives the
    loop's client session. Failed loads and the keys read are kept per service in this process."""

    def __init__(self, cluster: StatusWriter, http: Callable[[], aiohttp.ClientSession]) -> None:
        self.cluster = cluster
        self._http = http
        self._failures: dict[tuple[str, str], Failures] = {}
        self._keys: dict[tuple[str, str], tuple[str, str | None]] = {}

    async def sync(self, body: Mapping[str, Any], pods: Sequence[Mapping[str, Any]], now: float) -> None:
        """One period of one InferenceService (its engine pods as the indexes hold them)."""
        metadata = body["metadata"]
        where = (metadata["namespace"], metadata["name"])
        try:
            spec = InferenceServiceSpec.model_validate(body.get("spec") or {})
        except ValidationError:
            return  # the reconcile says why; nothing to load from a spec that does not read
        stored = (body.get("status") or {}).get(STATUS_KEY)
        if not spec.adapters:
            self._failures.pop(where, None)
            if stored:
                await asyncio.to_thread(self._write, metadata, None)
            return
        want, key = wanted(spec.adapters), await asyncio.to_thread(self._api_key, body)
        failures = self._failures.setdefault(where, Failures())
        targets = started_engine_urls(pods)
        held = dict(await asyncio.gather(*(self._pod(name, url, key, want, failures, now) for name, url in targets)))
        await self._open_gates(metadata["namespace"], pods, want, held, failures, now)
        failures.keep_only(want, held)
        rows = adapter_rows(spec.adapters, held, failures)
        if rows != stored:
            await asyncio.to_thread(self._write, metadata, rows)

    async def _pod(
        self, pod: str, url: str, key: str | None, want: Mapping[str, str], failures: Failures, now: float
    ) -> tuple[str, dict[str, str] | None]:
        """(pod, what it holds after this period's calls), None for a pod that could not be read."""
        session = self._http()
        try:
            held = await held_by(session, url, key)
        except CallFailed as error:
            failures.unread(pod, list(want), now, f"its adapters could not be read: {error}")
            return pod, None
        for step in steps(want, held):
            if step.action != "unload" and not failures.due(pod, step.name, now):
                continue
            try:
                await apply(session, url, key, step)
            except CallFailed as error:
                log.info(f"adapters: pod {pod}: {step.action} {step.name} ({step.path}) failed: {error}")
                if step.action != "unload":
                    failures.failed(pod, step.name, now, f"{step.action} from {step.path}: {error}", error.refused)
                continue
            if step.action == "unload":
                held.pop(step.name, None)
            else:
                held[step.name] = step.path or ""
        return pod, held

    async def _open_gates(
        self,
        namespace: str,
        pods: Sequence[Mapping[str, Any]],
        want: Mapping[str, str],
        held: Mapping[str, dict[str, str] | None],
        failures: Failures,
        now: float,
    ) -> None:
        """Set the readiness gate of each pod that has now been given every adapter (a refused
        write is tried again next period: the pod stays out of the Service meanwhile)."""
        for pod in pods:
            name = pod["metadata"]["name"]
            condition = None if gate_written(pod) else gate_condition(name, want, held.get(name), failures, now)
            if condition is None:
                continue
            try:
                await asyncio.to_thread(self.cluster.set_pod_condition, namespace, name, condition)
            except (WriteConflict, WriteRefused) as error:
                log.info(f"adapters: pod {name}: its readiness gate could not be set: {error}")

    def _api_key(self, body: Mapping[str, Any]) -> str | None:
        """The key the engines require (None where the operator keeps none: auth.apiKey false), from
        the Secret status.auth names, read again only when the key's SHA-256 there changes."""
        auth = status_of(body).auth
        if auth is None or not auth.api_key_sha256 or not auth.secret_name:
            return None
        where = (body["metadata"]["namespace"], body["metadata"]["name"])
        cached = self._keys.get(where)
        if cached is not None and cached[0] == auth.api_key_sha256:
            return cached[1]
        key = secret_key(self.cluster.get("v1", "Secret", where[0], auth.secret_name))
        if key is not None and hashlib.sha256(key.encode()).hexdigest() == auth.api_key_sha256:
            self._keys[where] = (auth.api_key_sha256, key)
        return key

    def _write(self, metadata: Mapping[str, Any], rows: list[dict[str, Any]] | None) -> None:
        # No resourceVersion: status.adapters is this writer's alone and replaced whole (a merge
        # patch replaces lists), from a read of the pods that is newer than any object version.
        self.cluster.patch_status(API_VERSION, KIND, metadata["namespace"], metadata["name"], {STATUS_KEY: rows})
