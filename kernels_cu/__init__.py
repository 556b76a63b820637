"""CUDA C sources of cupaged, shipped as package data and compiled at run time by NVRTC."""
