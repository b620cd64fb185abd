"""Host-device synchronisation sites: detect them, attribute them to a source line.

Two detectors, both scoped to a ``with`` block (nothing stays patched after it):

* ``DispatchSyncDetector`` (a ``TorchDispatchMode``) sees the aten ops that must
  synchronise on an accelerator: ``.item()`` / ``bool(t)`` / ``float(t)``
  (``_local_scalar_dense``), ``nonzero``, boolean-mask indexing, ``masked_select``,
  ``unique``, device-to-host copies and non-blocking copies from pageable host memory.
  It works on CPU, so a run on a laptop shows the sites a GPU run will hit.
* ``CudaSyncCatcher`` turns on ``torch.cuda.set_sync_debug_mode("warn")`` and wraps
  ``torch.cuda.synchronize`` and ``Event``/``Stream.synchronize``, which the debug mode
  does not report.

A site is the innermost stack frame outside torch and the standard library. When that
frame belongs to Lightning or to this package the sync is the framework's (Lightning's
per-step broadcast, the progress bar, ``self.log(sync_dist=True)``); the first frame
outside torch, Lightning and this package is kept beside it as the user's line.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["SyncSite", "SyncPointError", "SyncRecorder", "DispatchSyncDetector", "CudaSyncCatcher", "find_site"]


def _dir_of(module_name: str) -> Optional[str]:
    mod = sys.modules.get(module_name)
    path = getattr(mod, "__file__", None)
    return os.path.dirname(os.path.abspath(path)) + os.sep if path else None


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # lightning_perf/
_STDLIB = tuple(
    os.path.abspath(p) + os.sep for p in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]}
)


def _framework_dirs() -> tuple[str, ...]:
    dirs = [_dir_of(m) for m in ("lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities")]
    return tuple(d for d in dirs if d) + (_PACKAGE_DIR,)


def _ignored_dirs() -> tuple[str, ...]:
    dirs = [_dir_of(m) for m in ("torch", "typing_extensions")]
    return tuple(d for d in dirs if d) + _STDLIB


@dataclass(kw_only=True)
class SyncSite:
    """One source line that synchronised, with how often and through which op."""

    location: str  # "path/to/file.py:42"
    function: str
    op: str
    framework: bool
    user_location: Optional[str] = None
    count: int = 0

    def describe(self) -> str:
        who = "framework" if self.framework else "user"
        via = f" (called from {self.user_location})" if self.framework and self.user_location else ""
        return f"{self.location} in {self.function}(): {self.op} [{who}{via}] x{self.count}"


class SyncPointError(RuntimeError):
    """Raised at a user's synchronising line when the warner runs in ``error`` mode."""


def find_site(op: str, frame: Any = None) -> SyncSite:
    """Attribute a sync to the innermost frame outside torch/stdlib (see the module docstring)."""
    ignored, framework = _ignored_dirs(), _framework_dirs()
    f = frame if frame is not None else sys._getframe(1)
    site = user = None
    while f is not None:
        path = os.path.abspath(f.f_code.co_filename)
        if path.startswith(framework):
            site = site or f
        elif not path.startswith(ignored) and not f.f_code.co_filename.startswith("<"):
            site = site or f
            user = f
            break
        f = f.f_back
    if site is None:
        return SyncSite(location="<unknown>", function="?", op=op, framework=True)

    def loc(fr: Any) -> str:
        return f"{fr.f_code.co_filename}:{fr.f_lineno}"

    is_framework = site is not user
    return SyncSite(
        location=loc(site),
        function=site.f_code.co_name,
        op=op,
        framework=is_framework,
        user_location=loc(user) if user is not None else None,
    )


class SyncRecorder:
    """Aggregates sites by location; calls ``on_new(site)`` the first time a site is seen.

    ``raise_on_user=True`` raises ``SyncPointError`` at a user site (after recording it).
    """

    def __init__(self, *, on_new: Optional[Callable[[SyncSite], None]] = None, raise_on_user: bool = False) -> None:
        self.sites: dict[tuple[str, str], SyncSite] = {}
        self.on_new = on_new
        self.raise_on_user = raise_on_user

    def record(self, op: str, frame: Any = None) -> SyncSite:
        found = find_site(op, frame if frame is not None else sys._getframe(1))
        key = (found.location, found.op)
        site = self.sites.get(key)
        if site is None:
            site = self.sites[key] = found
            if self.on_new is not None:
                self.on_new(site)
        site.count += 1
        if self.raise_on_user and not site.framework:
            raise SyncPointError(f"host-device synchronisation at {site.location} in {site.function}(): {op}")
        return site

    def user_sites(self) -> list[SyncSite]:
        return [s for s in self.sites.values() if not s.framework]

    def framework_sites(self) -> list[SyncSite]:
        return [s for s in self.sites.values() if s.framework]


