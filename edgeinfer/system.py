"""What this machine can give: CPU features, free cores, RAM, and a native build that runs.

Everything here is about refusing early with a clear line rather than crashing
late: a model that will not fit in RAM, a thread count that would oversubscribe
busy cores, and a llama.cpp build whose AMX kernels fault on this CPU.
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
import tempfile
from dataclasses import dataclass
from pathlib import Path

import psutil

from edgeinfer.buildflags import cpu_flags, rebuild_command
from edgeinfer.errors import BackendUnavailableError, InsufficientMemoryError
from edgeinfer.models.info import ModelInfo

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


def free_cores(sample_s: float = 0.1) -> int:
    """Usable cores minus the load other processes put on them right now (at least 1).

    llama.cpp's threads spin while they wait; one thread more than the free cores
    can cut throughput tenfold, so this errs on the side of fewer.
    """
    cores = usable_cores()
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    per_cpu = psutil.cpu_percent(interval=sample_s, percpu=True)
    if allowed is not None:
        per_cpu = [per_cpu[i] for i in allowed if i < len(per_cpu)]
    busy = sum(per_cpu) / 100.0
    return max(1, min(cores, int(len(per_cpu) - busy + 0.25)))


def default_threads() -> int:
    """Threads for llama.cpp: the free cores, but no more than the physical ones."""
    physical = psutil.cpu_count(logical=False) or usable_cores()
    return max(1, min(physical, free_cores()))


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


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a loaded model will need."""

    weights: int
    kv: int
    overhead: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.overhead


def estimate_memory(
    info: ModelInfo, kv_tokens: int, kv_type: str, batch_size: int, weights: int | None = None
) -> MemoryEstimate:
    """Weights (default: the file, mapped), the KV cache and the compute buffers for one batch."""
    kv = int(kv_tokens * info.kv_bytes_per_token(kv_type))
    # One batch of activations and the logits row buffer, in f32.
    compute = 4 * batch_size * (info.hparams.n_vocab + 8 * info.hparams.n_embd)
    return MemoryEstimate(
        weights=info.file_size if weights is None else weights, kv=kv, overhead=BASE_OVERHEAD_BYTES + compute
    )


def check_memory(estimate: MemoryEstimate, *, force: bool) -> None:
    """Refuse to load what will not fit in RAM, unless forced."""
    available = available_ram()
    if estimate.total > available and not force:
        mb = 2**20
        raise InsufficientMemoryError(
            f"the model needs about {estimate.total / mb:.0f} MiB (weights {estimate.weights / mb:.0f}, "
            f"KV cache {estimate.kv / mb:.0f}, buffers {estimate.overhead / mb:.0f}) but only "
            f"{available / mb:.0f} MiB is available; lower --kv-budget, pick a smaller model, or pass --force"
        )


def cache_dir() -> Path:
    """Where edgeinfer keeps small state (``EDGEINFER_CACHE_DIR`` overrides)."""
    if os.environ.get("EDGEINFER_CACHE_DIR"):
        return Path(os.environ["EDGEINFER_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "edgeinfer"


def _native_build_id() -> str | None:
    """A fingerprint of the installed llama.cpp shared libraries (path, size, mtime)."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    lib_dir = Path(next(iter(spec.submodule_search_locations))) / "lib"
    libs = sorted(lib_dir.glob("*.so*")) + sorted(lib_dir.glob("*.dylib")) + sorted(lib_dir.glob("*.dll"))
    digest = hashlib.sha256()
    for lib in libs:
        stat = lib.stat()
        digest.update(f"{lib}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    return digest.hexdigest()[:16]


PROBE_TIMEOUT_S = 300
# Loads the model and runs a prompt batch and a single-token decode: the two matmul paths.
_PROBE_CODE = (
    "import sys\n"
    "from edgeinfer.backends.base import BackendOptions\n"
    "from edgeinfer.backends.llamacpp import LlamaCppBackend\n"
    "from edgeinfer.models.info import load_model_info\n"
    "options = BackendOptions(kv_tokens=256, threads=1, batch_size=32)\n"
    "b = LlamaCppBackend(load_model_info(sys.argv[1]), options, probe=False)\n"
    "b.eval([1, 2, 3, 4, 5, 6, 7, 8], 0)\n"
    "b.eval([9], 8)\n"
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
    package_root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    try:
        child = subprocess.run(
            command or [sys.executable, "-c", _PROBE_CODE, str(model_path)],
            env=env, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
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
            _write_atomic(state_file, json.dumps(verified))


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
