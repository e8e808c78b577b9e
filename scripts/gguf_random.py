"""Random tensors for the random-weight test models (scripts/write-random-*.py): one seeded
generator, normal values, Q8_0 matrices and RMSNorm weights near 1."""
import numpy as np
import gguf

Q8 = gguf.GGMLQuantizationType.Q8_0


class Random:
    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    def normal(self, shape, std):
        return self.rng.standard_normal(shape, dtype=np.float32) * std

    def q8_0(self, rows, cols, std):
        return gguf.quants.quantize(self.normal((rows, cols), std), Q8)

    def norm(self, n):
        return 1 + self.normal(n, 0.1)
