#!/usr/bin/env python3
"""Parity of kvreplay's `preset=kvpress` policies with NVIDIA kvpress itself.

For each press and compression ratio: run kvpress on SmolLM2 (transformers,
GGUF weights, float32, CPU) over one ~1000-token prompt and record which prompt
positions each layer and KV head keeps; capture a kvreplay trace of the same
token ids (`kvreplay capture --prompt-file`), replay kvreplay's equivalent
policy at kvpress's per-head budget int(P·(1 − ratio)), read its
retention.csv, and report the mean Jaccard index of the two kept sets over
every (layer, KV head). Writes a markdown report (docs/kvpress-parity.md).

Kept positions on the kvpress side:
- presses that gather (every ScorerPress, PyramidKVPress): each kept key row
  is found exactly among the layer's uncompressed keys;
- AdaKVPress masks instead of gathering: the kept set is every position not
  in `module.masked_key_indices`.

Run through scripts/kvpress-parity.sh (makes .venv-kvpress/ with pinned
versions). Needs target/release/kvreplay and models/SmolLM2-135M-Instruct.Q4_1.gguf.
"""
import argparse
import csv
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import time

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

import kvpress
from kvpress import (
    AdaKVPress,
    BlockPress,
    ChunkKVPress,
    CURPress,
    ExpectedAttentionPress,
    KeyDiffPress,
    LagKVPress,
    KnormPress,
    ObservedAttentionPress,
    PyramidKVPress,
    RandomPress,
    SnapKVPress,
    StreamingLLMPress,
    TOVAPress,
)

# (name, kvpress press factory, kvreplay spec, kvreplay's default form or
# None, attention implementation)
PRESSES = [
    ("Knorm", lambda r: KnormPress(compression_ratio=r), "knorm:preset=kvpress", "knorm", "sdpa"),
    ("SnapKV", lambda r: SnapKVPress(compression_ratio=r), "snapkv:preset=kvpress", "snapkv", "sdpa"),
    ("StreamingLLM", lambda r: StreamingLLMPress(compression_ratio=r), "streaming_llm:preset=kvpress", "streaming_llm", "sdpa"),
    ("TOVA", lambda r: TOVAPress(compression_ratio=r), "tova:preset=kvpress", "tova:decode_evict=false", "sdpa"),
    ("Random", lambda r: RandomPress(compression_ratio=r, seed=0), "random:seed=0", None, "sdpa"),
    ("PyramidKV", lambda r: PyramidKVPress(compression_ratio=r), "pyramidkv:preset=kvpress", "pyramidkv", "sdpa"),
    ("AdaKV(SnapKV)", lambda r: AdaKVPress(SnapKVPress(compression_ratio=r)), "adakv:preset=kvpress", "adakv", "sdpa"),
    # kvpress has no H2O press; its closest, ObservedAttention, divides each
    # column sum by the number of queries that see the key and keeps no recent
    # window: h2o's kvpress preset. Default form shown: h2o without a window.
    ("ObservedAttention", lambda r: ObservedAttentionPress(compression_ratio=r), "h2o:preset=kvpress", "h2o:recent=0,decode_evict=false", "eager"),
    ("KeyDiff", lambda r: KeyDiffPress(compression_ratio=r), "keydiff:preset=kvpress", "keydiff", "sdpa"),
    # presses whose kvreplay policy follows kvpress by default (no preset)
    ("ObservedAttention", lambda r: ObservedAttentionPress(compression_ratio=r), "observed_attention", None, "eager"),
    ("LagKV", lambda r: LagKVPress(compression_ratio=r), "lagkv", None, "sdpa"),
    ("CUR", lambda r: CURPress(compression_ratio=r), "cur", None, "sdpa"),
    ("ExpectedAttention", lambda r: ExpectedAttentionPress(compression_ratio=r), "expected_attention", None, "sdpa"),
    ("ChunkKV(SnapKV)", lambda r: ChunkKVPress(press=SnapKVPress(compression_ratio=r)), "chunkkv:preset=kvpress", None, "sdpa"),
    ("Block(KeyDiff)", lambda r: BlockPress(press=KeyDiffPress(compression_ratio=r), block_size=128), "block", None, "sdpa"),
]

