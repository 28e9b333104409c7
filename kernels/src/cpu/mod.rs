//! CPU reference kernels (f32 compute, rayon over fixed-size blocks).

pub mod attention;
pub mod dequant;
pub mod linear;
pub mod norm;
pub mod rope;

pub use attention::{causal_attention_head, AttentionStats};
pub use dequant::{dequantize, BlockType};
pub use linear::linear;
pub use norm::{argmax, rms_norm, silu_mul};
pub use rope::{apply_rope, unapply_rope, RopeParams, RopeStyle};
