"""Broken scorers: each must fail with a clear error."""
import numpy as np

import kvreplay


class WrongShape(kvreplay.Scorer):
    def score(self, ctx):
        return np.zeros((ctx.n_heads + 1, ctx.prompt_len), np.float32)


class NaNs(kvreplay.Scorer):
    def score(self, ctx):
        s = np.zeros((ctx.n_kv_heads, ctx.prompt_len), np.float32)
        s[0, 3] = np.nan
        return s


class Raises(kvreplay.Scorer):
    def score(self, ctx):
        return helper(ctx)


def helper(ctx):
    raise ValueError(f"boom in layer {ctx.layer}")


class Stash(kvreplay.Scorer):
    """Keeps the context past score(): using it later must be refused."""

    ctx = None

    def score(self, ctx):
        Stash.ctx = ctx
        return np.zeros((ctx.n_kv_heads, ctx.prompt_len), np.float32)
