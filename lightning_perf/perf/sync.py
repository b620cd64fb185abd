"""Host-device synchronisation sites: find them, name their kind, attribute them to a source line.

A sync is a point where the host waits for the accelerator. The kinds (``SYNC_KINDS``):

- ``pageable_h2d``: ``t.to("cuda", non_blocking=True)`` (or ``copy_``) from pageable host memory.
  The copy is synchronous despite ``non_blocking`` (pin the memory: ``DataLoader(pin_memory=True)``).
- ``h2d_copy``: a blocking host-to-device copy.
- ``d2h_copy``: a device-to-host copy (``.cpu()``, ``.to("cpu")``; a non-blocking one into
  pageable memory too).
- ``scalar``: a device value read on the host: ``.item()``, ``.tolist()``, ``bool(t)``,
  ``float(t)``, ``int(t)``, ``if t:``.
- ``data_dependent``: an op whose output size depends on the values: ``nonzero``, ``x[mask]``,
  ``masked_select``, ``unique``, ``repeat_interleave`` with tensor repeats.
- ``synchronize``: ``torch.cuda.synchronize()``, ``torch.accelerator.synchronize()``,
  ``Stream.synchronize()``, ``Event.synchronize()``.
- ``cuda_sync``: any other op that CUDA's sync debug mode reports.

Detectors, each scoped to a ``with`` block (nothing stays patched after it) and to the thread
that entered it:

* ``DispatchSyncDetector`` (a ``TorchDispatchMode``) classifies each aten op. ``level="full"``
  records every kind an op shows; ``level="copies"`` records only the non-blocking copies through
  pageable memory, which CUDA's debug mode does not report, and for the rest tells
  ``CudaSyncCatcher`` which op ran at which line.
* ``SyncCallCatcher`` wraps the calls that synchronise above the dispatcher:
  ``torch.cuda.synchronize``, ``torch.accelerator.synchronize``, ``torch.cuda.Stream.synchronize``,
  ``torch.cuda.Event.synchronize`` and ``Tensor.tolist`` (looked up at call time: a function
  imported by name before the block is not seen).
* ``CudaSyncCatcher`` turns on ``torch.cuda.set_sync_debug_mode("warn")`` and records each
  warning at its line, with the kind of the op the dispatch detector saw at that line.

``emulate_host=True`` (a CPU run) treats host tensors as if they lived on the accelerator, so a
laptop run names the sites a GPU run will hit: ``.item()``, ``.tolist()``, ``nonzero`` and masks of
host tensors count, and so do, in user code, ``.cpu()`` and ``.to(<host>)`` (a blocking copy: to
the host when the target is the string ``"cpu"`` or the tensor has autograd history, else from
it), ``.to(<host>, non_blocking=True)`` of pageable memory and ``torch.cpu.synchronize()``.
``SyncWatch`` composes the detectors for a run's device (``detector_plan``).

A site is the innermost stack frame outside torch, the standard library and the detectors; its ``owner`` is
``"lightning"`` (Lightning, Fabric, torchmetrics), ``"lightning_perf"`` (this package) or ``"user"``. For a
framework site the first user frame above it is kept as ``user_location``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import sysconfig
import threading
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "SYNC_KINDS",
    "DETECTORS",
    "SyncSite",
    "SyncPointError",
    "SyncRecorder",
    "DispatchSyncDetector",
    "SyncCallCatcher",
    "CudaSyncCatcher",
    "SyncWatch",
    "classify_op",
    "detector_plan",
    "find_site",
]

SYNC_KINDS: dict[str, str] = {
    "pageable_h2d": "non_blocking host-to-device copy from pageable memory (synchronous; pin the memory)",
    "h2d_copy": "blocking host-to-device copy",
    "d2h_copy": "device-to-host copy",
    "scalar": "device value read on the host (.item(), .tolist(), bool(), float(), int())",
    "data_dependent": "output size depends on the values (nonzero, boolean mask, masked_select, unique)",
    "synchronize": "explicit synchronize() of the device, a stream or an event",
    "cuda_sync": "another synchronizing CUDA op (CUDA's sync debug mode)",
}
DETECTORS = ("auto", "dispatch", "cuda", "both")


def _dir_of(module_name: str) -> Optional[str]:
    mod = sys.modules.get(module_name)
    path = getattr(mod, "__file__", None)
    return os.path.dirname(os.path.abspath(path)) + os.sep if path else None


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # lightning_perf/
_THIS_FILE = os.path.abspath(__file__)  # the detectors' own frames are never a site
_STDLIB = tuple(
    os.path.abspath(p) + os.sep for p in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]}
)


def _owner_dirs() -> tuple[tuple[str, str], ...]:
    # torchmetrics is Lightning's metric library: its logged results reset and reduce through it
    dirs = [(_dir_of(m), "lightning") for m in ("lightning", "pytorch_lightning", "lightning_fabric",
                                                 "lightning_utilities", "torchmetrics")]
    return tuple((d, owner) for d, owner in dirs if d) + ((_PACKAGE_DIR, "lightning_perf"),)


def _ignored_dirs() -> tuple[str, ...]:
    dirs = [_dir_of(m) for m in ("torch", "typing_extensions")]
    return tuple(d for d in dirs if d) + _STDLIB


@dataclass(kw_only=True)
class SyncSite:
    """One source line that synchronised, with its kind, how often and through which op."""

    location: str  # "path/to/file.py:42"
    function: str
    kind: str  # a key of SYNC_KINDS
    op: str
    owner: str  # "user", "lightning" or "lightning_perf"
    user_location: Optional[str] = None
    count: int = 0

    @property
    def framework(self) -> bool:
        return self.owner != "user"

    def describe(self) -> str:
        via = f", called from {self.user_location}" if self.framework and self.user_location else ""
        return f"{self.location} in {self.function}(): {self.kind}: {self.op} [{self.owner}{via}] x{self.count}"

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "framework": self.framework}


class SyncPointError(RuntimeError):
    """Raised at a user's synchronising line when the recorder runs with ``raise_on_user``."""


