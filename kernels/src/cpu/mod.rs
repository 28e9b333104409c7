//! CPU reference kernels (f32 compute, rayon over fixed-size blocks).

pub mod ahead;
pub mod attention;
pub mod decode;
pub mod dequant;
pub mod dots64;
pub mod exp;
pub mod linear;
pub mod norm;
pub mod qlinear;
pub mod rope;
pub mod screen;
pub(crate) mod simd;
pub mod vector;

pub use attention::{
    attention_heads, causal_attention_head, decode_reads, key_cache_len, softmax_row, store_kv,
    windowed_attention_head, AttentionStats,
};
pub use decode::{
    attend_biased, attend_biased_multi, attend_biased_probs, attention_rows, dot, dot_rows,
    softmax_in_place, with_avx2,
};
pub use dequant::{dequantize, BlockType};
pub use dots64::{dots_at, dots_norms_at, ColumnBlocks};
pub use exp::{exp_shifted, fast_exp_active};
pub use linear::linear;
pub use norm::{argmax, embedding, gelu_tanh_mul, rms_norm, scale, silu_mul};
pub use qlinear::{embedding_quant, linear_many, linear_quant, QuantMatrix, WeightRef};
pub use rope::{
    apply_rope, rope_table, rotate_with_table, unapply_rope, Llama3Rope, RopeCache, RopeParams,
    RopeStyle,
};
pub use screen::{dot_error_factor, Blocks8};
pub use vector::{cosine, fake_quant, l2_norm, l2_norm_f32, softmax_f64, softmax_f64_norm};
