"""KNorm as a kvreplay Python scorer: a port of replay/src/policies/knorm.rs."""
import numpy as np

import kvreplay


class KNorm(kvreplay.Scorer):
    def __init__(self, skip_layers="0;1"):
        super().__init__(skip_layers=skip_layers)
        s = str(skip_layers)
        self.skip_layers = [] if s in ("", "none") else [int(x) for x in s.split(";")]

    def score(self, ctx):
        k = ctx.keys.astype(np.float64)  # (n_kv_heads, P, d)
        # -||k||_2, squares summed in f64 in order (as the Rust does)
        return -np.sqrt(np.cumsum(k * k, axis=-1)[..., -1])
