"""SnapKV as a kvreplay Python scorer: a line-by-line port of
replay/src/policies/snapkv.rs (docs/python.md walks through it)."""
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

import kvreplay


class SnapKV(kvreplay.Scorer):
    def __init__(self, w=32, k=7, pool="max"):
        super().__init__(w=w, k=k, pool=pool)
        self.window = w  # the last w prompt positions are kept (inside B)

    def score(self, ctx):
        p = ctx.prompt_len
        w = min(self.w, p)
        a = ctx.window_attention(w)[:, :, : p - w]  # (n_heads, w, P-w) softmax rows
        s = a.sum(axis=1)  # window votes per query head
        s = s.reshape(ctx.n_kv_heads, ctx.group, p - w).mean(axis=1)  # group mean
        if self.pool == "none":
            return s
        h = self.k // 2
        fill = -np.inf if self.pool == "max" else 0.0  # max ignores padding, avg counts it
        win = sliding_window_view(np.pad(s, ((0, 0), (h, h)), constant_values=fill), self.k, axis=-1)
        return win.max(-1) if self.pool == "max" else win.sum(-1) / np.float32(self.k)
