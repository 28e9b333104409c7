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


class Recent(kvreplay.Policy):
    """Keeps the last `budget` positions of every KV head: streaming_llm with no sinks."""

    def keep(self, ctx):
        p, b = ctx.prompt_len, min(ctx.budget, ctx.prompt_len)
        return [np.arange(p - b, p)] * ctx.n_kv_heads


class OutOfRange(kvreplay.Policy):
    def keep(self, ctx):
        return [[0, ctx.prompt_len]] * ctx.n_kv_heads


class OverBudget(kvreplay.Policy):
    def keep(self, ctx):
        return [np.arange(ctx.budget + 1)] * ctx.n_kv_heads


class TooFewHeads(kvreplay.Policy):
    def keep(self, ctx):
        return [[0]]
