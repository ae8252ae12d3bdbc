"""What this machine can give: CPU features, free cores, RAM, and a native build that runs.

Everything here is about refusing early with a clear line rather than crashing
late: a model that will not fit in RAM, a thread count that would oversubscribe
busy cores, and a llama.cpp build whose AMX kernels fault on this CPU. It also
holds the few facts about this process that several parts need: its peak RSS,
llama.cpp's shared libraries, and the environment of a child Python.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from edgeinfer.buildflags import cpu_flags, rebuild_command
from edgeinfer.errors import BackendUnavailableError, InsufficientMemoryError, InvalidOptionError
from edgeinfer.files import write_atomic

# CPU flags that decide which ggml kernels can run.
INTERESTING_CPU_FLAGS = (
    "sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl",
    "avx512_vnni", "avx512_bf16", "avx512vbmi", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16",
    "asimd", "asimddp", "i8mm", "sve", "sve2", "fphp", "asimdhp",
)  # fmt: skip

# Runtime buffers beyond weights and KV: llama.cpp's compute graph and logits, Python, numpy.
BASE_OVERHEAD_BYTES = 96 * 2**20


def cpu_features() -> list[str]:
    """The CPU flags that matter to ggml, in a fixed order."""
    flags = cpu_flags()
    return [f for f in INTERESTING_CPU_FLAGS if f in flags]


def usable_cores() -> int:
    """Cores this process may run on: its affinity mask, capped by a cgroup CPU quota."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cores = min(cores, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cores


@dataclass(frozen=True)
class _CpuTimes:
    """When, and how much CPU time every core and this process had spent, for the load between two of them."""

    at: float
    busy: tuple[float, ...]  # per core, in seconds: all but idle and I/O wait
    own: float  # this process's threads, together

    @classmethod
    def now(cls) -> _CpuTimes:
        cores = psutil.cpu_times(percpu=True)
        own = psutil.Process().cpu_times()
        busy = tuple(
            c.user + c.nice + c.system + getattr(c, "irq", 0) + getattr(c, "softirq", 0) + getattr(c, "steal", 0)
            for c in cores
        )
        return cls(time.monotonic(), busy, own.user + own.system)


# The load other processes put on the cores is measured over a window that ends when the threads are chosen.
# It starts at the last measurement, the first at this import: a command that loads a model chooses its threads
# a few tenths of a second later, and needs no sleep of its own for them. A window shorter than MIN_WINDOW_S says
# too little, and one older than MAX_WINDOW_S is stale: then a fresh one is slept through.
MIN_WINDOW_S = 0.05
MAX_WINDOW_S = 2.0
_last_times = _CpuTimes.now()


def free_cores(sample_s: float = 0.1) -> int:
    """Usable cores minus the load other processes put on them lately (at least 1): over the time since the
    last call, or this module's import, where that is recent enough; else over ``sample_s`` from now.

    This process's own work (its imports, a model's load) is not counted against it. llama.cpp's threads
    spin while they wait; one thread more than the free cores can cut throughput tenfold, so this errs on
    the side of fewer.
    """
    global _last_times
    start = _last_times
    fresh = len(start.busy) == len(psutil.cpu_times(percpu=True))  # a core brought up or down since: start over
    if not fresh or not MIN_WINDOW_S <= time.monotonic() - start.at <= MAX_WINDOW_S:
        start = _CpuTimes.now()
        time.sleep(sample_s)
    end = _last_times = _CpuTimes.now()
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else range(len(end.busy))
    allowed = [i for i in allowed if i < len(end.busy)]
    busy = sum(end.busy[i] - start.busy[i] for i in allowed) - (end.own - start.own)
    others = max(0.0, busy / (end.at - start.at))  # cores' worth of other processes' work
    return max(1, min(usable_cores(), int(len(allowed) - others + 0.25)))


def thread_count(requested: int | None = None, *, spinning: bool = True, spare: int = 0) -> int:
    """How many threads native work runs on; every thread count in edgeinfer comes from here.

    ``requested`` (``--threads``) is capped at the usable cores: more makes llama.cpp's spinning
    threads fight, up to 100x slower. Without it: for ``spinning`` threads (llama.cpp's, which
    spin while they wait) the free cores, no more than the physical ones, less ``spare`` cores
    left to other work (the chat's UI); for threads that sleep while they wait (a pool over
    ggml's quantizers), every usable core, without the 0.1 s it takes to measure the free ones.
    """
    if requested is not None:
        if requested < 1:
            raise InvalidOptionError(f"threads must be at least 1, got {requested}")
        return min(requested, usable_cores())
    if not spinning:
        return usable_cores()
    physical = psutil.cpu_count(logical=False) or usable_cores()
    return max(1, min(physical, free_cores()) - spare)


def available_ram() -> int:
    """Bytes that can be allocated now, honouring a cgroup memory limit."""
    available = psutil.virtual_memory().available
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass
    return max(0, available)


def peak_rss() -> int:
    """This process's peak resident set so far, in bytes."""
    if sys.platform == "win32":
        return int(psutil.Process().memory_info().peak_wset)
    if sys.platform == "linux":
        # Not ru_maxrss: Linux carries it over from the parent across fork and exec, so a child
        # started by a parent that had just read a large buffer would report the parent's peak.
        with contextlib.suppress(OSError), open("/proc/self/status") as status:  # no /proc: ru_maxrss below
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    import resource  # Unix only, so imported where Windows never gets

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS counts bytes, Linux and the BSDs KiB


