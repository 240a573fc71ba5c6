"""The model repository in Triton's layout: <root>/<model>/config.pbtxt and <v>/model.onnx.

The repository is the one place that changes which versions serve. A (re)load builds the new
versions first and swaps them in only once READY, then unloads the versions they replace after
their requests in flight finish; a failed new version leaves the old one serving.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from tritonclient.grpc import model_config_pb2

from model_server.core.errors import (
    InferenceError,
    InvalidInput,
    MemoryBudgetExceeded,
    ModelConfigError,
    ModelNotFound,
    ModelUnavailable,
)
from model_server.core.memory import MemoryGuard
from model_server.core.model_config import (
    CONFIG_FILES,
    model_filename,
    read_declared_config,
    select_versions,
)
from model_server.core.runtime import DeviceChoice
from model_server.core.validation import is_decimal
from model_server.lifecycle.version import ModelState, ModelVersion
from model_server.observability.metrics import ServerMetrics

log = logging.getLogger(__name__)


class ModelLoadError(InferenceError):
    """A load or reload did not make every selected version READY."""


@dataclass(frozen=True)
class IndexEntry:
    name: str
    version: str
    state: str
    reason: str


@dataclass
class ModelEntry:
    """A model known to the server: the versions that serve, and those that failed."""

    name: str
    config: model_config_pb2.ModelConfig | None = None
    serving: dict[int, ModelVersion] = field(default_factory=dict)
    failed: dict[int, ModelVersion] = field(default_factory=dict)
    loading: dict[int, ModelVersion] = field(default_factory=dict)  # not routed to yet
    error: str = ""  # a model-level failure (bad config, no versions)
    published: dict[int, str | None] = field(default_factory=dict)  # version -> provider label
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def visible(self) -> list[ModelVersion]:
        """One version object per number, as clients see it: serving, else loading, else failed."""
        shown = {**self.failed, **self.loading, **self.serving}
        return [shown[v] for v in sorted(shown)]

    def newest_ready(self) -> ModelVersion | None:
        ready = [v for v in self.serving.values() if v.state is ModelState.READY]
        return max(ready, key=lambda v: v.version, default=None)


def check_model_name(name: str) -> None:
    """A model is a directory right under the repository: its name is one path component.
    ``root / "/srv/x"`` is ``/srv/x`` and ``root / "../x"`` is outside, so a load naming either
    would serve a model from anywhere the server can read."""
    if not name or name in (".", "..") or any(c in name for c in "/\\\0") or len(name) > 255:
        raise InvalidInput(
            f"model name {name[:80]!r}: expected the name of a directory in the repository "
            "(1-255 characters, no '/', '\\' or NUL, not '.' or '..')"
        )


def _fingerprint(paths: Iterable[Path]) -> str:
    digest = hashlib.sha256()
    for path in sorted(paths):
        if path.is_file():
            stat = path.stat()
            digest.update(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


class ModelRepository:
    def __init__(
        self, root: Path, device: DeviceChoice, guard: MemoryGuard, metrics: ServerMetrics
    ) -> None:
        self.root = root
        self.device = device
        self.guard = guard
        self.metrics = metrics
        self.models: dict[str, ModelEntry] = {}
        self._retiring: set[asyncio.Task[None]] = set()

    # -- discovery ---------------------------------------------------------------------------
    def names_on_disk(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(
            p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")
        )

    def _version_dirs(self, model_dir: Path, filename: str) -> dict[int, Path]:
        found = {}
        for child in model_dir.iterdir():
            if child.is_dir() and is_decimal(child.name) and (child / filename).is_file():
                found[int(child.name)] = child / filename
        return found

    def model_fingerprint(self, name: str) -> str:
        """Changes when the model's config or any of its version files change (for polling)."""
        model_dir = self.root / name
        files = [model_dir / f for f in CONFIG_FILES]
        if model_dir.is_dir():
            files += [p for p in model_dir.glob("*/*") if p.is_file()]
        return _fingerprint(files)

    # -- load / unload ------------------------------------------------------------------------
    def _entry(self, name: str) -> ModelEntry:
        return self.models.setdefault(name, ModelEntry(name))

    async def load(self, name: str, override: model_config_pb2.ModelConfig | None = None) -> None:
        """Loads or reloads ``name``; raises ModelLoadError naming every failure."""
        check_model_name(name)
        model_dir = self.root / name
        if override is None and not model_dir.is_dir():
            raise ModelNotFound(f"model {name!r} is not in the repository {self.root}")
        entry = self._entry(name)
        async with entry.lock:
            try:
                config = override if override is not None else read_declared_config(model_dir)
                filename = model_filename(config)
                on_disk = self._version_dirs(model_dir, filename) if model_dir.is_dir() else {}
                if not on_disk:
                    raise ModelConfigError(f"no version directory holds {filename}")
                wanted = select_versions(config, list(on_disk))
            except ModelConfigError as exc:
                entry.error = str(exc)
                log.error("model %r: FAILED (%s)", name, exc)
                raise ModelLoadError(
                    f"model {name!r}: {exc}", grpc.StatusCode.INVALID_ARGUMENT
                ) from exc
            entry.error = ""
            entry.config = config
            await self._load_versions(entry, config, {v: on_disk[v] for v in wanted})

    async def _load_versions(
        self, entry: ModelEntry, config: model_config_pb2.ModelConfig, paths: dict[int, Path]
    ) -> None:
        config_key = config.SerializeToString(deterministic=True)
        candidates: list[ModelVersion] = []
        for version, path in sorted(paths.items()):
            fingerprint = _fingerprint([path]) + hashlib.sha256(config_key).hexdigest()[:8]
            current = entry.serving.get(version)
            if current is not None and current.fingerprint == fingerprint:
                continue  # unchanged: keep serving it
            candidate = ModelVersion(
                entry.name,
                version,
                path,
                config,
                fingerprint,
                self.device,
                self.metrics,
                on_state_change=lambda: self._publish(entry),
            )
            candidates.append(candidate)
        failures = []
        out_of_memory = False
        entry.loading = {c.version: c for c in candidates}
        self._publish(entry)
        for candidate in candidates:  # one at a time: each load is checked against memory
            await candidate.load(self.guard)
            entry.loading.pop(candidate.version, None)
            if candidate.state is ModelState.READY:
                entry.failed.pop(candidate.version, None)
                self._retire(entry.serving.get(candidate.version))
                entry.serving[candidate.version] = candidate
            else:
                entry.failed[candidate.version] = candidate
                failures.append(f"version {candidate.version}: {candidate.reason}")
                out_of_memory |= candidate.reason.startswith(MemoryBudgetExceeded.__name__)
        for version in sorted(set(entry.serving) - set(paths)):
            self._retire(entry.serving.pop(version))
        for version in sorted(set(entry.failed) - set(paths)):
            entry.failed.pop(version)
        self._publish(entry)
        if failures:
            code = grpc.StatusCode.RESOURCE_EXHAUSTED if out_of_memory else grpc.StatusCode.INTERNAL
            raise ModelLoadError(f"model {entry.name!r}: " + "; ".join(failures), code)

    def _publish(self, entry: ModelEntry) -> None:
        """Sets model_state and the provider label from what clients see of each version."""
        self.metrics.queue_depth.labels(entry.name).set_function(
            lambda: sum(v.waiting for v in entry.serving.values())
        )
        shown = {v.version: v for v in entry.visible()}
        for number in sorted(set(entry.published) - set(shown)):
            self.metrics.clear_model_version(entry.name, str(number), entry.published.pop(number))
        for number, version in shown.items():
            ready = version.state is ModelState.READY and version.session is not None
            provider = version.session.provider if ready and version.session else None
            self.metrics.publish_model_version(
                entry.name, str(number), version.state.value, provider, entry.published.get(number)
            )
            entry.published[number] = provider

    def _retire(self, version: ModelVersion | None) -> None:
        """Unloads a version that no longer routes, once its requests in flight finish."""
        if version is None:
            return
        task = asyncio.get_running_loop().create_task(version.unload())
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def unload(self, name: str) -> None:
        entry = self.models.get(name)
        if entry is None:
            raise ModelNotFound(f"model {name!r} is not loaded")
        async with entry.lock:
            retiring = list(entry.serving.values())
            entry.serving.clear()
            entry.failed.clear()
            entry.error = ""
            await asyncio.gather(*(v.unload() for v in retiring))

    # -- lookup -------------------------------------------------------------------------------
    def resolve(self, name: str, version: str) -> ModelVersion:
        """The version that serves a request: the newest READY one when ``version`` is empty."""
        entry = self.models.get(name)
        if entry is not None:  # the path every request takes; errors are worked out below
            if not version:
                newest = entry.newest_ready()
                if newest is not None:
                    return newest
            elif is_decimal(version):
                chosen = entry.serving.get(int(version))
                if chosen is not None and chosen.state is ModelState.READY:
                    return chosen
        if entry is None or (not entry.visible() and not entry.error):
            raise ModelNotFound(f"model {name!r} is not loaded (loaded: {self.loaded_names()})")
        if version:
            if not is_decimal(version):
                raise InvalidInput(f"model {name!r}: version {version!r} is not a number")
            chosen = next((v for v in entry.visible() if v.version == int(version)), None)
            if chosen is None:
                raise ModelNotFound(
                    f"model {name!r} has no version {version} "
                    f"(available: {sorted(entry.serving) or 'none'})"
                )
            if chosen.state is not ModelState.READY:
                raise ModelUnavailable(f"{chosen.label} is {chosen.state.value}: {chosen.reason}")
            return chosen
        newest = entry.newest_ready()
        if newest is None:
            states = {
                v.version: v.state.value for v in [*entry.serving.values(), *entry.failed.values()]
            }
            detail = entry.error or f"version states {states}"
            raise ModelUnavailable(f"model {name!r} has no READY version ({detail})")
        return newest

    def loaded_names(self) -> list[str]:
        return sorted(n for n, e in self.models.items() if e.serving)

    def is_ready(self, name: str) -> bool:
        entry = self.models.get(name)
        return entry is not None and entry.newest_ready() is not None

    def index(self, ready_only: bool = False) -> list[IndexEntry]:
        rows: list[IndexEntry] = []
        for name in sorted(set(self.names_on_disk()) | set(self.models)):
            entry = self.models.get(name)
            versions = entry.visible() if entry else []
            if entry is not None and entry.error:
                rows.append(IndexEntry(name, "", ModelState.FAILED.value, entry.error))
            elif not versions:
                rows.append(IndexEntry(name, "", ModelState.UNAVAILABLE.value, "not loaded"))
            for v in versions:
                rows.append(IndexEntry(name, str(v.version), v.state.value, v.reason))
        if ready_only:
            rows = [r for r in rows if r.state == ModelState.READY.value]
        return rows

    def all_versions(self) -> list[ModelVersion]:
        return [v for e in self.models.values() for v in e.serving.values()]
