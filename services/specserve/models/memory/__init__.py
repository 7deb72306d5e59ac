"""A worker's KV memory: one preallocated arena for all its sessions (`pool`), the static-shape step runner
over it (`runner`: CUDA graphs, compiled steps) and the prefix cache of finished sequences (`prefix`).

Built on `families/` and `kernels/`; knows nothing of files or of how tokens are accepted.
"""