def find_site(frame: Any = None, *, kind: str = "cuda_sync", op: str = "") -> SyncSite:
    """Attribute a sync to the innermost frame outside torch and the standard library (module docstring)."""
    ignored, owners = _ignored_dirs(), _owner_dirs()
    f = frame if frame is not None else sys._getframe(1)
    site = user = None
    owner = "user"
    while f is not None:
        path = os.path.abspath(f.f_code.co_filename)
        if path == _THIS_FILE:
            f = f.f_back
            continue
        framework = next((name for d, name in owners if path.startswith(d)), None)
        if framework is not None:
            if site is None:
                site, owner = f, framework
        elif not path.startswith(ignored) and not f.f_code.co_filename.startswith("<"):
            site = site or f
            user = f
            break
        f = f.f_back
    if site is None:
        return SyncSite(location="<unknown>", function="?", kind=kind, op=op, owner="lightning")

    def loc(fr: Any) -> str:
        return f"{fr.f_code.co_filename}:{fr.f_lineno}"

    return SyncSite(location=loc(site), function=site.f_code.co_name, kind=kind, op=op,
                    owner=owner if site is not user else "user",
                    user_location=loc(user) if user is not None else None)


@dataclass(frozen=True)
class _Found:
    kind: str
    op: str
    debug_mode_sees: bool = True  # CUDA's sync debug mode reports it


@dataclass
class _InFlight:
    """The last classified op, for CudaSyncCatcher to label the warning it raises at the same line."""

    found: _Found
    location: str
    recorded: bool


