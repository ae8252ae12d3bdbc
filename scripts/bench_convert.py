"""Wall time and peak RSS of ``edgeinfer convert --target-size`` on checkpoints of real size.

    nice -n 19 python scripts/bench_convert.py --shape 0.5b --calib ../shared/data/text/kjv-genesis.txt
    nice -n 19 python scripts/bench_convert.py --shape 1b --layers 4 --calib ... --json /tmp/bench-1b.json

Builds a checkpoint of the shape's dimensions (once; kept under ``--work``) with random weights
scaled like trained ones: matrices and embeddings of standard deviation 0.02, norms near 1, in
BF16 safetensors, as real checkpoints ship. Their vocabulary is the real model's size (the
embedding is the largest matrix and the hardest on memory); the tokenizer is a small byte-level
BPE trained on the spot (``tests/hf_tokenizers.py``), its ids padded up to that size.

Each conversion runs the real CLI in a child process: the parent times it and reads the child's
own peak RSS from its ``--json`` report, and the stage lines it prints to stderr (not a terminal
here, so one line per step) give each stage's time. ``--layers N`` builds the first N layers of the
shape only: the conversion's cost grows with the layers, so a short one extrapolates to the whole.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any, get_args

import click
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "scripts")]  # this checkout's edgeinfer

from gguf_to_hf import write_safetensors  # noqa: E402
from hf_tokenizers import write_byte_level_bpe  # noqa: E402

from edgeinfer.converters.convert import Stage  # noqa: E402

# The dimensions of Qwen2.5-0.5B and Llama-3.2-1B (without its RoPE scaling, which the converter refuses).
SHAPES: dict[str, dict[str, Any]] = {
    "0.5b": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=896, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
    ),
    "1b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, intermediate_size=8192, vocab_size=128256,
        rope_theta=500_000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
    ),
}  # fmt: skip
# The first word of each stage's lines.
STAGES = get_args(Stage)
WEIGHT_STD = 0.02  # what trained checkpoints' matrices hold (their initializer_range)


def hf_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor's HF name and (out, in) shape, in the order transformers saves them."""
    e, ff, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    q, kv = e, e // n_head * n_kv
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, e)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (e,),
            p + "self_attn.q_proj.weight": (q, e),
            p + "self_attn.k_proj.weight": (kv, e),
            p + "self_attn.v_proj.weight": (kv, e),
            p + "self_attn.o_proj.weight": (e, q),
            p + "post_attention_layernorm.weight": (e,),
            p + "mlp.gate_proj.weight": (ff, e),
            p + "mlp.up_proj.weight": (ff, e),
            p + "mlp.down_proj.weight": (e, ff),
        }
        if config["model_type"] == "qwen2":
            shapes |= {p + f"self_attn.{x}_proj.bias": (n,) for x, n in (("q", q), ("k", kv), ("v", kv))}
    shapes["model.norm.weight"] = (e,)
    return shapes


