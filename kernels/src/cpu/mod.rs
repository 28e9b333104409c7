//! CPU reference kernels (f32 compute, rayon over fixed-size blocks).

pub mod attention;
pub mod decode;
pub mod dequant;
pub mod linear;
pub mod norm;
pub mod rope;

pub use attention::{causal_attention_head, AttentionStats};
pub use decode::{
    attend_biased, attend_biased_multi, attention_rows, dot, dot_rows, softmax_in_place, top_k,
};
pub use dequant::{dequantize, BlockType};
pub use linear::linear;
pub use norm::{argmax, embedding, rms_norm, silu_mul};
pub use rope::{
    apply_rope, rope_table, rotate_with_table, unapply_rope, RopeCache, RopeParams, RopeStyle,
};