class SyncRecorder:
    """Aggregates sites by (location, kind); calls ``on_new(site)`` the first time a site is seen.

    ``raise_on_user=True`` raises ``SyncPointError`` at a user site (after recording it).
    """

    def __init__(self, *, on_new: Optional[Callable[[SyncSite], None]] = None, raise_on_user: bool = False) -> None:
        self.sites: dict[tuple[str, str], SyncSite] = {}
        self.on_new = on_new
        self.raise_on_user = raise_on_user
        self.wants_labels = 0  # CudaSyncCatchers entered: the dispatch detector reports what runs where
        self._muted = 0
        self._in_flight: Optional[_InFlight] = None

    @property
    def is_muted(self) -> bool:
        return self._muted > 0

    @contextlib.contextmanager
    def muted(self) -> Iterator[None]:
        """Inside a wrapped call that was already recorded (or judged): its inner ops are not syncs of their own."""
        self._muted += 1
        try:
            yield
        finally:
            self._muted -= 1

    def record(self, kind: str, op: str, frame: Any = None, *, site: Optional[SyncSite] = None,
               user_only: bool = False) -> Optional[SyncSite]:
        if self.is_muted:
            return None
        found = site or find_site(frame if frame is not None else sys._getframe(1), kind=kind, op=op)
        found.kind, found.op = kind, op
        if user_only and found.framework:
            return None
        key = (found.location, kind)
        known = self.sites.get(key)
        if known is None:
            known = self.sites[key] = found
            if self.on_new is not None:
                self.on_new(known)
        known.count += 1
        if self.raise_on_user and not known.framework:
            raise SyncPointError(f"host-device synchronisation at {known.location} in {known.function}(): "
                                 f"{kind}: {op}")
        return known

    def note_in_flight(self, found: _Found, location: str, recorded: bool) -> None:
        self._in_flight = _InFlight(found, location, recorded)

    def take_in_flight(self, location: str) -> Optional[_InFlight]:
        flight, self._in_flight = self._in_flight, None
        return flight if flight is not None and flight.location == location else None

    def user_sites(self) -> list[SyncSite]:
        return [s for s in self.sites.values() if not s.framework]

    def framework_sites(self) -> list[SyncSite]:
        return [s for s in self.sites.values() if s.framework]


# ---- what an aten op does ----------------------------------------------------------------------

_DATA_DEPENDENT = {
    "nonzero": "nonzero",
    "nonzero_static": None,  # its size is given: no sync
    "masked_select": "masked_select",
    "_unique2": "unique",
    "unique_dim": "unique",
    "unique_consecutive": "unique_consecutive",
    "repeat_interleave": "repeat_interleave with tensor repeats",
}


def _pinned(t: torch.Tensor) -> bool:
    try:
        return bool(t.is_pinned())
    except RuntimeError:  # no accelerator to ask
        return False


def _bool_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 else []
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or [])


def _classify_copy(name: str, args: tuple, kwargs: dict) -> Optional[_Found]:
    if name == "copy_":
        if len(args) < 2 or not isinstance(args[1], torch.Tensor):
            return None
        dst, src = args[0], args[1]
        dst_device = dst.device
        non_blocking = bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking", False))
    else:
        src, device = args[0], kwargs.get("device")
        if not isinstance(src, torch.Tensor) or device is None:
            return None
        dst, dst_device = None, torch.device(device)
        non_blocking = bool(kwargs.get("non_blocking", False))
    op = f"aten.{name}"
    if src.device.type == "cpu" and dst_device.type != "cpu":
        if not non_blocking:
            return _Found("h2d_copy", f"{op}: blocking host-to-device copy")
        if not _pinned(src):
            return _Found("pageable_h2d", f"{op}: non_blocking host-to-device copy from pageable memory "
                                          "(the host waits; pin the memory)", debug_mode_sees=False)
    elif src.device.type != "cpu" and dst_device.type == "cpu":
        if not non_blocking:
            return _Found("d2h_copy", f"{op}: device-to-host copy")
        if dst is not None and not _pinned(dst):  # _to_copy pins its own output
            return _Found("d2h_copy", f"{op}: non_blocking device-to-host copy into pageable memory (synchronous)",
                          debug_mode_sees=False)
    return None


def classify_op(func: Any, args: tuple, kwargs: dict, *, emulate_host: bool = False) -> Optional[_Found]:
    """The sync an aten op would make on an accelerator, or ``None``.

    With ``emulate_host`` host tensors count as device tensors (a CPU run standing in for a GPU run).
    """
    name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)

    def on_device(t: Any) -> bool:
        return isinstance(t, torch.Tensor) and (emulate_host or t.device.type != "cpu")

    if name == "_local_scalar_dense":
        return _Found("scalar", "aten._local_scalar_dense: .item() / bool() / float() / int()") \
            if args and on_device(args[0]) else None
    if name in _DATA_DEPENDENT:
        what = _DATA_DEPENDENT[name]
        if what is None:
            return None
        if name == "repeat_interleave":
            overload = getattr(func, "_overloadname", "")
            if overload == "self_int" or kwargs.get("output_size") is not None:
                return None
        if any(on_device(a) for a in args):
            return _Found("data_dependent", f"aten.{name}: {what} (output size depends on the data)")
        return None
    if name in ("index", "index_put", "index_put_") and _bool_index(args) and args and on_device(args[0]):
        return _Found("data_dependent", f"aten.{name} with a boolean mask (output size depends on the data)")
    if name in ("_to_copy", "copy_") and args:
        return _classify_copy(name, args, kwargs)
    return None


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


