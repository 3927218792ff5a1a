"""ponder's own CPU kernels: the C++ sources (csrc/) and the loader that builds and loads them.
Tensors in, tensors out; they know nothing of ours but the start-up cache that keeps the build."""
