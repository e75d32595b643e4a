"""Writing what engines load: export_checkpoint (write.py) and the streamed export write any layout of the
registry (moequant.layouts, one file per layout); gguf.py is the GGUF file writer. The checks by the engines
themselves live with the tests (tests/support/), llama.cpp's runner in moequant.llamacpp."""
