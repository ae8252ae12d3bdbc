"""What the Vulkan driver says of its devices and ggml does not: whether a device runs on the CPU, and the most
bytes a shader binds at once. Asked through the Vulkan loader with ctypes, with no llama.cpp loaded, so the tests
can choose which devices llama.cpp lists (``GGML_VK_VISIBLE_DEVICES``) before it starts."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

# VkPhysicalDeviceProperties: four uint32 fields, deviceType, deviceName[256], pipelineCacheUUID[16], then
# VkPhysicalDeviceLimits (aligned to 8), whose eighth uint32 is maxStorageBufferRange; the struct is 824 bytes.
_TYPE_AT, _NAME_AT, _STORAGE_RANGE_AT, _PROPERTIES_SIZE = 16, 20, 296 + 7 * 4, 824
_TYPE_CPU = 4  # VK_PHYSICAL_DEVICE_TYPE_CPU


@dataclass(frozen=True)
class PhysicalDevice:
    name: str  # deviceName, which ggml gives as the device's description
    on_cpu: bool  # a GPU's interface run on the CPU (Mesa's lavapipe)
    storage_range: int  # maxStorageBufferRange: a tensor larger than that aborts llama.cpp (lavapipe: 128 MiB)


@functools.cache
def physical_devices() -> tuple[PhysicalDevice, ...]:
    """The Vulkan devices in the loader's order (GGML_VK_VISIBLE_DEVICES counts in it); none where the loader
    cannot be asked."""
    try:
        vulkan = ctypes.CDLL("libvulkan.so.1")
    except OSError:
        return ()
    create_info = (ctypes.c_uint64 * 8)()  # VkInstanceCreateInfo, zeroed: no layers, no extensions
    create_info[0] = 1  # sType: VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO
    instance = ctypes.c_void_p()
    if vulkan.vkCreateInstance(ctypes.byref(create_info), None, ctypes.byref(instance)) != 0:
        return ()
    try:
        count = ctypes.c_uint32()
        vulkan.vkEnumeratePhysicalDevices(instance, ctypes.byref(count), None)
        handles = (ctypes.c_void_p * count.value)()
        vulkan.vkEnumeratePhysicalDevices(instance, ctypes.byref(count), handles)
        found = []
        for handle in handles[: count.value]:
            raw = ctypes.create_string_buffer(_PROPERTIES_SIZE)
            vulkan.vkGetPhysicalDeviceProperties(ctypes.c_void_p(handle), raw)
            properties = raw.raw
            found.append(
                PhysicalDevice(
                    name=properties[_NAME_AT : _NAME_AT + 256].split(b"\0", 1)[0].decode(errors="replace"),
                    on_cpu=int.from_bytes(properties[_TYPE_AT : _TYPE_AT + 4], "little") == _TYPE_CPU,
                    storage_range=int.from_bytes(properties[_STORAGE_RANGE_AT : _STORAGE_RANGE_AT + 4], "little"),
                )
            )
        return tuple(found)
    finally:
        vulkan.vkDestroyInstance(instance, None)