class DispatchSyncDetector(TorchDispatchMode):
    """Classifies every aten op (any device, CPU included); ``level`` says which kinds it records itself.

    Ops inside ``torch.compile`` regions are not seen.
    """

    def __init__(self, recorder: SyncRecorder, *, level: str = "full", emulate_host: bool = False) -> None:
        super().__init__()
        if level not in ("full", "copies"):
            raise ValueError(f"level must be 'full' or 'copies', got {level!r}")
        self.recorder = recorder
        self.level = level
        self.emulate_host = emulate_host

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        recorder = self.recorder
        if not recorder.is_muted:
            found = classify_op(func, args, kwargs, emulate_host=self.emulate_host)
            if found is not None and not (self.emulate_host and _optimizer_host_scalar(sys._getframe(1), args)):
                now = self.level == "full" or not found.debug_mode_sees
                site = None
                if now or recorder.wants_labels:
                    site = find_site(sys._getframe(1), kind=found.kind, op=found.op)
                if now:
                    recorder.record(found.kind, found.op, site=site)
                if recorder.wants_labels and site is not None:
                    recorder.note_in_flight(found, site.location, recorded=now)
        return func(*args, **kwargs)


class _Patches:
    """Attributes replaced for the life of a ``with`` block, put back on exit."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any, bool]] = []

    def replace(self, owner: Any, attr: str, make: Callable[[Any], Any]) -> None:
        original = getattr(owner, attr)
        own = attr in vars(owner)
        self._saved.append((owner, attr, original, own))
        setattr(owner, attr, make(original))

    def restore(self) -> None:
        for owner, attr, original, own in reversed(self._saved):
            if own:
                setattr(owner, attr, original)
            else:
                delattr(owner, attr)
        self._saved.clear()


Judge = Callable[[tuple, dict], Optional[tuple[str, str]]]


class SyncCallCatcher:
    """Inside ``with``: the synchronising calls above the dispatcher go to ``recorder`` (module docstring)."""

    def __init__(self, recorder: SyncRecorder, *, emulate_host: bool = False) -> None:
        self.recorder = recorder
        self.emulate_host = emulate_host
        self._patches = _Patches()
        self._thread: Optional[int] = None

    def _wrap(self, owner: Any, attr: str, judge: Judge, *, user_only: bool = False) -> None:
        if not hasattr(owner, attr):
            return
        recorder, catcher = self.recorder, self

        def make(original: Any) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                if threading.get_ident() != catcher._thread or recorder.is_muted:
                    return original(*args, **kwargs)
                found = judge(args, kwargs)
                if found is not None:
                    recorder.record(found[0], found[1], sys._getframe(1), user_only=user_only)
                with recorder.muted():
                    return original(*args, **kwargs)

            return wrapper

        self._patches.replace(owner, attr, make)

    def __enter__(self) -> "SyncCallCatcher":
        self._thread = threading.get_ident()
        emulate = self.emulate_host

        def always(label: str) -> Judge:
            return lambda args, kwargs: ("synchronize", label)

        self._wrap(torch.cuda, "synchronize", always("torch.cuda.synchronize()"))
        self._wrap(torch.cuda.Stream, "synchronize", always("torch.cuda.Stream.synchronize()"))
        self._wrap(torch.cuda.Event, "synchronize", always("torch.cuda.Event.synchronize()"))
        if hasattr(torch, "accelerator"):
            self._wrap(torch.accelerator, "synchronize", always("torch.accelerator.synchronize()"))

        def tolist(args: tuple, kwargs: dict) -> Optional[tuple[str, str]]:
            t = args[0]
            return ("scalar", "Tensor.tolist()") if emulate or t.device.type != "cpu" else None

        self._wrap(torch.Tensor, "tolist", tolist)
        if emulate:
            self._wrap(torch.cpu, "synchronize", always("torch.cpu.synchronize() (torch.cuda.synchronize() on a GPU)"))
            self._wrap(torch.Tensor, "cpu", lambda args, kwargs: ("d2h_copy", "Tensor.cpu()"), user_only=True)
            self._wrap(torch.Tensor, "to", _judge_host_to, user_only=True)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._patches.restore()
        self._thread = None


def _judge_host_to(args: tuple, kwargs: dict) -> Optional[tuple[str, str]]:
    """``t.to(...)`` on a CPU run: the copy it would be on a GPU (``emulate_host``, module docstring)."""
    t = args[0]
    try:
        device, _, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
    except (TypeError, RuntimeError):
        return None
    if device is None or device.type != "cpu" or t.device.type != "cpu":
        return None  # a real transfer: the dispatch detector sees it
    if non_blocking:
        return None if _pinned(t) else ("pageable_h2d", "Tensor.to(device, non_blocking=True) from pageable memory "
                                                       "(the host waits; pin the memory)")
    target = args[1] if len(args) > 1 else kwargs.get("device")
    if target == "cpu" or t.grad_fn is not None or t.requires_grad:
        return "d2h_copy", "Tensor.to(host): device-to-host copy"
    return "h2d_copy", "Tensor.to(device): blocking host-to-device copy"


class CudaSyncCatcher:
    """Inside ``with``: CUDA's sync debug mode warns at every synchronizing op; each warning is recorded."""

    _MESSAGE = "called a synchronizing CUDA operation"

    def __init__(self, recorder: SyncRecorder) -> None:
        self.recorder = recorder
        self._warnings: Optional[warnings.catch_warnings] = None
        self._mode: Any = None
        self._thread: Optional[int] = None

    def _on_warning(self, frame: Any) -> None:
        site = find_site(frame)
        flight = self.recorder.take_in_flight(site.location)
        if flight is None:
            self.recorder.record("cuda_sync", "synchronizing CUDA op (sync debug mode)", site=site)
        elif not flight.recorded:
            self.recorder.record(flight.found.kind, flight.found.op, site=site)

    def __enter__(self) -> "CudaSyncCatcher":
        self._thread = threading.get_ident()
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.filterwarnings("always", message=f".*{self._MESSAGE}.*")
        original_show = warnings.showwarning
        marker, catcher = self._MESSAGE, self

        def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
            if marker in str(message) and threading.get_ident() == catcher._thread:
                catcher._on_warning(sys._getframe(1))
            elif marker not in str(message):
                original_show(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        self.recorder.wants_labels += 1
        self._mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.cuda.set_sync_debug_mode(self._mode if self._mode is not None else 0)
        self.recorder.wants_labels -= 1
        if self._warnings is not None:
            self._warnings.__exit__(*exc)
            self._warnings = None
        self._thread = None


def detector_plan(detector: str, device_type: str) -> tuple[bool, str, bool]:
    """``(cuda debug mode, dispatch level, emulate_host)`` for a detector name on a device.

    ``auto`` is ``cuda`` on a CUDA device, else ``dispatch``. ``cuda`` = the debug mode, the call
    wrappers and a dispatch check of the copies it misses; ``dispatch`` = every op classified
    (host tensors standing in for device tensors on a CPU); ``both`` = the debug mode and every op.
    """
    if detector not in DETECTORS:
        raise ValueError(f"detector must be one of {DETECTORS}, got {detector!r}")
    choice = detector if detector != "auto" else ("cuda" if device_type == "cuda" else "dispatch")
    if choice in ("cuda", "both") and device_type != "cuda":
        raise ValueError(f"detector={detector!r} needs a CUDA device (this run is on {device_type!r}); "
                         "use 'dispatch' or 'auto'")
    if choice == "dispatch":
        return False, "full", device_type == "cpu"
    return True, "copies" if choice == "cuda" else "full", False


class SyncWatch:
    """The detectors a run needs (``detector_plan``), entered and left together."""

    def __init__(self, recorder: SyncRecorder, *, device_type: str, detector: str = "auto") -> None:
        self.recorder = recorder
        self.cuda, self.level, self.emulate_host = detector_plan(detector, device_type)
        self._entered: list[Any] = []

    def __enter__(self) -> "SyncWatch":
        parts: list[Any] = [SyncCallCatcher(self.recorder, emulate_host=self.emulate_host)]
        if self.cuda:
            parts.append(CudaSyncCatcher(self.recorder))
        parts.append(DispatchSyncDetector(self.recorder, level=self.level, emulate_host=self.emulate_host))
        try:
            for part in parts:
                part.__enter__()
                self._entered.append(part)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        while self._entered:
            self._entered.pop().__exit__(None, None, None)
        self.recorder.take_in_flight("")
