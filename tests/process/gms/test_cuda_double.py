"""The CUDA driver double itself (host memory, not a GPU), the cuda backend's
handling of what it answers, and faults injected through it into GMS.

These prove our calls against our model of the driver (hack/cuda-double),
not against NVIDIA's: the misuse codes are the ones the driver documents
where it documents one, and the double's choice elsewhere (cuda_double.c).
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import time
from typing import Any

import pytest
from doubles.gpu import GpuDouble, loaded_libraries
from gmsprocs import Gms, run_cli
from procs import PYTHON

pytestmark = pytest.mark.process

MiB = 1 << 20


def run(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter (the double is in its environment)."""
    return subprocess.run(
        [PYTHON, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def run_json(code: str) -> Any:
    out = run(code)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_cuda_python_loads_the_double_in_place_of_libcuda(gms: Gms, cuda_double: GpuDouble) -> None:
    server = gms.server(0, "--backend", "cuda")
    libs = set(loaded_libraries(server.pid))
    assert str(cuda_double.lib_dir / "libcuda.so.1") in libs, libs
    log = (gms.tmp / "server0.log").read_text()
    assert "event=cuda_device" in log and "not a GPU" in log, log


MISUSE = """
    import ctypes, json, os
    from cuda.bindings import driver as d
    R = d.CUresult
    out = {}
    POSIX = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    def prop(dev=0):
        p = d.CUmemAllocationProp()
        p.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        p.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        p.location.id = dev
        p.requestedHandleTypes = POSIX
        return p
    G = 2 << 20
    out["create_before_init"] = d.cuMemCreate(G, prop(), 0)[0].name
    d.cuInit(0)
    out["device_5"] = d.cuDeviceGet(5)[0].name
    out["create_unaligned"] = d.cuMemCreate(G + 1, prop(), 0)[0].name
    out["create_bad_device"] = d.cuMemCreate(G, prop(7), 0)[0].name
    _, h = d.cuMemCreate(2 * G, prop(), 0)
    _, va = d.cuMemAddressReserve(4 * G, 0, 0, 0)
    out["map_outside"] = d.cuMemMap(int(va) + 8 * G, 2 * G, 0, h, 0)[0].name
    out["map_unaligned"] = d.cuMemMap(int(va) + 4096, 2 * G, 0, h, 0)[0].name
    out["map_too_big"] = d.cuMemMap(va, 4 * G, 0, h, 0)[0].name
    out["map"] = d.cuMemMap(va, 2 * G, 0, h, 0)[0].name
    out["map_again"] = d.cuMemMap(va, 2 * G, 0, h, 0)[0].name
    out["copy_no_context"] = d.cuMemcpyHtoD(va, b"x", 1)[0].name
    _, ctx = d.cuDevicePrimaryCtxRetain(0)
    d.cuCtxSetCurrent(ctx)
    out["copy_no_access"] = d.cuMemcpyHtoD(va, b"x", 1)[0].name
    desc = d.CUmemAccessDesc()
    desc.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = 0
    desc.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    out["access_unmapped"] = d.cuMemSetAccess(int(va) + 2 * G, 2 * G, [desc], 1)[0].name
    out["access"] = d.cuMemSetAccess(va, 2 * G, [desc], 1)[0].name
    out["copy"] = d.cuMemcpyHtoD(va, b"hello", 5)[0].name
    out["copy_unmapped"] = d.cuMemcpyHtoD(int(va) + 2 * G, b"x", 1)[0].name
    out["copy_across_end"] = d.cuMemcpyHtoD(int(va) + 2 * G - 1, b"xy", 2)[0].name
    out["free_mapped"] = d.cuMemAddressFree(va, 4 * G)[0].name
    out["unmap_part"] = d.cuMemUnmap(va, G)[0].name
    out["export_bad_type"] = d.cuMemExportToShareableHandle(
        h, d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC, 0)[0].name
    r, fd = d.cuMemExportToShareableHandle(h, POSIX, 0)
    out["export"] = r.name
    out["release"] = d.cuMemRelease(h)[0].name
    out["release_again"] = d.cuMemRelease(h)[0].name
    buf = bytearray(5)
    out["still_mapped_after_release"] = d.cuMemcpyDtoH(buf, va, 5)[0].name + ":" + buf.decode()
    out["unmap"] = d.cuMemUnmap(va, 2 * G)[0].name
    out["unmap_again"] = d.cuMemUnmap(va, 2 * G)[0].name
    out["copy_after_unmap"] = d.cuMemcpyDtoH(buf, va, 5)[0].name
    out["map_released_handle"] = d.cuMemMap(va, 2 * G, 0, h, 0)[0].name
    r, h2 = d.cuMemImportFromShareableHandle(fd, POSIX)
    out["import"] = r.name
    out["remap_same_address"] = d.cuMemMap(va, 2 * G, 0, h2, 0)[0].name
    d.cuMemSetAccess(va, 2 * G, [desc], 1)
    buf = bytearray(5)
    d.cuMemcpyDtoH(buf, va, 5)
    out["bytes_after_remap"] = buf.decode()
    rd, wr = os.pipe()
    out["import_pipe"] = d.cuMemImportFromShareableHandle(rd, POSIX)[0].name
    host = os.memfd_create("understudy-gms-host")
    os.ftruncate(host, 2 * G)
    out["import_host_memfd"] = d.cuMemImportFromShareableHandle(host, POSIX)[0].name
    out["import_closed_fd"] = d.cuMemImportFromShareableHandle(999, POSIX)[0].name
    out["free_wrong_size"] = d.cuMemAddressFree(va, 2 * G)[0].name
    d.cuMemUnmap(va, 2 * G)
    d.cuMemRelease(h2)
    out["free"] = d.cuMemAddressFree(va, 4 * G)[0].name
    out["free_again"] = d.cuMemAddressFree(va, 4 * G)[0].name
    out["ctx_release"] = d.cuDevicePrimaryCtxRelease(0)[0].name
    out["ctx_release_again"] = d.cuDevicePrimaryCtxRelease(0)[0].name
    out["oom_text"] = d.cuGetErrorString(R.CUDA_ERROR_OUT_OF_MEMORY)[1].decode()
    print(json.dumps(out))
"""


def test_misuse_gets_the_drivers_error_codes(cuda_double: GpuDouble) -> None:
    got = run_json(MISUSE)
    ok = "CUDA_SUCCESS"
    bad = "CUDA_ERROR_INVALID_VALUE"
    assert got == {
        "create_before_init": "CUDA_ERROR_NOT_INITIALIZED",
        "device_5": "CUDA_ERROR_INVALID_DEVICE",
        "create_unaligned": bad,
        "create_bad_device": "CUDA_ERROR_INVALID_DEVICE",
        "map_outside": bad,
        "map_unaligned": bad,
        "map_too_big": bad,
        "map": ok,
        "map_again": bad,
        "copy_no_context": "CUDA_ERROR_INVALID_CONTEXT",
        "copy_no_access": "CUDA_ERROR_ILLEGAL_ADDRESS",
        "access_unmapped": bad,
        "access": ok,
        "copy": ok,
        "copy_unmapped": bad,
        "copy_across_end": bad,
        "free_mapped": bad,
        "unmap_part": bad,
        "export_bad_type": bad,
        "export": ok,
        "release": ok,
        "release_again": bad,
        "still_mapped_after_release": "CUDA_SUCCESS:hello",  # the mapping holds the memory
        "unmap": ok,
        "unmap_again": bad,
        "copy_after_unmap": bad,
        "map_released_handle": bad,
        "import": ok,  # the exported fd outlived every handle: the memory too
        "remap_same_address": ok,
        "bytes_after_remap": "hello",
        "import_pipe": bad,
        "import_host_memfd": bad,
        "import_closed_fd": bad,
        "free_wrong_size": bad,
        "free": ok,
        "free_again": bad,
        "ctx_release": ok,
        "ctx_release_again": "CUDA_ERROR_INVALID_CONTEXT",
        "oom_text": "out of memory",
    }
    assert cuda_double.used_bytes() == 0, cuda_double.holders()


def test_a_device_pointer_is_not_a_host_pointer(cuda_double: GpuDouble) -> None:
    """On a GPU, dereferencing a device pointer on the host faults; the double's
    device ranges have no host access, so code that does it crashes here too."""
    out = run(
        """
        import ctypes, os
        from understudy.gms.backends.cuda_vmm import CudaVmmBackend, CudaVmmMapper
        b = CudaVmmBackend(0)
        b.create(1, 2 << 20)
        m = CudaVmmMapper(0)
        va = m.reserve(2 << 20, b.granularity)
        fd = b.export(1, True)
        m.map(fd, va, 2 << 20, True)
        os.close(fd)
        print("mapped", flush=True)
        ctypes.c_char.from_address(va).value
        print("read a device pointer on the host")
        """
    )
    assert out.stdout.strip() == "mapped" and out.returncode == -11, (out.stdout, out.stderr)


def test_backend_errors_name_the_call_and_the_reason(cuda_double: GpuDouble) -> None:
    got = run_json(
        """
        import json, os
        from understudy.gms.backends.cuda_vmm import CudaError, CudaVmmMapper
        m = CudaVmmMapper(0)
        va = m.reserve(2 << 20, 2 << 20)
        host = os.memfd_create("not-device-memory")
        os.ftruncate(host, 2 << 20)
        try:
            m.map(host, va, 2 << 20, False)
        except CudaError as exc:
            print(json.dumps(str(exc)))
        """
    )
    assert got == "cuMemImportFromShareableHandle failed: invalid argument"


def test_without_devices_the_server_fails_with_one_line(gms: Gms, cuda_double: GpuDouble) -> None:
    cuda_double.set(UNDERSTUDY_CUDA_DOUBLE_DEVICES="0")
    done = run_cli("server", "--socket", str(gms.path(0)), "--device", "0", "--backend", "cuda")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "cuda backend: cuInit failed" in lines[0] and "NO_DEVICE" in lines[0], lines


def test_a_driver_that_wants_a_context_for_create_gets_the_primary_one(
    gms: Gms, cuda_double: GpuDouble
) -> None:
    cuda_double.set(UNDERSTUDY_CUDA_DOUBLE_CONTEXT_REQUIRED="cuMemCreate")
    gms.server(0, "--backend", "cuda")
    w = gms.agent("writer")
    w.ok("connect", path=str(gms.path(0)), mode="RW", timeout=10)
    w.ok("allocate", size=2 * MiB)
    w.ok("allocate", size=2 * MiB)
    log = (gms.tmp / "server0.log").read_text()
    assert log.count("event=cuda_primary_context") == 1, log


# --- faults through GMS -----------------------------------------------------------


def no_leak(double: GpuDouble, gms: Gms, allocations: int) -> None:
    """The server holds exactly ``allocations``; nothing else holds any."""
    wait_for_settle = time.monotonic() + 10
    while time.monotonic() < wait_for_settle:
        if len(double.allocations()) == allocations:
            break
        time.sleep(0.05)
    assert len(double.allocations()) == allocations, double.holders()
    assert gms.state()["allocations"] == allocations


def test_out_of_device_memory_is_a_clear_refusal_and_the_server_goes_on(
    gms: Gms, cuda_double: GpuDouble
) -> None:
    cuda_double.set(UNDERSTUDY_CUDA_DOUBLE_MEMORY=str(8 * MiB))
    gms.server(0, "--backend", "cuda")
    w = gms.agent("writer")
    w.ok("connect", path=str(gms.path(0)), mode="RW", timeout=10)
    w.ok("allocate", size=6 * MiB)
    got = w("allocate", size=4 * MiB)
    assert not got["ok"] and got["error"] == "GmsRefused", got
    assert got["message"].startswith("no_memory:") and "out of memory" in got["message"], got
    no_leak(cuda_double, gms, 1)
    w.ok("close")  # aborts: the 6 MiB go back
    no_leak(cuda_double, gms, 0)
    w2 = gms.agent("writer2")
    w2.ok("connect", path=str(gms.path(0)), mode="RW", timeout=10)
    w2.ok("allocate", size=8 * MiB)  # all of it, now


def test_export_failure_is_a_clear_refusal_and_leaks_no_fd(
    gms: Gms, cuda_double: GpuDouble
) -> None:
    cuda_double.fail("cuMemExportToShareableHandle:OPERATING_SYSTEM#2")
    server = gms.server(0, "--backend", "cuda")
    cuda_double.fail()
    w = gms.agent("writer")
    w.ok("connect", path=str(gms.path(0)), mode="RW", timeout=10)
    w.ok("allocate", size=2 * MiB)
    got = w("allocate", size=2 * MiB)
    assert not got["ok"] and got["error"] == "GmsRefused", got
    assert "cuMemExportToShareableHandle failed: OS call failed" in got["message"], got
    fds = len(os.listdir(f"/proc/{server.pid}/fd"))
    w.ok("close")
    no_leak(cuda_double, gms, 0)
    assert len(os.listdir(f"/proc/{server.pid}/fd")) <= fds - 2  # both memfds closed
    gms.state()


def test_map_failure_in_the_client_leaves_nothing_mapped(gms: Gms, cuda_double: GpuDouble) -> None:
    gms.server(0, "--backend", "cuda")
    cuda_double.fail("cuMemMap:OUT_OF_MEMORY#1")
    w = gms.agent("writer")
    cuda_double.fail()
    w.ok("connect", path=str(gms.path(0)), mode="RW", timeout=10)
    got = w("allocate", size=2 * MiB)
    assert not got["ok"] and got["error"] == "CudaError", got
    assert got["message"] == "cuMemMap failed: out of memory", got
    holders = [h for h in cuda_double.holders() if h.startswith(f"{w.pid} ")]
    assert holders == []  # the import was released and the fd closed
    w.ok("allocate", size=2 * MiB)
    w.ok("fill", index=0, seed=1)
    w.ok("commit")
    w.ok("close")


def test_a_failed_remap_can_be_retried_at_the_same_address(
    gms: Gms, cuda_double: GpuDouble
) -> None:
    gms.server(0, "--backend", "cuda")
    w = gms.agent("writer")
    w.ok("connect", path=str(gms.path(0)), mode="RW", timeout=10)
    w.ok("allocate", size=4 * MiB)
    w.ok("fill", index=0, seed=5)
    w.ok("commit")
    cuda_double.fail("cuMemMap:OUT_OF_MEMORY#2")  # the import maps (1st), the wake fails (2nd)
    r = gms.agent("reader")
    cuda_double.fail()
    r.ok("connect", path=str(gms.path(0)), mode="RO", timeout=10)
    r.ok("import")
    before = r.ok("addresses")["addresses"]
    r.ok("unmap")
    got = r("remap", timeout=5)
    assert not got["ok"] and got["error"] == "CudaError" and "out of memory" in got["message"]
    assert [h for h in cuda_double.holders() if h.startswith(f"{r.pid} ")] == []
    assert gms.state()["sessions"]["RO"] == 1  # the failed wake's session is gone
    r.ok("remap", timeout=5)
    assert r.ok("addresses")["addresses"] == before
    assert r.ok("verify", index=0, seed=5)["equal"]


def test_a_tp_engine_whose_device_runs_out_of_memory_fails_fast_and_leaks_nothing(
    gms: Gms, cuda_double: GpuDouble
) -> None:
    gms.server(0, "--backend", "cuda")
    cuda_double.fail("cuMemCreate:OUT_OF_MEMORY")
    gms.server(1, "--backend", "cuda")  # device 1's memory is gone
    cuda_double.fail()
    engine = gms.engine()
    t0 = time.monotonic()
    for device in (0, 1):
        engine.send(
            op="worker",
            trial=1,
            device=device,
            devices=2,
            socket=str(gms.path(device)),
            mode="RW_OR_RO",
            timeout=10,
            size=4 * MiB,
        )
    err = engine.wait_event(30, event="error", device=1)
    assert err["error"] == "GmsRefused" and "out of memory" in err["message"], err
    assert time.monotonic() - t0 < 10  # an answer, not a timeout
    engine.send(op="close_trial", trial=1)
    engine.wait_event(10, event="closed", trial=1)
    assert cuda_double.used_bytes(1) == 0, cuda_double.holders()
    assert gms.state(1)["allocations"] == 0 and gms.state(1)["sessions"]["RW"] == 0