def random_tensor(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Weights scaled like a trained model's, the same for a name whatever else is built."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    if name.endswith("norm.weight"):
        return (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    std = 0.1 if name.endswith(".bias") else WEIGHT_STD
    return (std * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32, copy=False)


def build(folder: Path, shape: str, layers: int | None) -> dict[str, Any]:
    """The checkpoint's config; writes it first unless ``folder`` already holds it."""
    config = {
        **SHAPES[shape],
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16",
    }
    if layers is not None:
        config["num_hidden_layers"] = layers
    done = folder / "config.json"
    if done.is_file() and json.loads(done.read_text()) == config:
        return config
    folder.mkdir(parents=True, exist_ok=True)
    write_byte_level_bpe(folder, pre="qwen2" if config["model_type"] == "qwen2" else "llama-bpe")
    shapes = hf_shapes(config)
    write_safetensors(folder / "model.safetensors", shapes, "bf16", lambda name: random_tensor(name, shapes[name]))
    done.write_text(json.dumps(config, indent=2))  # last: a config means the weights are complete
    return config


def convert(folder: Path, output: Path, target_size: int, calib: Path, sensitivity: str) -> dict[str, Any]:
    """Run ``edgeinfer convert`` in a child; its wall and CPU time, its report, and each stage's time."""
    command = [sys.executable, "-m", "edgeinfer", "convert", str(folder), "-o", str(output)]
    command += ["--target-size", str(target_size), "--calib", str(calib), "--sensitivity", sensitivity, "--json"]
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    child = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stages: dict[str, float] = {}
    lines: list[str] = []

    def follow() -> None:  # timestamps each stage's first line as it arrives
        assert child.stderr is not None
        for line in child.stderr:
            lines.append(line.rstrip("\n"))
            print(f"  | {lines[-1]}", file=sys.stderr, flush=True)
            stage = line.split(maxsplit=1)[0].rstrip(":") if line.strip() else ""
            if stage in STAGES:
                stages.setdefault(stage, time.perf_counter() - start)

    reader = threading.Thread(target=follow)
    reader.start()
    assert child.stdout is not None
    stdout = child.stdout.read()  # not communicate(): it would read stderr too, beside the thread
    child.wait()
    reader.join()
    wall = time.perf_counter() - start
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # CPU time says more than wall time on a shared machine: other jobs stretch the wall clock.
    cpu = cpu_after.ru_utime + cpu_after.ru_stime - cpu_before.ru_utime - cpu_before.ru_stime
    if child.returncode != 0:
        raise click.ClickException(f"the conversion failed ({child.returncode}): {lines[-1] if lines else ''}")
    report = json.loads(stdout)
    order = sorted(stages, key=stages.__getitem__)
    spans = {s: (stages[n] if n else wall) - stages[s] for s, n in zip(order, [*order[1:], None], strict=True)}
    return {"wall_s": wall, "cpu_s": cpu, "stage_s": spans, "report": report}


@click.command()
@click.option("--shape", type=click.Choice(list(SHAPES)), required=True)
@click.option("--layers", type=click.IntRange(min=1), help="Build only this many layers (extrapolate to the rest).")
@click.option("--calib", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True)
@click.option("--bpw", default=4.5, show_default=True, help="The target size, in bits per weight of the checkpoint.")
@click.option("--sensitivity", type=click.Choice(["kld", "activation"]), default="kld", show_default=True)
@click.option("--work", type=click.Path(file_okay=False, path_type=Path), default=Path("/tmp/bench-convert"))
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write the figures here.")
def main(
    shape: str, layers: int | None, calib: Path, bpw: float, sensitivity: str, work: Path, json_path: Path | None
) -> None:
    name = shape + (f"-{layers}l" if layers else "")
    folder = work / name
    config = build(folder, shape, layers)
    n_params = sum(int(np.prod(s)) for s in hf_shapes(config).values())
    target = int(n_params * bpw / 8) + (4 << 20)  # and room for the vocabulary and metadata
    print(f"{name}: {n_params / 1e6:.0f}M parameters, vocabulary {config['vocab_size']}, target {target} bytes")
    output = work / f"{name}-{sensitivity}-{os.getpid()}.gguf"  # runs side by side do not collide
    try:
        run = convert(folder, output, target, calib, sensitivity)
    finally:
        output.unlink(missing_ok=True)
    report = run["report"]
    figures = {
        "shape": shape,
        "layers": config["num_hidden_layers"],
        "n_params": n_params,
        "vocab": config["vocab_size"],
        "sensitivity": sensitivity,
        "target_size": target,
        "file_bytes": report["file_bytes"],
        "bits_per_weight": report["bits_per_weight"],
        "wall_s": round(run["wall_s"], 1),
        "cpu_s": round(run["cpu_s"], 1),
        "stage_s": {k: round(v, 1) for k, v in run["stage_s"].items()},
        "peak_rss_mib": round(report["peak_rss_bytes"] / 2**20),
        "type_mix": report["type_mix"],
    }
    print(json.dumps(figures, indent=2))
    if json_path is not None:
        json_path.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
