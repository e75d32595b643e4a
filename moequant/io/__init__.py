"""Reading and writing checkpoints: lazy per-tensor safetensors reading and atomic sharded writing
(checkpoint), quantized sources decoded as they are read (dequant: compressed-tensors, DeepSeek FP8,
gpt-oss MXFP4, GPTQ, AWQ), one decoder layer at a time (layers), and our exports back into a
transformers model (loader)."""
