"""Quantize a GGUF with llama.cpp's own recipe (llama_model_quantize), as llama-quantize would.

The converter's benchmark measures against these files: llama.cpp's Q4_K_M and Q3_K_M made from
the same F16/F32 GGUF. llama.cpp picks each tensor's type itself (and falls back to another where
a row length does not fit a K-quant's 256-wide blocks); the table printed at the end shows what it chose.

    python scripts/llamacpp_quantize.py /tmp/smollm2-f16.gguf /tmp/smollm2-q4_k_m.gguf --type Q4_K_M

The quantization runs in a child process, as llama.cpp aborts the process on some inputs; the
output is written to a temporary file and renamed once complete.
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import llama_cpp

from edgeinfer.errors import BackendError, EdgeInferError, InvalidOptionError
from edgeinfer.files import atomic_path
from edgeinfer.models.info import ModelInfo, load_model_info
from edgeinfer.system import child_env, thread_count

# Every file type this llama.cpp knows, by the name llama-quantize uses (Q4_K_M, Q8_0, F16...).
FILE_TYPES = {
    name.removeprefix("LLAMA_FTYPE_").removeprefix("MOSTLY_").removeprefix("ALL_"): getattr(llama_cpp, name)
    for name in dir(llama_cpp)
    if name.startswith(("LLAMA_FTYPE_MOSTLY_", "LLAMA_FTYPE_ALL_"))
}


# The child process: llama.cpp aborts the whole process on some inputs. It sees the parent's import path.
_CHILD = """
import sys
from edgeinfer.backends.llamacpp import last_log_lines, llama_lib
lib = llama_lib()
params = lib.llama_model_quantize_default_params()
params.ftype, params.nthread = int(sys.argv[3]), int(sys.argv[4])
if lib.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params) != 0:
    sys.exit(last_log_lines(1) or "llama_model_quantize returned an error")
"""


def quantize_with_llamacpp(src: str | Path, dst: str | Path, ftype: str, threads: int) -> None:
    """Write ``src`` quantized by llama.cpp's ``ftype`` recipe (e.g. ``"Q4_K_M"``) to ``dst``.

    Raises BackendError with llama.cpp's last words if it fails or aborts.
    """
    src, dst, ftype = Path(src), Path(dst), ftype.upper()
    if ftype not in FILE_TYPES:
        raise InvalidOptionError(
            f"unknown llama.cpp file type {ftype!r}; choose one of {', '.join(sorted(FILE_TYPES))}"
        )
    if not dst.parent.is_dir():
        raise InvalidOptionError(f"the folder {dst.parent} does not exist; create it first")
    load_model_info(src)  # a one-line error for a file llama.cpp would choke on
    with atomic_path(dst) as partial:  # a failed or interrupted run leaves nothing behind
        child = subprocess.run(
            [sys.executable, "-c", _CHILD, str(src), str(partial), str(FILE_TYPES[ftype]), str(threads)],
            capture_output=True,
            text=True,
            env={**child_env(), "GGML_NO_BACKTRACE": "1"},
        )
        if child.returncode != 0:
            how = f"aborted (signal {-child.returncode})" if child.returncode < 0 else "failed"
            last_words = [line.strip() for line in child.stderr.splitlines() if line.strip()] or ["no reason given"]
            raise BackendError(f"llama.cpp {how} quantizing {src.name} to {ftype}: {last_words[-1]}")


def type_table(info: ModelInfo) -> list[str]:
    """One line per tensor type: how many tensors, which roles (``blk.N.`` dropped), and their bits per weight."""
    roles: dict[str, Counter[str]] = defaultdict(Counter)
    sizes: Counter[str] = Counter()
    weights: Counter[str] = Counter()
    for t in info.tensors:
        roles[t.type.name][re.sub(r"^blk\.\d+\.", "", t.name)] += 1
        sizes[t.type.name] += t.nbytes
        weights[t.type.name] += math.prod(t.shape)
    return [
        f"{kind:6} {sum(roles[kind].values()):4} tensors {8 * sizes[kind] / weights[kind]:5.2f} bpw  "
        + ", ".join(f"{role} x{n}" for role, n in sorted(roles[kind].items()))
        for kind in sorted(roles, key=lambda k: -sizes[k])
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path, help="an F32/F16/BF16 GGUF")
    parser.add_argument("dst", type=Path)
    parser.add_argument("--type", required=True, help="llama.cpp's file type: Q4_K_M, Q3_K_M, Q8_0...")
    parser.add_argument("--threads", type=int, default=thread_count())
    args = parser.parse_args()
    try:
        quantize_with_llamacpp(args.src, args.dst, args.type, args.threads)
        info = load_model_info(args.dst)
    except EdgeInferError as exc:
        sys.exit(f"error: {exc}")
    bpw = 8 * sum(t.nbytes for t in info.tensors) / sum(math.prod(t.shape) for t in info.tensors)
    print(f"wrote {args.dst} ({info.file_size / 2**20:,.2f} MiB; tensors {bpw:.3f} bits per weight)")
    print("\n".join(type_table(info)))


if __name__ == "__main__":
    main()
