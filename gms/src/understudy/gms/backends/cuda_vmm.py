"""``cuda`` backend: CUDA virtual memory management through cuda-python.

UNVERIFIED on a GPU: written without one in reach. CI runs every path below
against the CUDA driver double (hack/cuda-double: host memory, not a GPU),
which proves our calls and their semantics against our model of the driver,
not against NVIDIA's; the tests marked ``gpu`` run the same scenarios where a
driver and a device are present.

Server (``CudaVmmBackend``): ``cuInit`` and ``cuMemCreate`` (pinned, on the
device, POSIX-fd handle type), ``cuMemExportToShareableHandle`` per export,
``cuMemRelease`` on abort. The server never maps memory, so it needs no VA
and, like NVIDIA Dynamo's GPU Memory Service (``GMSServerMemoryManager``: "it
creates shareable memory without mapping it locally (no CUDA context needed
on the server)"), it creates no context: ``cuMemCreate`` and the export are
context-independent driver calls. Should a driver insist on a current context
(``CUDA_ERROR_INVALID_CONTEXT``), the backend retains the device's *primary*
context once and retries — the cheapest context there is, never a new one —
and logs that it did.

Client (``CudaVmmMapper``): ``cuMemImportFromShareableHandle`` on the received
fd, ``cuMemAddressReserve`` once per allocation, ``cuMemMap`` and
``cuMemSetAccess`` (READWRITE for the writer, READ after commit and for
readers), ``cuMemcpyHtoD`` / ``cuMemcpyDtoH`` for ``Allocation.write`` and
``read`` (a device pointer is no host pointer). Sleep is ``cuMemUnmap`` +
``cuMemRelease`` of the imported handle with the VA reservation kept; wake
imports the new fd and maps it at the same address. Physical memory is
reference-counted across processes: the server's ``cuMemRelease`` frees
nothing while an engine still holds an imported handle. The client needs a
current context (the engine has one; if not, the device's primary context is
retained and made current; a copy from a thread with none makes it current).

Without a driver, cuda-python raises a ``RuntimeError`` subclass on the first
driver call; both classes turn that into ``BackendUnavailable`` with one line.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from understudy.gms.backends.base import BackendUnavailable
from understudy.gms.messages import GmsError
from understudy.wire.obs import log_event

log = logging.getLogger(__name__)


class CudaError(GmsError):
    """A CUDA driver call failed."""


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as exc:  # cuda-python not installed
        raise BackendUnavailable(f"cuda backend: cuda-python is not installed ({exc})") from exc
    return driver


def _check(drv: Any, result: Any, what: str) -> None:
    if result != drv.CUresult.CUDA_SUCCESS:
        err, text = drv.cuGetErrorString(result)
        reason = text.decode() if err == drv.CUresult.CUDA_SUCCESS and text else str(result)
        raise CudaError(f"{what} failed: {reason}")


def _init(drv: Any, device: int) -> Any:
    """cuInit + cuDeviceGet, with the missing-driver case as one clear line."""
    try:
        (result,) = drv.cuInit(0)
    except RuntimeError as exc:  # DynamicLibNotFoundError etc.: no libcuda
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise BackendUnavailable(f"cuda backend: no NVIDIA driver: {first}") from None
    if result != drv.CUresult.CUDA_SUCCESS:
        raise BackendUnavailable(f"cuda backend: cuInit failed: {result}")
    result, dev = drv.cuDeviceGet(device)
    if result != drv.CUresult.CUDA_SUCCESS:
        raise BackendUnavailable(f"cuda backend: no CUDA device {device}: {result}")
    result, supported = drv.cuDeviceGetAttribute(
        drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev
    )
    if result != drv.CUresult.CUDA_SUCCESS or not supported:
        raise BackendUnavailable(f"cuda backend: device {device} cannot export POSIX fds")
    return dev


def _prop(drv: Any, device: int) -> Any:
    prop = drv.CUmemAllocationProp()
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    prop.requestedHandleTypes = (
        drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    )
    return prop


def _granularity(drv: Any, device: int) -> int:
    result, gran = drv.cuMemGetAllocationGranularity(
        _prop(drv, device), drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    )
    _check(drv, result, "cuMemGetAllocationGranularity")
    return int(gran)


def uuid_string(raw: bytes) -> str:
    """The 16 bytes of ``cuDeviceGetUuid`` as NVML spells them (``GPU-…``), the
    key that finds the same device in NVML whatever the two enumerations' order."""
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _identity(drv: Any, dev: Any) -> tuple[str, str, int]:
    """(name, UUID, driver version) of ``dev``, for the log and for NVML."""
    result, raw_name = drv.cuDeviceGetName(256, dev)
    _check(drv, result, "cuDeviceGetName")
    result, uuid = drv.cuDeviceGetUuid(dev)
    _check(drv, result, "cuDeviceGetUuid")
    result, version = drv.cuDriverGetVersion()
    _check(drv, result, "cuDriverGetVersion")
    name = bytes(raw_name).split(b"\0", 1)[0].decode(errors="replace").strip()
    return name, uuid_string(bytes(uuid.bytes)), int(version)


