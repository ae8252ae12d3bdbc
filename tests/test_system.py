"""Refusing early: the native-build probe, the memory estimate, and thread counts."""

from __future__ import annotations

import json
import sys

import pytest

from edgeinfer import BackendUnavailableError, Engine, InsufficientMemoryError
from edgeinfer.buildflags import contrast_cmake_args, cpu_flags, rebuild_command, safe_cmake_args
from edgeinfer.models.info import load_model_info
from edgeinfer.system import (
    INTERESTING_CPU_FLAGS,
    available_ram,
    cache_dir,
    check_memory,
    cpu_features,
    default_threads,
    estimate_memory,
    probe_native_build,
    usable_cores,
)


def test_probe_passes_on_this_build_and_is_remembered(model_path):
    state = cache_dir() / "native-probe.json"
    state.unlink(missing_ok=True)
    probe_native_build(model_path)
    verdicts = json.loads(state.read_text())
    assert list(verdicts.values()) == ["ok"]
    probe_native_build(model_path)  # second time: read from the cache, no child
    assert json.loads(state.read_text()) == verdicts


def test_a_child_killed_by_sigill_becomes_the_rebuild_advice(model_path):
    # A real process dying of SIGILL, as an AMX-faulting llama.cpp does at its first decode.
    crash = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGILL)"]
    with pytest.raises(BackendUnavailableError) as info:
        probe_native_build(model_path, command=crash)
    message = str(info.value)
    assert "illegal instruction" in message and "\n" not in message
    assert "-DGGML_AMX_TILE=OFF" in message and "pip install --no-cache-dir" in message


def test_other_native_crashes_are_named(model_path):
    crash = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]
    with pytest.raises(BackendUnavailableError, match="SIGSEGV"):
        probe_native_build(model_path, command=crash)


def test_build_flags_turn_amx_off_only_where_the_cpu_reports_it():
    amx_cpu = {"avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512_vnni", "amx_tile", "amx_int8"}
    args = safe_cmake_args(amx_cpu)
    assert "-DGGML_NATIVE=OFF" in args and "-DGGML_AMX_INT8=OFF" in args
    assert "-DGGML_AVX512=ON" in args and "-DGGML_AVX512_BF16=OFF" in args
    assert safe_cmake_args({"avx", "avx2"}) == ""  # no AMX: the native build is right
    assert "--no-cache-dir" in rebuild_command(amx_cpu)


def test_contrast_build_is_one_instruction_set_tier_below_the_cpu():
    base = {"avx", "avx2", "fma", "f16c", "bmi2"}
    avx512 = contrast_cmake_args(base | {"avx512f", "avx512vbmi", "avx512_vnni", "amx_tile"})
    assert "-DGGML_NATIVE=OFF" in avx512 and "-DGGML_AVX2=ON" in avx512 and "-DGGML_FMA=ON" in avx512
    assert "-DGGML_AVX512=OFF" in avx512 and "-DGGML_AVX512_VNNI=OFF" in avx512 and "-DGGML_AMX_INT8=OFF" in avx512
    avx2 = contrast_cmake_args(base)
    assert "-DGGML_AVX=ON" in avx2 and "-DGGML_AVX2=OFF" in avx2 and "-DGGML_FMA=OFF" in avx2
    assert "=ON" not in contrast_cmake_args({"sse4_2"})
    # What this machine's CI builds: never an instruction set the CPU lacks.
    here = cpu_flags()
    for flag, option in (("avx512f", "GGML_AVX512"), ("avx2", "GGML_AVX2"), ("avx", "GGML_AVX")):
        if f"-D{option}=ON" in contrast_cmake_args():
            assert flag in here


def test_memory_estimate_and_refusal(model_path):
    info = load_model_info(model_path)
    estimate = estimate_memory(info, kv_tokens=512, kv_type="f16", batch_size=512)
    assert estimate.weights == info.file_size and estimate.kv == 512 * 23040
    check_memory(estimate, force=False)  # 200 MB fits here
    huge = type(estimate)(weights=available_ram() * 2, kv=estimate.kv, overhead=estimate.overhead)
    with pytest.raises(InsufficientMemoryError) as exc:
        check_memory(huge, force=False)
    assert "--force" in str(exc.value) and "--kv-budget" in str(exc.value)
    check_memory(huge, force=True)


def test_machine_facts():
    assert 1 <= default_threads() <= usable_cores()
    features = cpu_features()
    assert features == [f for f in INTERESTING_CPU_FLAGS if f in set(features)]  # fixed order, no duplicates
    assert set(features) <= cpu_flags()
    assert available_ram() > 0


def test_engine_passes_its_threads_to_llama_cpp(model_path):
    import llama_cpp

    with Engine(model_path, kv_budget="512tok", threads=1) as engine:
        assert engine.threads == 1
        assert llama_cpp.llama_n_threads(engine.backend._ctx) == 1


def test_engine_runs_the_probe_before_loading(model_path):
    state = cache_dir() / "native-probe.json"
    state.unlink(missing_ok=True)
    with Engine(model_path, kv_budget="512tok", threads=1):
        assert list(json.loads(state.read_text()).values()) == ["ok"]


def test_a_damaged_probe_cache_is_ignored(model_path):
    state = cache_dir() / "native-probe.json"
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text("[]")
    probe_native_build(model_path)
    assert list(json.loads(state.read_text()).values()) == ["ok"]
