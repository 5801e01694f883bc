"""A common view of numpy arrays and torch tensors: address, shape, strides
in elements, dtype name, device. numpy and torch are imported only when an
argument is one of theirs, so neither is a dependency."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from ._lib import KvtierError


@dataclass(frozen=True)
class Array:
    name: str  # the argument's name, for messages
    ptr: int
    shape: tuple
    strides: tuple  # elements
    dtype: str  # "int32", "int64", "int16", "uint8", "bfloat16", ...
    itemsize: int
    device: str  # "cpu" or "cuda"
    index: int  # CUDA device ordinal, -1 for the CPU
    writable: bool
    contiguous: bool
    
    is_torch: bool

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def span(self) -> int:
        """Elements from the first to one past the last addressed element."""
        if self.numel == 0:
            return 0
        return 1 + sum((n - 1) * s for n, s in zip(self.shape, self.strides))


def _is_torch(x) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _is_numpy(x) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and isinstance(x, np.ndarray)


def view(x, name: str) -> Array:
    """The Array behind a numpy array or a torch tensor; anything else is refused."""
    if _is_torch(x):
        dev = x.device
        index = -1
        if dev.type == "cuda":
            index = dev.index if dev.index is not None else sys.modules["torch"].cuda.current_device()
        elif dev.type != "cpu":
            raise KvtierError(f"`{name}` is on device {dev}; kvtier takes CPU or CUDA tensors")
        
        return Array(
            name=name,
            ptr=int(x.data_ptr()),
            shape=tuple(int(s) for s in x.shape),
            strides=tuple(int(s) for s in x.stride()),
            dtype=str(x.dtype).removeprefix("torch."),
            itemsize=int(x.element_size()),
            device=dev.type,
            index=index,
            writable=True,
            contiguous=bool(x.is_contiguous()),
            
            is_torch=True,
        )
    if _is_numpy(x):
        if not x.dtype.isnative:
            raise KvtierError(f"`{name}` is {x.dtype.str}, not in the machine's byte order")
        item = x.dtype.itemsize
        if any(s % item for s in x.strides) or any(s < 0 for s in x.strides):
            raise KvtierError(f"`{name}` has strides {x.strides} bytes, not non-negative multiples of {item}")
        return Array(
            name=name,
            ptr=int(x.ctypes.data),
            shape=tuple(int(s) for s in x.shape),
            strides=tuple(int(s) // item for s in x.strides),
            dtype=x.dtype.name,
            itemsize=item,
            device="cpu",
            index=-1,
            writable=bool(x.flags.writeable),
            contiguous=bool(x.flags.c_contiguous),
            
            is_torch=False,
        )
    raise KvtierError(f"`{name}` is a {type(x).__name__}; pass a numpy array or a torch tensor")