def _retain_primary(drv: Any, dev: Any) -> Any:
    result, ctx = drv.cuDevicePrimaryCtxRetain(dev)
    _check(drv, result, "cuDevicePrimaryCtxRetain")
    (result,) = drv.cuCtxSetCurrent(ctx)
    _check(drv, result, "cuCtxSetCurrent")
    return ctx


class CudaVmmBackend:
    """Server side: physical allocations, exported as POSIX fds; never mapped."""

    name = "cuda"

    def __init__(self, device: int) -> None:
        self._drv = _driver()
        self._dev = _init(self._drv, device)
        self.device = device
        self.granularity = _granularity(self._drv, device)
        self.device_name, self.uuid, driver_version = _identity(self._drv, self._dev)
        self._handles: dict[int, Any] = {}
        self._ctx: Any = None
        log_event(
            log,
            "cuda_device",
            device=device,
            name=self.device_name,
            uuid=self.uuid,
            driver_version=driver_version,
            granularity=self.granularity,
        )

    def create(self, alloc_id: int, size: int) -> None:
        drv = self._drv
        result, handle = drv.cuMemCreate(size, _prop(drv, self.device), 0)
        if result == drv.CUresult.CUDA_ERROR_INVALID_CONTEXT and self._ctx is None:
            log.warning("event=cuda_primary_context device=%d reason=cuMemCreate", self.device)
            self._ctx = _retain_primary(drv, self._dev)
            result, handle = drv.cuMemCreate(size, _prop(drv, self.device), 0)
        _check(drv, result, f"cuMemCreate({size})")
        self._handles[alloc_id] = handle

    def export(self, alloc_id: int, writable: bool) -> int:
        # A POSIX-fd handle carries no access rights; the client sets them.
        drv = self._drv
        result, fd = drv.cuMemExportToShareableHandle(
            self._handles[alloc_id],
            drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
        _check(drv, result, "cuMemExportToShareableHandle")
        return int(fd)

    def adopt(self, alloc_id: int, size: int, fd: int) -> None:
        """Import a client's re-exported handle (the same physical memory)."""
        drv = self._drv
        try:
            result, handle = drv.cuMemImportFromShareableHandle(
                fd, drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            )
        finally:
            os.close(fd)
        _check(drv, result, "cuMemImportFromShareableHandle")
        self._handles[alloc_id] = handle

    def release(self, alloc_id: int) -> None:
        handle = self._handles.pop(alloc_id, None)
        if handle is not None:
            (result,) = self._drv.cuMemRelease(handle)
            if result != self._drv.CUresult.CUDA_SUCCESS:
                log.warning("event=cuda_release_failed id=%d result=%s", alloc_id, result)

    def close(self) -> None:
        for alloc_id in list(self._handles):
            self.release(alloc_id)
        if self._ctx is not None:
            self._drv.cuDevicePrimaryCtxRelease(self._dev)
            self._ctx = None


class CudaVmmMapper:
    """Client side: import, reserve, map, set access; unmap keeps the VA."""

    name = "cuda"

    def __init__(self, device: int) -> None:
        drv = self._drv = _driver()
        self.device = device
        self._dev = _init(drv, device)
        result, ctx = drv.cuCtxGetCurrent()
        _check(drv, result, "cuCtxGetCurrent")
        # The context the copies run in, from any thread (``_current``).
        self._ctx = ctx if int(ctx) else _retain_primary(drv, self._dev)
        self._handles: dict[int, Any] = {}  # address -> imported handle

    def _access(self, address: int, size: int, writable: bool) -> None:
        drv = self._drv
        desc = drv.CUmemAccessDesc()
        desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = self.device
        desc.flags = (
            drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            if writable
            else drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ
        )
        (result,) = drv.cuMemSetAccess(address, size, [desc], 1)
        _check(drv, result, "cuMemSetAccess")

    def reserve(self, size: int, granularity: int) -> int:
        result, ptr = self._drv.cuMemAddressReserve(size, granularity, 0, 0)
        _check(self._drv, result, "cuMemAddressReserve")
        return int(ptr)

    def map(
        self, fd: int, address: int, size: int, writable: bool, populate: bool | None = None
    ) -> None:
        # A GPU mapping has no page faults to save: populate means nothing here.
        drv = self._drv
        result, handle = drv.cuMemImportFromShareableHandle(
            fd, drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        )
        _check(drv, result, "cuMemImportFromShareableHandle")
        try:
            (result,) = drv.cuMemMap(address, size, 0, handle, 0)
            _check(drv, result, "cuMemMap")
            try:
                self._access(address, size, writable)
            except BaseException:
                drv.cuMemUnmap(address, size)
                raise
        except BaseException:
            drv.cuMemRelease(handle)
            raise
        self._handles[address] = handle

    def protect_readonly(self, address: int, size: int) -> None:
        self._access(address, size, writable=False)

    def _current(self) -> None:
        """Copies need a current context, and a context is current per thread:
        a thread with none (a checksum pool's, say) gets the one this mapper was
        made under (the engine's, or the device's primary context)."""
        drv = self._drv
        result, ctx = drv.cuCtxGetCurrent()
        _check(drv, result, "cuCtxGetCurrent")
        if not int(ctx):
            (result,) = drv.cuCtxSetCurrent(self._ctx)
            _check(drv, result, "cuCtxSetCurrent")

    def write(self, address: int, data: memoryview) -> None:
        """``cuMemcpyHtoD``, then ``cuCtxSynchronize``: from pageable host memory
        the copy may return before its DMA lands, and another process reads
        these bytes once the writer commits."""
        drv = self._drv
        self._current()
        (result,) = drv.cuMemcpyHtoD(address, data, data.nbytes)
        _check(drv, result, f"cuMemcpyHtoD({data.nbytes})")
        (result,) = drv.cuCtxSynchronize()
        _check(drv, result, "cuCtxSynchronize")

    def read(self, address: int, nbytes: int) -> bytes:
        """``cuMemcpyDtoH`` (to pageable memory it returns once the copy is done)."""
        drv = self._drv
        self._current()
        out = bytearray(nbytes)
        (result,) = drv.cuMemcpyDtoH(out, address, nbytes)
        _check(drv, result, f"cuMemcpyDtoH({nbytes})")
        return bytes(out)

    def export(self, address: int) -> int:
        """The imported handle, exported again: a restarted server adopts it.
        Unverified on a GPU: the driver double allows it, as the CUDA driver
        documents for a handle created with a POSIX-fd handle type."""
        drv = self._drv
        result, fd = drv.cuMemExportToShareableHandle(
            self._handles[address],
            drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
        _check(drv, result, "cuMemExportToShareableHandle")
        return int(fd)

    def unmap(self, address: int, size: int) -> None:
        drv = self._drv
        (result,) = drv.cuMemUnmap(address, size)
        _check(drv, result, "cuMemUnmap")
        handle = self._handles.pop(address, None)
        if handle is not None:
            (result,) = drv.cuMemRelease(handle)
            _check(drv, result, "cuMemRelease")

    def park(self, address: int, size: int) -> None:
        # A GPU's memory is what a sleeping engine gives back (sleep mode):
        # a mapping held asleep would keep it from the Active.
        self.unmap(address, size)

    def free(self, address: int, size: int) -> None:
        (result,) = self._drv.cuMemAddressFree(address, size)
        _check(self._drv, result, "cuMemAddressFree")
