"""llama.cpp with its layers on a Vulkan GPU: the llama.cpp backend, placed on a device of its Vulkan build.

Everything but the placement is the llama.cpp backend's: the same KV budget (its bytes live on the GPU
with the layers), the same cache operations, the same errors. Without ``--device`` the layers go to the
build's first Vulkan device that is a real GPU; ``--gpu-layers N`` keeps the rest on the CPU. llama.cpp lists a
Vulkan device that runs on the CPU (Mesa's lavapipe) only where ``GGML_VK_VISIBLE_DEVICES`` names it: the tests
run this backend there, and ``auto`` passes it over unless a device is asked for.
"""

from __future__ import annotations

import dataclasses
import os
from typing import ClassVar

from edgeinfer.errors import BackendUnavailableError
from edgeinfer.system import llama_cpp_library

from .base import CPU, BackendOptions, Device
from .llamacpp import VULKAN_REGISTRY, GgmlDevice, LlamaCppBackend, ggml_devices
from .vulkan_driver import physical_devices

CPU_HINT = "; --backend llamacpp runs the model on the CPU"
SETUP_HINT = "bash scripts/setup.sh --vulkan rebuilds it with Vulkan (9 to 17 minutes on 2 cores)"


def vulkan_devices() -> list[GgmlDevice]:
    """The Vulkan devices llama.cpp's build found, in its order, with what their driver says of them that ggml
    does not: the largest tensor a shader binds, and whether the device runs on the CPU."""
    found = [gpu for gpu in ggml_devices().gpus() if gpu.registry == VULKAN_REGISTRY]
    physical = {device.name: device for device in physical_devices()} if found else {}
    return [
        dataclasses.replace(
            gpu, max_tensor_bytes=physical[gpu.description].storage_range, emulated=physical[gpu.description].on_cpu
        )
        if gpu.description in physical
        else dataclasses.replace(gpu, emulated="llvmpipe" in gpu.description.lower())  # no driver to ask: lavapipe
        for gpu in found
    ]


def _unavailable() -> str | None:
    """Why this backend cannot run here, in one line; None where it can."""
    if llama_cpp_library("ggml-vulkan") is None:
        return f"the installed llama-cpp-python was built without Vulkan; {SETUP_HINT}"
    if vulkan_devices():
        return None
    visible = os.environ.get("GGML_VK_VISIBLE_DEVICES")
    if visible is not None:
        return f"GGML_VK_VISIBLE_DEVICES={visible} names no Vulkan device llama.cpp could open here{CPU_HINT}"
    return (
        "llama.cpp's Vulkan build finds no GPU with a working Vulkan driver here (a Vulkan device on the CPU, "
        f"such as Mesa's lavapipe, counts only where GGML_VK_VISIBLE_DEVICES names it){CPU_HINT}"
    )


if (_reason := _unavailable()) is not None:  # as a backend whose library is missing: it cannot load here
    raise BackendUnavailableError(_reason)


class VulkanBackend(LlamaCppBackend):
    """llama.cpp on a Vulkan device: all layers by default, ``gpu_layers`` of them if given."""

    name: ClassVar[str] = "vulkan"
    _elsewhere: ClassVar[str] = CPU_HINT

    @classmethod
    def devices(cls) -> list[Device]:
        """The default device first (as ``cpu``: where the backend runs unless told), then each by its name. The
        default is the first Vulkan device that is not emulated on the CPU, else the first."""
        default = cls._default()
        described = f"the Vulkan device {default.name}: {default.description}"
        return [dataclasses.replace(default.as_device(), name=CPU, description=described)] + [
            gpu.as_device() for gpu in cls._gpus()
        ]

    @classmethod
    def _gpus(cls) -> list[GgmlDevice]:
        return vulkan_devices()

    @classmethod
    def _default(cls) -> GgmlDevice:
        gpus = cls._gpus()
        return next((gpu for gpu in gpus if not gpu.emulated), gpus[0])

    @classmethod
    def _placed_on(cls, options: BackendOptions) -> GgmlDevice | None:
        if options.device == CPU:
            return cls._default()
        return super()._placed_on(options)
