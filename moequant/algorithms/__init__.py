"""Quantization algorithms for the experts of one MoE layer: RTN, GPTQ (batched), AWQ."""
