//! The forward pass crosses the host-device bus O(1) times per layer and
//! step, whatever the number of heads, operations or positions.
//!
//! The resident API counts its transfers on every backend (the CPU's are
//! borrows or copies, counted as a GPU would make them), so this runs without
//! a GPU: per forward call the token ids and the RoPE table go to the device
//! once, every layer's q, k, v and o come back together in one copy after the
//! last layer, then the logits (with probabilities asked for: two copies per
//! layer, its q/k/v/o and its probabilities, so no layer's are held). Before the resident API
//! the CUDA backend made about 2,000 copies per decoded token at n = 2,048
//! (every operation copied its inputs in and its outputs out, and the K/V
//! prefix went up again for every query head).

use kvreplay_capture::llama::{
    Activation, ForwardOptions, KvCache, LayerAttention, LayerWeights, Llama, LlamaConfig,
};
use kvreplay_capture::testing::weights;
use kvreplay_kernels::cpu::{RopeParams, RopeStyle};
use kvreplay_kernels::transfers::{self, Transfers};
use kvreplay_kernels::{Backend, Weight};

/// A random llama with the given head layout (weights scaled to keep
/// activations finite; their values do not matter here).
fn model(n_layers: usize, n_heads: usize, n_kv_heads: usize) -> Llama {
    let (d, hd, f, v) = (24, 6, 40, 50);
    let rope = RopeParams {
        theta: 10000.0,
        style: RopeStyle::Neox,
        rotated_dims: hd,
        linear_factor: 1.0,
        llama3: None,
    };
    let cfg = LlamaConfig {
        n_layers,
        d_model: d,
        n_heads,
        n_kv_heads,
        head_dim: hd,
        ffn_dim: f,
        vocab_size: v,
        context_length: 64,
        norm_eps: 1e-5,
        rope,
        attn_scale: 1.0 / (hd as f32).sqrt(),
        layer_attention: vec![LayerAttention { window: None, rope }; n_layers],
        qk_norm: false,
        post_norms: false,
        activation: Activation::Silu,
        embed_scale: None,
        permuted_qk: true,
    };
    let w = |n: usize, seed: u64| Weight::new(weights(n, seed, 0.2));
    let layers = (0..n_layers as u64)
        .map(|l| LayerWeights {
            attn_norm: Weight::new(vec![1.0; d]),
            q_norm: None,
            k_norm: None,
            post_attn_norm: None,
            post_ffn_norm: None,
            wq: w(n_heads * hd * d, 10 * l + 1),
            wk: w(n_kv_heads * hd * d, 10 * l + 2),
            wv: w(n_kv_heads * hd * d, 10 * l + 3),
            wo: w(d * n_heads * hd, 10 * l + 4),
            bq: None,
            bk: None,
            bv: None,
            bo: None,
            ffn_norm: Weight::new(vec![1.0; d]),
            w_gate: w(f * d, 10 * l + 5),
            w_up: w(f * d, 10 * l + 6),
            w_down: w(d * f, 10 * l + 7),
        })
        .collect();
    Llama {
        cfg,
        embed: w(v * d, 99),
        layers,
        out_norm: Weight::new(vec![1.0; d]),
        lm_head: None,
        backend: Backend::Cpu,
    }
}

/// Transfers of one prefill of `prompt` tokens in chunks of `chunk`, then
/// `decode` single-token steps; returns (per prefill chunk, per decode step).
fn count(m: &Llama, prompt: usize, chunk: usize, decode: usize, probs: bool) -> Vec<Transfers> {
    let mut cache = KvCache::new(&m.cfg, prompt + decode);
    let mut colsum = m.colsum_buffers(prompt).unwrap();
    let mut out = Vec::new();
    let mut taps = 0;
    let mut pos = 0;
    while pos < prompt + decode {
        let end = if pos < prompt {
            (pos + chunk).min(prompt)
        } else {
            pos + 1
        };
        let ids: Vec<u32> = (pos..end).map(|i| (i * 7 % 50) as u32).collect();
        let fo = ForwardOptions {
            colsum: (pos < prompt).then_some(colsum.as_mut_slice()),
            probs,
            attention: None,
        };
        let before = transfers::now();
        m.forward(&ids, pos, &mut cache, fo, &mut |t| {
            assert_eq!(t.probs.is_some(), probs);
            taps += 1;
        })
        .unwrap();
        out.push(transfers::now() - before);
        pos = end;
    }
    assert_eq!(
        taps,
        out.len() * m.cfg.n_layers,
        "one tap per layer and call"
    );
    out
}

#[test]
fn a_forward_call_moves_the_ids_and_rope_table_up_and_the_taps_down_in_one_copy() {
    for (layers, heads, kv) in [(2, 4, 2), (3, 8, 1), (3, 6, 6)] {
        let m = model(layers, heads, kv);
        for probs in [false, true] {
            // with probabilities each layer's taps and probabilities come
            // down when it is done (two copies per layer), then the logits
            let want = Transfers {
                to_device: 2,
                to_host: if probs { 2 * layers as u64 + 1 } else { 2 },
            };
            // prefill chunks of 5, 5 and 2 positions, then 4 decode steps
            for (i, t) in count(&m, 12, 5, 4, probs).iter().enumerate() {
                assert_eq!(
                    *t, want,
                    "{layers} layers, {heads} heads / {kv} KV heads, probs {probs}, call {i}"
                );
            }
        }
    }
}

#[test]
fn transfers_do_not_grow_with_heads_or_context() {
    // Same layer count, 1 vs 12 query heads, 8 vs 40 positions: the same count.
    let small = count(&model(2, 1, 1), 8, 8, 1, false);
    let large = count(&model(2, 12, 4), 40, 40, 1, false);
    assert_eq!(small, large);
}
