#!/usr/bin/env python3
"""`python -m mlx_lm.server` with the model computing in float32, as `mlx-spec serve` does.

mlx_lm.server has no dtype flag: it computes in the stored dtype, and the default 4-bit model
stores float16 scales and norms, which MLX's CPU backend runs about 100x slower than float32
(`_qmm_t<float16>`, seen with gdb in its generation thread). The other mlx-lm baselines of
`cargo xtask bench-*` call `model.set_dtype(mx.float32)` after `load`; this does the same inside
the server (wrapping `mlx_lm.server.load`), then runs the server's own `main` with the given argv.
"""

import sys

import mlx.core as mx
import mlx_lm.server as server

_load = server.load


def load_float32(*args, **kwargs):
    out = _load(*args, **kwargs)
    out[0].set_dtype(mx.float32)
    return out


server.load = load_float32

if __name__ == "__main__":
    sys.argv[0] = "mlx_lm.server"
    server.main()
