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

__all__ = ["tensor_over"]


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
