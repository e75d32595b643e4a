"""llama.cpp, the engine moequant runs beside itself: `runner` builds llama-cpp-python once into its own venv
and runs ggml's quantizer, dequantizer and logits there through `worker.py` (a process that imports no
moequant); `evaluate` scores a GGUF export in llama.cpp against the original in transformers."""
