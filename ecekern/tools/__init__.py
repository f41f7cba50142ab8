"""Offline tools: programs that inspect the library's kernels without a GPU."""