WORDS = {
    "city": ["Arlen", "Bexmoor", "Calloway", "Dunmere", "Eastwick", "Farrow", "Glenholt", "Harrowgate"],
    "river": ["Sable", "Tamsin", "Ould", "Verrin", "Lisk"],
    "item": ["copper kettles", "salted fish", "woollen cloth", "river clay", "honey cakes", "lamp oil"],
    "job": ["ferryman", "weaver", "clockmaker", "baker", "archivist", "surveyor"],
    "name": ["Mira", "Tobin", "Elsa", "Rowan", "Ida", "Caspar", "Lena", "Osric"],
}


def prompt_text(tok, target):
    """A deterministic prose prompt of about `target` tokens whose length is a
    multiple of 4 (so P·(1 − ratio) is whole for ratios 0.5 and 0.75)."""
    rng = random.Random(1234)
    pick = lambda k: rng.choice(WORDS[k])
    parts = []
    passkey = 48213
    n = 0
    while n < target - 40:
        s = rng.randrange(4)
        if s == 0:
            t = f"The town of {pick('city')} lies {rng.randrange(3, 90)} kilometres north of the river {pick('river')}. "
        elif s == 1:
            t = f"Every morning {pick('name')}, the {pick('job')}, walks to the market and buys {pick('item')}. "
        elif s == 2:
            t = f"In the year {rng.randrange(1700, 1900)} the council of {pick('city')} voted to build a bridge of {rng.randrange(2, 12)} arches. "
        else:
            t = f"{pick('name')} wrote that the {pick('item')} of {pick('city')} were the best in the valley. "
        if len(parts) == 12:
            t += f"Remember this: the pass key is {passkey}. "
        parts.append(t)
        n = len(tok("".join(parts), add_special_tokens=False)["input_ids"])
    parts.append("Question: what is the pass key? Answer: the pass key is")
    text = "".join(parts)
    while len(tok(text, add_special_tokens=False)["input_ids"]) % 4:
        text += " ."
    return text


def kept_by_gather(keys_in, keys_out):
    """Positions of each kept key row among the uncompressed rows, per head."""
    out = []
    for h in range(keys_in.shape[1]):
        eq = (keys_out[0, h][:, None, :] == keys_in[0, h][None, :, :]).all(-1)
        hits = eq.sum(1)
        assert bool((hits >= 1).all()), "a kept key matches no uncompressed key"
        pos = eq.float().argmax(1).tolist()
        assert len(set(pos)) == len(pos), "two kept keys matched one position"
        out.append(sorted(pos))
    return out


def run_press(model, press, ids):
    """Prefill `ids` under `press`; return kept[layer][kv_head] (sorted
    positions) and the press's scores[layer] (kv_heads, P)."""
    kept = {}
    scores = {}
    orig = press.compress
    masked = isinstance(press, AdaKVPress)
    # wrappers score through their inner press (ChunkKV, Block)
    scorer = press.press if masked or isinstance(press, (ChunkKVPress, BlockPress)) else press
    orig_score = scorer.score

    def score(module, *args, **kw):
        s = orig_score(module, *args, **kw)
        scores[module.layer_idx] = s[0].detach().double().clone()
        return s

    def compress(module, hidden_states, keys, values, attentions, kwargs):
        k_in = keys.clone()
        k_out, v_out = orig(module, hidden_states, keys, values, attentions, kwargs)
        layer = module.layer_idx
        if masked:
            _, heads, seqs = module.masked_key_indices
            n_kv, p = k_in.shape[1], k_in.shape[2]
            drop = [set() for _ in range(n_kv)]
            for h, s in zip(heads.tolist(), seqs.tolist()):
                drop[h].add(s)
            kept[layer] = [sorted(set(range(p)) - drop[h]) for h in range(n_kv)]
        else:
            kept[layer] = kept_by_gather(k_in, k_out)
        return k_out, v_out

    press.compress = compress
    scorer.score = score
    try:
        with torch.no_grad(), press(model):
            model(torch.tensor([ids]), past_key_values=DynamicCache(), use_cache=True)
    finally:
        del press.compress
        del scorer.score
    return [kept[l] for l in sorted(kept)], [scores.get(l) for l in sorted(kept)]


