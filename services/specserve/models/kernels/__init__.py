"""What multiplies: weight-only quantized linears (`quant`), specserve's CPU kernels (`cpu`, C++ in `csrc/`,
and `fused`: a step's decoder layers as one call each), tensor-parallel splits and collectives (`tp`).

Knows no model family, file format or KV pool: the rooms above hand it tensors and shapes.
"""
