"""Memory backends: one interface (``base``), host shared memory (``memfd``)
and CUDA VMM (``cuda_vmm``)."""

from __future__ import annotations

from understudy.gms.backends.base import BackendUnavailable, ClientMapper, ServerBackend

BACKENDS = ("host", "cuda")


def make_server_backend(name: str, device: int, granularity: int | None = None) -> ServerBackend:
    """The server side of backend ``name``; ``BackendUnavailable`` if it cannot start."""
    if name == "host":
        from understudy.gms.backends.memfd import MemfdBackend

        return MemfdBackend(device, granularity)
    if name == "cuda":
        from understudy.gms.backends.cuda_vmm import CudaVmmBackend

        return CudaVmmBackend(device)
    raise BackendUnavailable(f"unknown backend {name!r}; expected one of {', '.join(BACKENDS)}")


def make_mapper(name: str, device: int) -> ClientMapper:
    """The client side of backend ``name`` (what ``HelloOk.backend`` names)."""
    if name == "host":
        from understudy.gms.backends.memfd import HostMapper

        return HostMapper()
    if name == "cuda":
        from understudy.gms.backends.cuda_vmm import CudaVmmMapper

        return CudaVmmMapper(device)
    raise BackendUnavailable(f"unknown backend {name!r}; expected one of {', '.join(BACKENDS)}")


__all__ = [
    "BACKENDS",
    "BackendUnavailable",
    "ClientMapper",
    "ServerBackend",
    "make_mapper",
    "make_server_backend",
]
