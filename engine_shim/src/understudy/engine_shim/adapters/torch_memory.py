"""GMS memory as torch tensors, without a copy: what the torch-based engines share.

On the host an allocation is a memfd mapping, which ``torch.frombuffer``
wraps. On a GPU it is a CUDA VMM mapping with no host view: its device
pointer goes to torch through the CUDA array interface (``torch.as_tensor``
imports it without a copy). A probe on one H100 (issue 29) wrapped GMS VMM
memory this way in two processes and matched their matmuls; the engines'
own use of this path is UNVERIFIED until a GPU runs it.

torch is imported inside the functions: this module imports anywhere.
"""

from __future__ import annotations

import warnings
from typing import Any

from understudy.gms.client import Allocation

__all__ = ["copy_into", "tensor_over"]


def tensor_over(alloc: Allocation, offset: int, nbytes: int, device: str) -> Any:
    """A uint8 tensor over ``nbytes`` of ``alloc`` at ``offset``, on ``device``
    ("cpu" or "cuda:N"), sharing the GMS memory."""
    import torch

    if device == "cpu":
        with warnings.catch_warnings():
            # A read-only mapping: torch cannot enforce that, and warns. The
            # engines only read weights; a write would fault.
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(alloc.view(), dtype=torch.uint8, count=nbytes, offset=offset)
    return torch.as_tensor(_CudaArray(alloc.address + offset, nbytes), device=device)


def copy_into(alloc: Allocation, data: bytes | bytearray, device: str) -> None:
    """Write ``data`` at the start of ``alloc`` (a writer's mapping before
    commit), on the host or the GPU (one host-to-device copy, synchronized:
    the commit that follows publishes the bytes). UNVERIFIED on a GPU."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # frombuffer of a bytes object
        src = torch.frombuffer(data, dtype=torch.uint8)
    tensor_over(alloc, 0, len(data), device).copy_(src)
    if device != "cpu":
        torch.cuda.synchronize(device)


class _CudaArray:
    """A device pointer as the CUDA array interface (version 3) describes it."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }
