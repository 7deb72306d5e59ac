"""Weights as users have them, turned into loaded models: HF checkpoints and `.gguf` files (`loading`), GGUF
blocks read as stored (`gguf`), a rank's or stage's slice of a checkpoint (`slices`) and the embedded model
(`embedded`).

Built on `families/` and `kernels/`; knows nothing of KV pools or serving.
"""
