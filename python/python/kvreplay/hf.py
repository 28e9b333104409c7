"""Capture a kvreplay trace from a Hugging Face transformers model.

    import kvreplay.hf
    kvreplay.hf.capture(model, input_ids, out="t.kvtrace", decode=16, tokenizer=tok)

A capturing attention function is registered with transformers'
`AttentionInterface` and selected through `model.config._attn_implementation`
(no model class is patched); it records each layer's post-RoPE q, k, v and
the per-head attention output while computing attention itself (eager, in
float32), and the prompt's column sums at prefill. The trace is written
through the Rust writer (`kvreplay.TraceWriter`), so `kvreplay verify`
checks it like a CLI capture. Keys and queries are stored as the model
computes them: transformers' llama-family models rotate the two halves of
each head ("rotate_half"), so the manifest says `rope.style = "neox"`.

Needs torch and transformers (not dependencies of kvreplay). Batch size 1,
decoder-only models using the standard attention interface, any device.
"""

from __future__ import annotations

import datetime
import hashlib
import os
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import numpy as np

from . import TraceWriter, __version__

_NAME = "kvreplay_capture"


class _Recorder:
    def __init__(self):
        self.active = False
        self.q: Dict[int, list] = {}
        self.k: Dict[int, list] = {}
        self.v: Dict[int, list] = {}
        self.o: Dict[int, list] = {}
        self.colsum: Dict[int, np.ndarray] = {}


