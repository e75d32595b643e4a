"""Writing what engines load: export_checkpoint and the streamed export write any layout of the registry
(moequant.layouts, one file per layout) and the GGUF file writer (gguf). The checks by the engines themselves
live with the tests (tests/support/), llama.cpp's runner in moequant.llamacpp."""
