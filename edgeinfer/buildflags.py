"""CMake flags for building llama-cpp-python safely on this CPU, and for a contrasting build.

A native build (GGML_NATIVE=ON) compiles in every instruction set the CPU
reports. Some CPUs, and many VMs and containers, report AMX but fault on its
instructions (SIGILL in ggml_backend_amx_mul_mat at the first decode). Where AMX
is reported, build for the instruction sets the CPU has, with AMX off; elsewhere
the native build is right.

``python3 edgeinfer/buildflags.py --contrast`` prints the flags of a build that
runs here but uses other kernels than the native one (AVX2 without AVX-512 on an
AVX-512 CPU, AVX without AVX2 on an AVX2 CPU): CI runs the model-output tests
against it, because llama.cpp rounds differently in each, and a test that only
passes on one instruction set must not land.

Standard library only: ``scripts/setup.sh`` runs this file before anything else is installed.
"""

from __future__ import annotations

from pathlib import Path

# /proc/cpuinfo flag -> the ggml option that uses it.
_X86_OPTIONS = (
    ("avx", "GGML_AVX"),
    ("avx2", "GGML_AVX2"),
    ("fma", "GGML_FMA"),
    ("f16c", "GGML_F16C"),
    ("bmi2", "GGML_BMI2"),
    ("avx512f", "GGML_AVX512"),
    ("avx512vbmi", "GGML_AVX512_VBMI"),
    ("avx512_vnni", "GGML_AVX512_VNNI"),
    ("avx512_bf16", "GGML_AVX512_BF16"),
)
_AMX_OPTIONS = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return flags


def safe_cmake_args(flags: set[str] | None = None) -> str:
    """CMAKE_ARGS for this CPU: empty (a native build) unless it reports AMX."""
    flags = cpu_flags() if flags is None else flags
    if not any(f.startswith("amx") for f in flags):
        return ""
    options = ["-DGGML_NATIVE=OFF"]
    options += [f"-D{option}={'ON' if flag in flags else 'OFF'}" for flag, option in _X86_OPTIONS]
    options += [f"-D{option}=OFF" for option in _AMX_OPTIONS]
    return " ".join(options)


def contrast_cmake_args(flags: set[str] | None = None) -> str:
    """CMAKE_ARGS for a build one instruction-set tier below this CPU's best, with AMX off.

    On an AVX-512 CPU: AVX2, FMA, F16C and BMI2, no AVX-512. On an AVX2 CPU without
    AVX-512: AVX and F16C, no AVX2, FMA or BMI2. Elsewhere: every x86 option off.
    """
    flags = cpu_flags() if flags is None else flags
    if "avx512f" in flags:
        kept = {"avx", "avx2", "fma", "f16c", "bmi2"}
    elif "avx2" in flags:
        kept = {"avx", "f16c"}
    else:
        kept = set()
    options = ["-DGGML_NATIVE=OFF"]
    options += [f"-D{option}={'ON' if flag in flags & kept else 'OFF'}" for flag, option in _X86_OPTIONS]
    options += [f"-D{option}=OFF" for option in _AMX_OPTIONS]
    return " ".join(options)


def rebuild_command(flags: set[str] | None = None) -> str:
    """The shell command that reinstalls llama-cpp-python with safe flags."""
    args = safe_cmake_args(flags) or "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
    return f'CMAKE_ARGS="{args}" pip install --no-cache-dir --force-reinstall --no-deps llama-cpp-python'


if __name__ == "__main__":
    import sys

    print(contrast_cmake_args() if sys.argv[1:] == ["--contrast"] else safe_cmake_args())
