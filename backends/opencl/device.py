"""The OpenCL devices this machine has, as ``edgeinfer info`` lists them and the backend picks one.

A device is named by its platform and device indices, ``P:D`` (``0:1``: the second device of the
first platform), by its place in ``edgeinfer info``'s list (``1``: the second device listed), or by a part of
its description (its name, platform, OpenCL version...: ``pocl``, ``mali``).
The default is ``EDGEINFER_OPENCL_DEVICE`` if set, else the first GPU, else the first device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pyopencl as cl

from edgeinfer.errors import BackendUnavailableError, InvalidOptionError

from ..base import device_by_part, place_in_list

ENV = "EDGEINFER_OPENCL_DEVICE"
INSTALL_HINT = (
    "install an OpenCL driver: your GPU vendor's, or PoCL for the CPU (Debian and Ubuntu: apt install pocl-opencl-icd)"
)


@dataclass(frozen=True)
class OpenCLDevice:
    """One OpenCL device and what the kernels care about."""

    index: str  # "P:D"
    name: str
    platform: str
    version: str  # the OpenCL version the device supports, e.g. "OpenCL 3.0"
    opencl_c: str  # the OpenCL C version its compiler takes, e.g. "OpenCL C 1.2 PoCL"
    gpu: bool
    compute_units: int
    global_bytes: int
    local_bytes: int
    fp16: bool  # cl_khr_fp16: half arithmetic (half storage works everywhere)
    subgroups: bool

    def describe(self) -> str:
        features = [f for f, has in (("fp16", self.fp16), ("subgroups", self.subgroups)) if has]
        return (
            f"{self.name} ({self.platform}; {self.version}, {self.opencl_c}; {'GPU' if self.gpu else 'CPU'}, "
            f"{self.compute_units} compute units, {self.global_bytes / 2**30:.1f} GiB global, "
            f"{self.local_bytes // 1024} KiB local; {', '.join(features) or 'no fp16, no subgroups'})"
        )


def opencl_devices() -> list[tuple[OpenCLDevice, cl.Device]]:
    """Every device of every platform, in platform order; empty where no OpenCL driver is installed."""
    try:
        platforms = cl.get_platforms()
    except cl.Error:  # no ICD at all: clGetPlatformIDs fails rather than finding none
        return []
    found = []
    for p, platform in enumerate(platforms):
        try:
            devices = platform.get_devices()
        except cl.Error:  # a platform with no devices reports it as an error
            continue
        for d, device in enumerate(devices):
            extensions = device.extensions.split()
            found.append(
                (
                    OpenCLDevice(
                        index=f"{p}:{d}",
                        name=device.name.strip(),
                        platform=platform.name.strip(),
                        version=" ".join(device.version.split()[:2]),  # "OpenCL 3.0", without the vendor's part
                        opencl_c=device.opencl_c_version.strip(),
                        gpu=bool(device.type & cl.device_type.GPU),
                        compute_units=device.max_compute_units,
                        global_bytes=device.global_mem_size,
                        local_bytes=device.local_mem_size,
                        fp16="cl_khr_fp16" in extensions,
                        subgroups="cl_khr_subgroups" in extensions or "cl_intel_subgroups" in extensions,
                    ),
                    device,
                )
            )
    return found


def choose_device(wanted: str | None) -> tuple[OpenCLDevice, cl.Device]:
    """The device ``wanted`` names (``P:D``; a number, its place in the list; or a part of one device's
    description: its name, platform, OpenCL version..., its name first; None: ``EDGEINFER_OPENCL_DEVICE``, else the
    first GPU, else the first device). One line naming the devices there are if none matches, or those that match
    if several do."""
    devices = opencl_devices()
    if not devices:
        raise BackendUnavailableError(f"no OpenCL device here; {INSTALL_HINT}")
    from_environment = not wanted
    wanted = wanted or os.environ.get(ENV) or None
    if wanted is None:
        return next((pair for pair in devices if pair[0].gpu), devices[0])
    by_index = {info.index: (info, device) for info, device in devices}
    described = [(info.index, info.name, info.describe()) for info, _ in devices]
    place = place_in_list(wanted)
    if place is not None:  # never a part of a description ("OpenCL 3.0")
        index = devices[place][0].index if place < len(devices) else None
    else:
        index = wanted if wanted in by_index else device_by_part(wanted, described, "OpenCL devices")
    if index is None:
        names = "; ".join(f"{info.index} {info.name}" for info, _ in devices)
        raise InvalidOptionError(
            f"no OpenCL device {wanted!r}{f' ({ENV})' if from_environment else ''} here; choose one by P:D, its place"
            f" in this list from 0, or a part of its description: {names}"
        )
    return by_index[index]