def boundary_gap(kp, kr, scores):
    """Over the (layer, head) pairs whose kept sets differ: the largest
    relative distance between the score of a position kept by only one side
    and kvpress's boundary (the lowest score it kept in that head), by
    kvpress's own scores. Tiny values mean near-ties at the boundary."""
    worst = None
    for l, heads in enumerate(kp):
        if scores[l] is None:
            continue
        for h, pos in enumerate(heads):
            other = kr.get((l, h), [])
            diff = set(pos) ^ set(other)
            if not diff:
                continue
            s = scores[l][h]
            thr = float(s[pos].min())
            g = max(abs(float(s[x]) - thr) for x in diff) / max(abs(thr), 1e-30)
            worst = g if worst is None else max(worst, g)
    return worst


def replay_kept(kvreplay, trace, spec, budget, out, p):
    subprocess.run(
        [kvreplay, "replay", "--trace", trace, "--policy", spec, "--budget", str(budget), "--out", out, "--force"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    kept = {}
    with open(os.path.join(out, "retention.csv")) as f:
        for row in csv.DictReader(f):
            pos = int(row["position"])
            if pos < p:
                kept.setdefault((int(row["layer"]), int(row["head"])), []).append(pos)
    return kept


def per_head_jaccard(kp, kr):
    """Jaccard of kvpress's and kvreplay's kept sets for every (layer, KV head)."""
    return [jaccard(pos, kr.get((l, h), [])) for l, heads in enumerate(kp) for h, pos in enumerate(heads)]


def jaccard(a, b):
    a, b = set(a), set(b)
    return len(a & b) / len(a | b) if a | b else 1.0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--kvreplay", default="target/release/kvreplay")
    ap.add_argument("--work", default="results/kvpress-parity")
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--ratios", default="0.5,0.75")
    ap.add_argument("--only", default="", help="comma-separated press names (default: all)")
    ap.add_argument("--doc", default="docs/kvpress-parity.md")
    a = ap.parse_args()
    ratios = [float(x) for x in a.ratios.split(",")]
    torch.manual_seed(0)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    gdir, gfile = os.path.split(os.path.abspath(a.model))
    tok = AutoTokenizer.from_pretrained(gdir, gguf_file=gfile)
    text = prompt_text(tok, a.tokens)
    hf_ids = tok(text, add_special_tokens=False)["input_ids"]
    os.makedirs(a.work, exist_ok=True)
    pf = os.path.join(a.work, "prompt.txt")
    with open(pf, "w") as f:
        f.write(text)
    trace = os.path.join(a.work, "prompt.kvtrace")
    subprocess.run(
        [a.kvreplay, "capture", "--model", a.model, "--prompt-file", pf, "--decode", "1",
         "--dtype", "f32", "--out", trace, "--force"],
        check=True,
    )
    with open(os.path.join(trace, "manifest.json")) as f:
        man = json.load(f)
    p = man["tokens"]["prompt_len"]
    ids = man["tokens"]["ids"][:p]
    assert ids == hf_ids, (
        f"kvreplay and transformers tokenize the prompt differently ({len(ids)} vs {len(hf_ids)} ids; "
        f"first difference at {next((i for i, (x, y) in enumerate(zip(ids, hf_ids)) if x != y), min(len(ids), len(hf_ids)))})"
    )
    print(f"prompt: {p} tokens, identical ids in kvreplay and transformers", flush=True)

    models = {}

    def model_for(attn):
        if attn not in models:
            models[attn] = AutoModelForCausalLM.from_pretrained(
                gdir, gguf_file=gfile, dtype=torch.float32, attn_implementation=attn
            ).eval()
        return models[attn]

    only = set(x for x in a.only.split(",") if x)
    rows = []
    for name, make, spec, default, attn in PRESSES:
        if only and name not in only:
            continue
        for r in ratios:
            t0 = time.time()
            kp, scores = run_press(model_for(attn), make(r), ids)
            budget = int(p * (1 - r))
            out = os.path.join(a.work, f"replay-{len(rows)}")
            kr = replay_kept(a.kvreplay, trace, spec, budget, out, p)
            js = per_head_jaccard(kp, kr)
            gap = boundary_gap(kp, kr, scores) if name != "Random" else None
            mean = sum(js) / len(js)
            exact = sum(j == 1.0 for j in js)
            dmean = None
            if default:
                dj = per_head_jaccard(kp, replay_kept(a.kvreplay, trace, default, budget, out + "-default", p))
                dmean = sum(dj) / len(dj)
            rows.append((name, r, spec, budget, mean, min(js), exact, len(js), default, dmean, gap))
            print(f"{name:18} ratio {r:<5} budget {budget:4}  mean Jaccard {mean:.4f}  min {min(js):.4f}  "
                  f"identical {exact}/{len(js)}"
                  + (f"  boundary gap {gap:.1e}" if gap is not None else "")
                  + (f"  (default `{default}`: {dmean:.4f})" if default else "")
                  + f"  ({time.time() - t0:.0f} s)", flush=True)

    versions = (
        f"kvpress {kvpress.__version__ if hasattr(kvpress, '__version__') else pkg_version('kvpress')}, "
        f"transformers {transformers.__version__}, torch {torch.__version__}, "
        f"Python {platform.python_version()}"
    )
    print(versions)
    write_doc(a, rows, p, versions)


def pkg_version(name):
    from importlib.metadata import version

    return version(name)


def write_doc(a, rows, p, versions):
    head = open(a.doc).read().split("<!-- table -->")[0] if os.path.exists(a.doc) else "# kvpress parity\n\n"
    lines = [head.rstrip() + "\n", "<!-- table -->", ""]
    lines.append(f"Measured: {time.strftime('%Y-%m-%d', time.gmtime())}, P = {p} prompt tokens, {versions}, CPU, float32.")
    lines.append("")
    lines.append("| press | ratio | kvreplay spec | budget | mean Jaccard | min | identical (layer, KV head) | boundary gap of differing heads | kvreplay default form: mean Jaccard |")
    lines.append("|---|---|---|---|---|---|---|---|---|")
    new = {}
    for name, r, spec, budget, mean, mn, exact, n, default, dmean, gap in rows:
        d = f"`{default}`: {dmean:.4f}" if default else "n/a"
        g = f"{gap:.1e}" if gap is not None else "n/a"
        new[(name, str(r), f"`{spec}`")] = f"| {name} | {r} | `{spec}` | {budget} | {mean:.4f} | {mn:.4f} | {exact}/{n} | {g} | {d} |"
    if a.only and os.path.exists(a.doc):
        # a partial run (--only) replaces its own rows and keeps the others
        old = [l for l in open(a.doc).read().split("<!-- table -->")[-1].splitlines()
               if l.startswith("| ") and not l.startswith("| press ")]
        for l in old:
            key = tuple(c.strip() for c in l.strip("|").split("|")[:3])
            new.setdefault(key, l)
        order = [(n, str(r), f"`{s}`") for n, _, s, _, _ in PRESSES for r in a.ratios.split(",")]
        keys = sorted(new, key=lambda k: order.index(k) if k in order else len(order))
    else:
        keys = list(new)
    lines.extend(new[k] for k in keys)
    lines.append("")
    lines.append("Boundary gap: over the (layer, KV head) pairs whose kept sets differ, the largest relative distance "
                 "between the kvpress score of a position kept by one side only and the lowest score kvpress kept in "
                 "that head (kvpress's own scores; n/a when every pair is identical, or for Random).")
    lines.append("")
    with open(a.doc, "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {a.doc}")


if __name__ == "__main__":
    sys.exit(main())