_SCALAR_OPS = {"_local_scalar_dense": ".item() / bool() / float() on a tensor"}
_DATA_DEPENDENT = {
    "nonzero": "nonzero (output size depends on the data)",
    "masked_select": "masked_select (output size depends on the data)",
    "_unique2": "unique (output size depends on the data)",
    "unique_dim": "unique (output size depends on the data)",
    "unique_consecutive": "unique_consecutive (output size depends on the data)",
    "repeat_interleave": "repeat_interleave with tensor repeats",
}


def _bool_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 else []
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or [])


class DispatchSyncDetector(TorchDispatchMode):
    """Reports ops that synchronise on an accelerator, on any device (CPU included)."""

    def __init__(self, recorder: SyncRecorder) -> None:
        super().__init__()
        self.recorder = recorder

    def _describe(self, func: Any, args: tuple, kwargs: dict) -> Optional[str]:
        name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
        if name in _SCALAR_OPS:
            return _SCALAR_OPS[name]
        if name in _DATA_DEPENDENT:
            if name == "repeat_interleave" and not (args and isinstance(args[0], torch.Tensor) and args[0].dim() == 1
                                                    and len(args) == 1):
                return None
            return _DATA_DEPENDENT[name]
        if name in ("index", "index_put", "index_put_") and _bool_index(args):
            return f"{name} with a boolean mask (output size depends on the data)"
        if name in ("_to_copy", "copy_"):
            src = args[1] if name == "copy_" else args[0]
            dst_device = args[0].device if name == "copy_" else kwargs.get("device")
            if not isinstance(src, torch.Tensor) or dst_device is None:
                return None
            dst = torch.device(dst_device)
            if src.device.type != "cpu" and dst.type == "cpu":
                return "device-to-host copy"
            if src.device.type == "cpu" and dst.type != "cpu" and kwargs.get("non_blocking", False) \
                    and not src.is_pinned():
                return "non_blocking host-to-device copy from pageable memory (blocks the host)"
        return None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        what = self._describe(func, args, kwargs)
        if what is not None and not _optimizer_host_scalar(sys._getframe(1), args):
            self.recorder.record(f"{func} : {what}", sys._getframe(1))
        return func(*args, **kwargs)


_OPTIM_DIR = os.sep + os.path.join("torch", "optim") + os.sep


def _optimizer_host_scalar(frame: Any, args: tuple) -> bool:
    """``.item()`` of a CPU scalar inside ``torch.optim`` (e.g. Adam's step count): a host value on GPU too."""
    if not (args and isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu" and args[0].numel() == 1):
        return False
    for _ in range(8):  # through torch's wrappers (dynamo's disable, _compile) to the optimizer's frame
        if frame is None:
            return False
        if _OPTIM_DIR in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


class CudaSyncCatcher:
    """Inside ``with``: CUDA sync debug warnings and explicit synchronize calls go to ``recorder``."""

    _MESSAGE = "called a synchronizing CUDA operation"

    def __init__(self, recorder: SyncRecorder) -> None:
        self.recorder = recorder
        self._saved: list[tuple[Any, str, Any]] = []
        self._warnings: Optional[warnings.catch_warnings] = None
        self._mode: Any = None

    def _wrap(self, owner: Any, attr: str, label: str) -> None:
        original = getattr(owner, attr)
        recorder = self.recorder

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            recorder.record(label, sys._getframe(1))
            return original(*args, **kwargs)

        self._saved.append((owner, attr, original))
        setattr(owner, attr, wrapper)

    def __enter__(self) -> "CudaSyncCatcher":
        self._wrap(torch.cuda, "synchronize", "torch.cuda.synchronize()")
        self._wrap(torch.cuda.Event, "synchronize", "torch.cuda.Event.synchronize()")
        self._wrap(torch.cuda.Stream, "synchronize", "torch.cuda.Stream.synchronize()")
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.filterwarnings("always", message=f".*{self._MESSAGE}.*")
        original_show = warnings.showwarning
        recorder, marker = self.recorder, self._MESSAGE

        def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
            if marker in str(message):
                recorder.record("synchronizing CUDA op (sync debug mode)", sys._getframe(1))
            else:
                original_show(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        self._mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.cuda.set_sync_debug_mode(self._mode if self._mode is not None else 0)
        if self._warnings is not None:
            self._warnings.__exit__(*exc)
        for owner, attr, original in reversed(self._saved):
            setattr(owner, attr, original)
        self._saved.clear()


def iter_sites(recorder: SyncRecorder) -> Iterator[SyncSite]:
    return iter(sorted(recorder.sites.values(), key=lambda s: -s.count))
