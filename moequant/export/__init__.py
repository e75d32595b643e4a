"""Writing what engines load: one class per safetensors layout, looked up by name in `layouts.LAYOUTS`
(compressed-tensors, gptq, awq, deepseek-fp8, gpt-oss-mxfp4, gguf), the GGUF writer (gguf), and the
checks by the engines themselves (verify_vllm, verify_llamacpp with its llamacpp_worker)."""