@dataclass(frozen=True)
class MemoryNeed:
    """Bytes a loaded model will take: on the host, and on its device when it has one.

    A backend fills it in (``Backend.memory``), since only it knows where it puts what.
    """

    weights: int  # host bytes from here to ``overhead``
    kv: int
    overhead: int
    device: str = "cpu"
    device_bytes: int = 0  # weights and KV placed on ``device``
    device_free: int | None = None  # what ``device`` has free; None: nothing to check

    @property
    def total(self) -> int:
        """Host bytes."""
        return self.weights + self.kv + self.overhead


def check_memory(need: MemoryNeed, *, force: bool) -> None:
    """Refuse to load what will not fit in RAM, or in the device's memory, unless forced."""
    if force:
        return
    mb = 2**20
    available = available_ram()
    if need.total > available:
        raise InsufficientMemoryError(
            f"the model needs about {need.total / mb:.0f} MiB of RAM (weights {need.weights / mb:.0f}, "
            f"KV cache {need.kv / mb:.0f}, buffers {need.overhead / mb:.0f}) but only "
            f"{available / mb:.0f} MiB is available; lower --kv-budget, pick a smaller model, or pass --force"
        )
    if need.device_free is not None and need.device_bytes > need.device_free:
        raise InsufficientMemoryError(
            f"the layers placed on {need.device} need about {need.device_bytes / mb:.0f} MiB of its memory but only "
            f"{need.device_free / mb:.0f} MiB is free; lower --gpu-layers or --kv-budget, or pass --force"
        )


def cache_dir() -> Path:
    """Where edgeinfer keeps small state (``EDGEINFER_CACHE_DIR`` overrides). A leading ``~`` is the home folder,
    as a shell would have made it: an environment file or a service's settings pass it as it is written."""
    if os.environ.get("EDGEINFER_CACHE_DIR"):
        return Path(os.environ["EDGEINFER_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "edgeinfer"


def llama_cpp_libraries() -> list[Path] | None:
    """The shared libraries llama-cpp-python ships (its ``lib`` folder); None where it is not installed."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    lib_dir = Path(next(iter(spec.submodule_search_locations))) / "lib"
    return sorted(lib_dir.glob("*.so*")) + sorted(lib_dir.glob("*.dylib")) + sorted(lib_dir.glob("*.dll"))


def llama_cpp_library(stem: str) -> Path | None:
    """One of those libraries by stem (``"ggml-base"``), whatever the platform calls its file."""
    names = {f"lib{stem}.so", f"lib{stem}.dylib", f"{stem}.dll", f"lib{stem}.dll"}
    return next((lib for lib in llama_cpp_libraries() or () if lib.name in names), None)


def child_env() -> dict[str, str]:
    """This environment for a child Python: the folder this edgeinfer was imported from goes first on
    PYTHONPATH, so ``python -m edgeinfer...`` in the child runs this code, not another install of it."""
    package_root = str(Path(__file__).resolve().parent.parent)
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))


def _native_build_id() -> str | None:
    """A fingerprint of the installed llama.cpp shared libraries (path, size, mtime)."""
    libs = llama_cpp_libraries()
    if libs is None:
        return None
    digest = hashlib.sha256()
    for lib in libs:
        stat = lib.stat()
        digest.update(f"{lib}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    return digest.hexdigest()[:16]


PROBE_TIMEOUT_S = 300
# Loads the model and runs a prompt batch and a single-token decode: the two matmul paths.
_PROBE_CODE = (
    "import sys\n"
    "from edgeinfer.backends.base import BackendOptions, Span\n"
    "from edgeinfer.backends.llamacpp import LlamaCppBackend\n"
    "from edgeinfer.models.info import load_model_info\n"
    "options = BackendOptions(kv_tokens=256, threads=1, batch_size=32)\n"
    "b = LlamaCppBackend(load_model_info(sys.argv[1]), options, probe=False)\n"
    "b.eval([Span(0, 0, [1, 2, 3, 4, 5, 6, 7, 8])])\n"
    "b.eval([Span(0, 8, [9])])\n"
)


def probe_native_build(model_path: Path, *, command: list[str] | None = None) -> None:
    """Run a decode in a child process once per llama.cpp build; turn a SIGILL into advice.

    Some CPUs (and VMs, containers) advertise AMX but fault on its instructions, and a
    natively built llama.cpp then dies at the first decode with no Python traceback.
    ``command`` replaces the probe child, for testing the verdict on a real crash.
    """
    build = _native_build_id()
    state_file = cache_dir() / "native-probe.json"
    try:
        verified = json.loads(state_file.read_text())
    except (OSError, ValueError):
        verified = {}
    if not isinstance(verified, dict):  # damaged by hand or by a crash elsewhere: start afresh
        verified = {}
    if command is None and build is not None and verified.get(build) == "ok":
        return
    try:
        child = subprocess.run(
            command or [sys.executable, "-c", _PROBE_CODE, str(model_path)],
            env=child_env(), capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise BackendUnavailableError(
            f"llama.cpp took over {PROBE_TIMEOUT_S} s to decode one token of {model_path.name} in a test process; "
            "the machine is overloaded or the build is broken"
        ) from None
    if child.returncode == -signal.SIGILL:
        raise BackendUnavailableError(
            "llama.cpp faults on this CPU with an illegal instruction (its AMX kernels are built in but this "
            f"machine or VM cannot run them); rebuild it without AMX: {rebuild_command()}"
        )
    if child.returncode < 0:
        raise BackendUnavailableError(
            f"llama.cpp crashed (signal {signal.Signals(-child.returncode).name}) running {model_path.name}; "
            f"try the rebuild: {rebuild_command()}"
        )
    if child.returncode != 0:
        # An ordinary error: the real load will raise it again with its own message.
        return
    if command is None and build is not None:
        verified[build] = "ok"
        with contextlib.suppress(OSError):  # a read-only home: probe again next time rather than fail
            state_file.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(state_file, json.dumps(verified))
