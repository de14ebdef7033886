"""CUDA-only decode machinery: captured decode steps and the warm-up before serving."""
