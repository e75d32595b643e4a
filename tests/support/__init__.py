"""Harnesses of the test suite and the benchmarks, not of the library: the engines we did not write (vLLM's CPU
build, GPTQModel, llama.cpp's own tools) built into their own venvs and run on our exports."""
