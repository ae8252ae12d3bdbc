"""ONNX Runtime: GGUF weights as the contrib operators onnxruntime runs low-bit LLMs with."""