_REC = _Recorder()


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Eager attention (float32 softmax) that records what it sees."""
    import torch

    b, h, q_len, d = query.shape
    kvh, kv_len = key.shape[1], key.shape[2]
    if scaling is None:
        scaling = d**-0.5
    g = h // kvh
    k = key.repeat_interleave(g, dim=1).float()
    v = value.repeat_interleave(g, dim=1).float()
    scores = torch.matmul(query.float(), k.transpose(-1, -2)) * scaling
    # causal over the absolute positions (batch 1, no padding)
    qpos = torch.arange(kv_len - q_len, kv_len, device=query.device)[:, None]
    kpos = torch.arange(kv_len, device=query.device)[None, :]
    scores = scores.masked_fill(kpos > qpos, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v)  # (b, h, q_len, d)
    if _REC.active:
        l = module.layer_idx
        _REC.q.setdefault(l, []).append(query[0].float().cpu().numpy())
        _REC.k.setdefault(l, []).append(key[0, :, -q_len:].float().cpu().numpy())
        _REC.v.setdefault(l, []).append(value[0, :, -q_len:].float().cpu().numpy())
        _REC.o.setdefault(l, []).append(out[0].cpu().numpy())
        if l not in _REC.colsum:  # the prefill: prompt queries over prompt keys
            _REC.colsum[l] = probs[0].double().sum(dim=1).float().cpu().numpy()
    return out.transpose(1, 2).contiguous().to(query.dtype), None


def _register():
    from transformers import AttentionInterface

    AttentionInterface.register(_NAME, _attention)
    try:  # the causal mask of sdpa for our function, where transformers asks for one
        from transformers import AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask

        AttentionMaskInterface.register(_NAME, sdpa_mask)
    except Exception:  # older transformers: the mask is ignored anyway
        pass


def _sha256(path: str) -> Tuple[str, int]:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest(), os.path.getsize(path)


def capture(
    model,
    input_ids: Optional[Sequence[int]] = None,
    *,
    out: Union[str, os.PathLike],
    text: Optional[str] = None,
    tokenizer=None,
    decode: int = 16,
    continuation: Optional[Sequence[int]] = None,
    dtype: str = "f16",
    spans: Optional[Dict[str, Tuple[int, int]]] = None,
    source_file: Optional[str] = None,
    prompt_source: str = "python:hf",
    force: bool = False,
) -> str:
    """Run `model` on the prompt (`input_ids`, or `text` with `tokenizer`),
    then `decode` greedy tokens (or teacher-force `continuation`), each fed
    back through the model; write the trace to `out` and return its path.
    `source_file` (e.g. the GGUF or a weights file) is hashed into the
    manifest's model source; otherwise the model's name is recorded with an
    all-zero sha256."""
    import torch

    if input_ids is None:
        if text is None or tokenizer is None:
            raise ValueError("give input_ids, or text and tokenizer")
        input_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = [int(x) for x in (input_ids.tolist() if hasattr(input_ids, "tolist") else input_ids)]
    ids = [x for row in ids for x in row] if ids and isinstance(ids[0], list) else ids
    p = len(ids)
    n_dec = len(continuation) if continuation is not None else int(decode)
    cfg = model.config
    _register()
    old = getattr(cfg, "_attn_implementation", None)
    dev = next(model.parameters()).device
    for l, layer in enumerate(_layers(model)):
        if getattr(layer.self_attn, "layer_idx", None) is None:
            layer.self_attn.layer_idx = l
    _REC.__init__()
    _REC.active = True
    tokens = list(ids)
    try:
        cfg._attn_implementation = _NAME
        with torch.no_grad():
            r = model(torch.tensor([ids], device=dev), use_cache=True)
            past = r.past_key_values
            for s in range(n_dec):
                nxt = int(continuation[s]) if continuation is not None else int(r.logits[0, -1].argmax())
                tokens.append(nxt)
                r = model(torch.tensor([[nxt]], device=dev), past_key_values=past, use_cache=True)
                past = r.past_key_values
    finally:
        _REC.active = False
        cfg._attn_implementation = old
    n_layers = cfg.num_hidden_layers
    n_heads = cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    rope = getattr(cfg, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    partial = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)) or 1.0
    scaling = {"type": "none"}
    rtype = rope.get("rope_type", "default")
    if rtype == "linear":
        scaling = {"type": "linear", "factor": float(rope["factor"])}
    elif rtype not in ("default", None):
        raise NotImplementedError(f"rope_type {rtype!r}: the trace format records none or linear scaling")
    if source_file:
        sha, size = _sha256(source_file)
        fname = os.path.basename(source_file)
    else:
        sha, size, fname = "0" * 64, 0, str(getattr(cfg, "_name_or_path", "") or type(model).__name__)
    text_of = (lambda i: tokenizer.decode([i])) if tokenizer is not None else (lambda i: f"<{i}>")
    manifest: Dict[str, Any] = {
        "format": "kvreplay-trace",
        "format_version": 1,
        "model": {
            "architecture": cfg.model_type,
            "name": getattr(cfg, "_name_or_path", None) or None,
            "n_layers": n_layers,
            "n_heads": n_heads,
            "n_kv_heads": n_kv,
            "head_dim": head_dim,
            "d_model": cfg.hidden_size,
            "ffn_dim": getattr(cfg, "intermediate_size", 0) or 0,
            "vocab_size": cfg.vocab_size,
            "context_length": getattr(cfg, "max_position_embeddings", 0) or 0,
            "norm_eps": float(getattr(cfg, "rms_norm_eps", getattr(cfg, "layer_norm_eps", 1e-5))),
            "attn_scale": float(head_dim**-0.5),
            "rope": {"theta": float(theta), "style": "neox", "rotated_dims": int(head_dim * partial), "scaling": scaling},
            "source": {"file_name": fname, "sha256": sha, "size": size},
        },
        "tokens": {"ids": tokens, "prompt_len": p, "text": [text_of(i) for i in tokens]},
        "generation": {"method": "greedy", "n_decode": n_dec},
        "spans": [{"name": k, "start": int(a), "end": int(b)} for k, (a, b) in (spans or {}).items()],
        "capture": {
            "device": str(dev),
            "dtype": dtype,
            "compute_dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
            "prefill_chunk": p,
            "threads": int(torch.get_num_threads()),
            "attn_probs": False,
            "chat_template": False,
            "prompt_source": prompt_source,
            "kvreplay_version": __version__,
            "created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        },
    }
    w = TraceWriter(out, manifest, force=force)
    for l in range(n_layers):
        cat = lambda xs: np.concatenate(xs, axis=1)  # noqa: E731 (heads, rows, d) along rows
        w.write(l, q=cat(_REC.q[l]), k=cat(_REC.k[l]), v=cat(_REC.v[l]), o=cat(_REC.o[l]), colsum=_REC.colsum[l])
    _REC.__init__()
    return w.finish()


def _layers(model):
    for path in ("model.layers", "model.model.layers", "transformer.h"):
        obj = model
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
            return list(obj)
        except AttributeError:
            continue
    raise TypeError("cannot find the decoder layers of this model")
