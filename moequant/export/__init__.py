"""Writing what engines load: export_checkpoint and the streamed export write any layout of the registry
(moequant.layouts, one file per layout), the GGUF file writer (gguf), and the checks by the engines
themselves (verify_vllm, verify_llamacpp with its llamacpp_worker)."""
