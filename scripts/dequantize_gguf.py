"""Write a copy of a GGUF model with every tensor dequantized to F32 (or F16, or requantized to Q8_0).

The copy has the same metadata and tokenizer, so llama.cpp and the reference backend can be
compared without llama.cpp's 8-bit activation rounding for quantized weights, which differs
between its batched and one-token paths:

    python scripts/dequantize_gguf.py smollm2-135m /tmp/smollm2-f32.gguf
    edgeinfer eval /tmp/smollm2-f32.gguf --text ../shared/data/text/kjv-genesis.txt --ctx 1024 \
        --backend reference --base-backend llamacpp
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType

from edgeinfer.converters.quantize import quantize
from edgeinfer.files import atomic_path
from edgeinfer.models.catalog import resolve_model
from edgeinfer.models.info import ModelInfo, load_model_info
from edgeinfer.models.tensors import open_tensors

FILE_TYPES = {
    "f32": (GGMLQuantizationType.F32, LlamaFileType.ALL_F32),
    "f16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
    "q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
}


def copy_metadata(reader: GGUFReader, writer: GGUFWriter, file_type: LlamaFileType) -> None:
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":  # the writer sets these
            continue
        if name == "general.file_type":
            writer.add_uint32(name, int(file_type))
            continue
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            if field.types[-1] == GGUFValueType.STRING:
                writer.add_array(name, [bytes(field.parts[i]) for i in field.data])
            else:
                writer.add_array(name, [field.parts[i][0].item() for i in field.data])
        elif kind == GGUFValueType.STRING:
            writer.add_string(name, bytes(field.parts[field.data[0]]).decode())
        else:
            writer.add_key_value(name, field.parts[field.data[0]][0].item(), kind)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a .gguf path or catalog alias")
    parser.add_argument("output", type=Path)
    parser.add_argument("--type", choices=sorted(FILE_TYPES), default="f32")
    args = parser.parse_args()
    write_copy(load_model_info(resolve_model(args.model)), args.output, args.type)
    print(f"wrote {args.output} ({args.output.stat().st_size / 2**20:,.1f} MiB)")


def write_copy(info: ModelInfo, output: Path, kind: str) -> None:
    """Write ``info``'s model to ``output`` with every matrix as ``kind`` (a FILE_TYPES name); vectors stay F32."""
    qtype, file_type = FILE_TYPES[kind]
    with atomic_path(output) as partial:
        writer = GGUFWriter(partial, info.architecture)
        copy_metadata(GGUFReader(info.path), writer, file_type)
        with open_tensors(info) as tensors:
            for name in tensors:
                data = tensors.dequantize(name)
                if data.ndim == 1:  # norms stay F32
                    writer.add_tensor(name, data)
                else:
                    blocks = quantize(data, qtype)
                    writer.add_tensor(name, blocks, raw_dtype=qtype if blocks.dtype == np.uint8 else None)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()


if __name__ == "__main__":
    main()
