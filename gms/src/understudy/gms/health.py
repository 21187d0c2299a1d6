"""A GPU's identity, memory and health from NVML (nvidia-ml-py), optional.

GMS reports what a GPU user expects next to its own state: the device's
UUID and name, the memory in use on it (by every process, not only ours),
and whether it is healthy. Unhealthy means one of:

  - an Xid error that is not the application's own fault (the Xids NVIDIA's
    Kubernetes device plugin also skips, ``APPLICATION_XIDS``, leave it
    healthy): sticky, as the GPU needs a reset to recover;
  - uncorrectable ECC errors since the driver loaded (volatile counter);
  - retired pages pending: the GPU needs a reset to retire them;
  - the GPU fell off the bus (NVML answers GPU_IS_LOST): sticky.

NVML is optional everywhere: without the library (``NVMLError_LibraryNotFound``
on a machine without the driver), without nvidia-ml-py, or with an NVML that
fails to start, ``DeviceMonitor.open`` returns None with the reason, and GMS
behaves as it does without it. A counter NVML does not support on this GPU
(``NOT_SUPPORTED``: ECC on a consumer card) is left out of the verdict.

The CUDA device and the NVML device are matched by UUID when the backend
knows it (the cuda backend does): CUDA's and NVML's enumeration orders can
differ (``CUDA_DEVICE_ORDER``, ``CUDA_VISIBLE_DEVICES``). Otherwise (host
backend) by index.

UNVERIFIED on a GPU: exercised against the NVML double of hack/cuda-double.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from understudy.gms import messages as m

# Xids caused by the application (bad address, launch timeout, ...), not the GPU.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})

_XID_EVENT = 0x8  # nvmlEventTypeXidCriticalError


@dataclass(frozen=True, slots=True)
class Sample:
    """What one poll of NVML saw."""

    memory_total: int
    memory_used: int
    new_xids: tuple[int, ...]
    ecc_uncorrected: int | None  # None: not supported on this GPU
    retired_pending: bool | None
    lost: bool


def verdict(sticky: str | None, sample: Sample) -> tuple[bool, str, str | None]:
    """(healthy, reason, sticky reason for the next poll). Pure."""
    if sample.lost:
        sticky = "GPU is lost (fell off the bus)"
    for xid in sample.new_xids:
        if xid not in APPLICATION_XIDS and sticky is None:
            sticky = f"Xid {xid}"
    if sticky is not None:
        return False, sticky, sticky
    if sample.ecc_uncorrected:
        return False, f"{sample.ecc_uncorrected} uncorrectable ECC errors", None
    if sample.retired_pending:
        return False, "retired pages pending (the GPU needs a reset)", None
    return True, "", None


def _text(value: str | bytes) -> str:
    # nvidia-ml-py answers str or bytes depending on the function and version.
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _nvml() -> Any:
    import pynvml

    return pynvml


class DeviceMonitor:
    """One device's NVML handle and Xid event set. ``open`` or None."""

    def __init__(self, nvml: Any, handle: Any, device: int) -> None:
        self._nvml = nvml
        self._handle = handle
        self.device = device
        self.uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        self.name = _text(nvml.nvmlDeviceGetName(handle))
        self._sticky: str | None = None
        events: Any = None
        try:
            events = nvml.nvmlEventSetCreate()
            nvml.nvmlDeviceRegisterEvents(handle, _XID_EVENT, events)
        except nvml.NVMLError:  # no Xid events on this GPU (or this platform)
            if events is not None:
                with contextlib.suppress(nvml.NVMLError):
                    nvml.nvmlEventSetFree(events)
            events = None
        self._events = events

    @classmethod
    def open(cls, device: int, uuid: str | None = None) -> tuple[DeviceMonitor | None, str]:
        """(monitor, "") or (None, why NVML is not there)."""
        try:
            nvml = _nvml()
        except ImportError:
            return None, "nvidia-ml-py is not installed"
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            return None, f"NVML: {exc}"
        try:
            if uuid is not None:
                handle = nvml.nvmlDeviceGetHandleByUUID(uuid.encode())
            else:
                handle = nvml.nvmlDeviceGetHandleByIndex(device)
            return cls(nvml, handle, device), ""
        except nvml.NVMLError as exc:
            nvml.nvmlShutdown()
            return None, f"NVML has no device {uuid or device}: {exc}"

    def _optional(self, call: Any, *args: Any) -> Any:
        try:
            return call(self._handle, *args)
        except self._nvml.NVMLError_NotSupported:
            return None

    def _sample(self) -> Sample:
        nvml = self._nvml
        xids: list[int] = []
        try:
            memory = nvml.nvmlDeviceGetMemoryInfo(self._handle)
            ecc = self._optional(
                nvml.nvmlDeviceGetTotalEccErrors,
                nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                nvml.NVML_VOLATILE_ECC,
            )
            pending = self._optional(nvml.nvmlDeviceGetRetiredPagesPendingStatus)
            while self._events is not None:
                try:
                    event = nvml.nvmlEventSetWait_v2(self._events, 0)
                except nvml.NVMLError_Timeout:
                    break
                if event.eventType == _XID_EVENT:
                    xids.append(int(event.eventData))
        except nvml.NVMLError_GpuIsLost:
            return Sample(0, 0, tuple(xids), None, None, lost=True)
        return Sample(
            memory_total=int(memory.total),
            memory_used=int(memory.used),
            new_xids=tuple(xids),
            ecc_uncorrected=None if ecc is None else int(ecc),
            retired_pending=None if pending is None else bool(pending),
            lost=False,
        )

    def poll(self) -> tuple[m.DeviceReport, tuple[int, ...]]:
        """The device now, and the Xids seen since the last poll."""
        sample = self._sample()
        healthy, reason, self._sticky = verdict(self._sticky, sample)
        report = m.DeviceReport(
            uuid=self.uuid,
            name=self.name,
            memory_total=sample.memory_total,
            memory_used=sample.memory_used,
            healthy=healthy,
            reason=reason,
        )
        return report, sample.new_xids

    def close(self) -> None:
        nvml = self._nvml
        if self._events is not None:
            with contextlib.suppress(nvml.NVMLError):
                nvml.nvmlEventSetFree(self._events)
            self._events = None
        with contextlib.suppress(nvml.NVMLError):
            nvml.nvmlShutdown()
