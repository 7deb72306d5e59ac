"""What a decoder-only family computes: its layer read from its config (`arch`), its weights fused and packed
for the lean forward (`weights`), that forward (`lean`) and a sequence's cache with rollback (`sequence`).

Built on `kernels/`; knows nothing of files, KV pools or serving.
"""
