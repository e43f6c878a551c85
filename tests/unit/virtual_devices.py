"""Several devices simulated on the CPU: device placement checked without a GPU.

Inside `VirtualDevices()` every tensor carries a virtual device ("cpu", "cuda:0", "cuda:1", ...; a
tensor made outside counts as "cpu"). The tensors are real CPU tensors, so data-dependent code
(`.tolist()`, `int(t)`, `nonzero`) runs as it would on a GPU, but an op whose tensor operands sit on
different virtual devices raises `DeviceMismatch` where CUDA would raise, and so does a draw with a
generator on another device than the tensor it makes or samples. Factories follow their `device=`,
`.to()` / `.cpu()` / `.cuda()` move (copying, as a real move does), `Tensor.device` reports the virtual
device, `.numpy()` refuses a tensor off the CPU, and `torch.Generator(device=...)` makes a virtual
generator on that device.

Stricter than CUDA in one way: a CPU index tensor used on a GPU tensor, or a 0-d CPU tensor beside
GPU operands, is refused too (CUDA copies them over implicitly, once per call: a hidden transfer).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Self

import torch
from torch.overrides import TorchFunctionMode

_REAL_GENERATOR = torch.Generator
_MOVES = ("to", "cpu", "cuda")


class DeviceMismatch(RuntimeError):
    """An op that CUDA would refuse: operands, or a generator and its tensor, on different devices."""


def device_of(t: torch.Tensor) -> str:
    return getattr(t, "_virtual_device", "cpu")


def _name(device: Any) -> str:
    d = torch.device(device)
    return "cuda:0" if d.type == "cuda" and d.index is None else str(d)


class VirtualGenerator(_REAL_GENERATOR):
    """A CPU generator that lives, for the simulation, on `device` (torch's argument parser takes only
    real generators, hence the subclass)."""

    def __new__(cls, device: Any = "cpu") -> Self:
        self = super().__new__(cls)  # a CPU generator underneath
        self._virtual_device = torch.device(_name(device))
        return self

    def __init__(self, device: Any = "cpu"):
        pass  # __new__ did the work; torch.Generator's own __init__ would look for CUDA

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self._virtual_device


def _generator(device: Any = "cpu") -> Any:
    return _REAL_GENERATOR() if _name(device) == "cpu" else VirtualGenerator(device)


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


def _generator_device(generator: Any) -> str:
    return _name(generator.device)


class VirtualDevices(TorchFunctionMode):
    """The simulation, as a context manager (see the module docstring)."""

    def __enter__(self):
        torch.Generator = _generator  # type: ignore[misc, assignment] - restored on exit
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        torch.Generator = _REAL_GENERATOR  # type: ignore[misc]
        super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if getattr(func, "__self__", None) is torch.Tensor.device:  # the `Tensor.device` property
            return torch.device(device_of(args[0]))
        name = getattr(func, "__name__", "")
        if name in _MOVES:
            return self._move(func, name, args, kwargs)
        devices = {device_of(t) for t in (*_tensors(args), *_tensors(kwargs))}
        if len(devices) > 1:
            raise DeviceMismatch(f"{name}: operands on {sorted(devices)}")
        here = devices.pop() if devices else "cpu"
        if name == "numpy" and here != "cpu":
            raise DeviceMismatch(f"numpy() of a tensor on {here}")
        if kwargs.get("device") is not None:
            here = _name(kwargs["device"])
            kwargs["device"] = "cpu"
        generator = kwargs.get("generator")
        if generator is not None and _generator_device(generator) != here:
            raise DeviceMismatch(f"{name}: a generator on {_generator_device(generator)} for a tensor on {here}")
        out = func(*args, **kwargs)
        for t in _tensors(out):
            t._virtual_device = here  # type: ignore[attr-defined]
        return out

    @staticmethod
    def _move(func, name: str, args: tuple, kwargs: dict) -> torch.Tensor:
        source = args[0]
        target = device_of(source)
        real_args: list[Any] = [source]
        for arg in args[1:]:
            if isinstance(arg, (str, torch.device)):
                target, arg = _name(arg), "cpu"
            elif isinstance(arg, torch.Tensor):  # .to(other): other's device and dtype
                target = device_of(arg)
            elif name == "cuda" and isinstance(arg, int):
                target, arg = f"cuda:{arg}", None
            real_args.append(arg)
        if kwargs.get("device") is not None:
            target, kwargs["device"] = _name(kwargs["device"]), "cpu"
        if name == "cpu":
            target = "cpu"
        elif name == "cuda":
            target = target if target.startswith("cuda") else "cuda:0"
            out = source.clone()  # there is no real CUDA to call
        if name != "cuda":
            out = func(*[a for a in real_args if a is not None], **kwargs)
        if target != device_of(source) and out is source:
            out = source.clone()  # a move makes a new tensor on the other device
        out._virtual_device = target  # type: ignore[attr-defined]
        return out
