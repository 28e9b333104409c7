//! Dequantisation of the GGUF/ggml tensor block types real model files use.
//!
//! Block layouts follow ggml (`ggml-common.h` / `ggml-quants.c`):
//! - F32, F16, BF16: one element per 4/2/2 bytes.
//! - Q8_0 (34 B / 32): f16 d; i8 q[32];            x = d*q
//! - Q4_0 (18 B / 32): f16 d; u8 qs[16];           x[i] = d*((qs[i]&15)-8), x[i+16] = d*((qs[i]>>4)-8)
//! - Q4_1 (20 B / 32): f16 d, m; u8 qs[16];        x[i] = d*(qs[i]&15)+m,   x[i+16] = d*(qs[i]>>4)+m
//! - Q5_0 (22 B / 32): f16 d; u32 qh (LE); u8 qs[16];
//!   x[i] = d*(((qs[i]&15) | bit i of qh << 4) - 16), x[i+16] = d*(((qs[i]>>4) | bit i+16 of qh << 4) - 16)
//! - Q4_K (144 B / 256): f16 d, dmin; u8 scales[12] (8 x 6-bit scale/min pairs); u8 qs[128]
//! - Q5_K (176 B / 256): as Q4_K plus u8 qh[32] (the fifth bit), before qs
//! - Q6_K (210 B / 256): u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d

use half::{bf16, f16};
use rayon::prelude::*;

use crate::KernelError;

/// A ggml tensor type this crate can dequantise.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q8_0,
    Q4_K,
    Q5_K,
    Q6_K,
}

impl BlockType {
    /// From the ggml type id stored in GGUF tensor infos.
    pub fn from_ggml(id: u32) -> Option<Self> {
        Some(match id {
            0 => BlockType::F32,
            1 => BlockType::F16,
            2 => BlockType::Q4_0,
            3 => BlockType::Q4_1,
            6 => BlockType::Q5_0,
            8 => BlockType::Q8_0,
            12 => BlockType::Q4_K,
            13 => BlockType::Q5_K,
            14 => BlockType::Q6_K,
            30 => BlockType::BF16,
            _ => return None,
        })
    }

    /// Name of a ggml type id, for error messages (also for unsupported ones).
    pub fn ggml_name(id: u32) -> &'static str {
        match id {
            0 => "F32",
            1 => "F16",
            2 => "Q4_0",
            3 => "Q4_1",
            6 => "Q5_0",
            7 => "Q5_1",
            8 => "Q8_0",
            9 => "Q8_1",
            10 => "Q2_K",
            11 => "Q3_K",
            12 => "Q4_K",
            13 => "Q5_K",
            14 => "Q6_K",
            15 => "Q8_K",
            16..=23 => "IQ (i-quant)",
            24 => "I8",
            25 => "I16",
            26 => "I32",
            27 => "I64",
            28 => "F64",
            29 => "IQ1_M",
            30 => "BF16",
            _ => "unknown",
        }
    }

    /// Elements per block.
    pub fn block_elems(self) -> usize {
        match self {
            BlockType::F32 | BlockType::F16 | BlockType::BF16 => 1,
            BlockType::Q4_0 | BlockType::Q4_1 | BlockType::Q5_0 | BlockType::Q8_0 => 32,
            BlockType::Q4_K | BlockType::Q5_K | BlockType::Q6_K => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            BlockType::F32 => 4,
            BlockType::F16 | BlockType::BF16 => 2,
            BlockType::Q4_0 => 18,
            BlockType::Q4_1 => 20,
            BlockType::Q5_0 => 22,
            BlockType::Q8_0 => 34,
            BlockType::Q4_K => 144,
            BlockType::Q5_K => 176,
            BlockType::Q6_K => 210,
        }
    }

    /// Bytes needed for `n` elements (n must be a multiple of the block size).
    pub fn bytes_for(self, n: usize) -> Option<usize> {
        n.is_multiple_of(self.block_elems())
            .then(|| n / self.block_elems() * self.block_bytes())
    }
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Dequantise `src` (whole blocks of `ty`) into `out` (f32, one per element).
/// Parallel over fixed chunks of blocks; each element is computed independently,
/// so results do not depend on the thread count.
pub fn dequantize(ty: BlockType, src: &[u8], out: &mut [f32]) -> Result<(), KernelError> {
    let (be, bb) = (ty.block_elems(), ty.block_bytes());
    if !out.len().is_multiple_of(be) || src.len() != out.len() / be * bb {
        return Err(KernelError::Shape {
            op: "dequantize",
            msg: format!(
                "{ty:?}: {} bytes for {} elements (expected {} bytes, elements a multiple of {be})",
                src.len(),
                out.len(),
                out.len() / be * bb
            ),
        });
    }
    const BLOCKS_PER_TASK: usize = 1024;
    out.par_chunks_mut(be * BLOCKS_PER_TASK)
        .zip(src.par_chunks(bb * BLOCKS_PER_TASK))
        .for_each(|(o, s)| {
            for (ob, sb) in o.chunks_exact_mut(be).zip(s.chunks_exact(bb)) {
                dequant_block(ty, sb, ob);
            }
        });
    Ok(())
}

/// One block of `ty`: `b` is block_bytes long, `y` block_elems long.
fn dequant_block(ty: BlockType, b: &[u8], y: &mut [f32]) {
    match ty {
        BlockType::F32 => y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        BlockType::F16 => y[0] = f16_at(b, 0),
        BlockType::BF16 => y[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        BlockType::Q8_0 => {
            let d = f16_at(b, 0);
            for i in 0..32 {
                y[i] = d * (b[2 + i] as i8) as f32;
            }
        }
        BlockType::Q4_0 => {
            let d = f16_at(b, 0);
            for i in 0..16 {
                let q = b[2 + i];
                y[i] = d * ((q & 15) as i32 - 8) as f32;
                y[i + 16] = d * ((q >> 4) as i32 - 8) as f32;
            }
        }
        BlockType::Q4_1 => {
            let (d, m) = (f16_at(b, 0), f16_at(b, 2));
            for i in 0..16 {
                let q = b[4 + i];
                y[i] = d * (q & 15) as f32 + m;
                y[i + 16] = d * (q >> 4) as f32 + m;
            }
        }
        BlockType::Q5_0 => {
            let d = f16_at(b, 0);
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            for i in 0..16 {
                let q = b[6 + i];
                let h0 = ((qh >> i) & 1) << 4;
                let h1 = ((qh >> (i + 16)) & 1) << 4;
                y[i] = d * (((q & 15) as u32 | h0) as i32 - 16) as f32;
                y[i + 16] = d * (((q >> 4) as u32 | h1) as i32 - 16) as f32;
            }
        }
        BlockType::Q4_K => {
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let scales = &b[4..16];
            let qs = &b[16..144];
            for j in 0..4 {
                let (sc1, m1) = scale_min_k4(2 * j, scales);
                let (sc2, m2) = scale_min_k4(2 * j + 1, scales);
                let (d1, mm1) = (d * sc1 as f32, dmin * m1 as f32);
                let (d2, mm2) = (d * sc2 as f32, dmin * m2 as f32);
                let q = &qs[32 * j..32 * j + 32];
                let yy = &mut y[64 * j..64 * j + 64];
                for l in 0..32 {
                    yy[l] = d1 * (q[l] & 15) as f32 - mm1;
                    yy[l + 32] = d2 * (q[l] >> 4) as f32 - mm2;
                }
            }
        }
        BlockType::Q5_K => {
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let scales = &b[4..16];
            let qh = &b[16..48];
            let qs = &b[48..176];
            for j in 0..4 {
                let (sc1, m1) = scale_min_k4(2 * j, scales);
                let (sc2, m2) = scale_min_k4(2 * j + 1, scales);
                let (d1, mm1) = (d * sc1 as f32, dmin * m1 as f32);
                let (d2, mm2) = (d * sc2 as f32, dmin * m2 as f32);
                let (u1, u2) = (1u8 << (2 * j), 2u8 << (2 * j));
                let q = &qs[32 * j..32 * j + 32];
                let yy = &mut y[64 * j..64 * j + 64];
                for l in 0..32 {
                    let hi1 = if qh[l] & u1 != 0 { 16 } else { 0 };
                    let hi2 = if qh[l] & u2 != 0 { 16 } else { 0 };
                    yy[l] = d1 * ((q[l] & 15) + hi1) as f32 - mm1;
                    yy[l + 32] = d2 * ((q[l] >> 4) + hi2) as f32 - mm2;
                }
            }
        }
        BlockType::Q6_K => {
            let ql = &b[0..128];
            let qh = &b[128..192];
            let sc = &b[192..208];
            let d = f16_at(b, 208);
            for n in 0..2 {
                let (ql, qh, sc) = (&ql[64 * n..], &qh[32 * n..], &sc[8 * n..]);
                let yy = &mut y[128 * n..128 * n + 128];
                for l in 0..32 {
                    let is = l / 16;
                    let q1 = ((ql[l] & 15) | ((qh[l] & 3) << 4)) as i32 - 32;
                    let q2 = ((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                    let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                    let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                    yy[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                    yy[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                    yy[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                    yy[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
                }
            }
        }
    }
}

/// The j-th (scale, min) pair of a K-quant super-block, each 6 bits, packed
/// into 12 bytes: pairs 0..4 in the low 6 bits of bytes j and j+4; pairs 4..8
/// in the nibbles of bytes j+4 with their top 2 bits in bytes j-4 and j.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(x: f32) -> [u8; 2] {
        f16::from_f32(x).to_le_bytes()
    }

    fn deq(ty: BlockType, b: &[u8]) -> Vec<f32> {
        let mut y = vec![0.0; b.len() / ty.block_bytes() * ty.block_elems()];
        dequantize(ty, b, &mut y).unwrap();
        y
    }

    #[test]
    fn plain_floats() {
        let mut b = Vec::new();
        b.extend_from_slice(&1.5f32.to_le_bytes());
        b.extend_from_slice(&(-2.25f32).to_le_bytes());
        assert_eq!(deq(BlockType::F32, &b), vec![1.5, -2.25]);
        let b: Vec<u8> = [h(0.5), h(-3.0)].concat();
        assert_eq!(deq(BlockType::F16, &b), vec![0.5, -3.0]);
        // bf16 is the top half of the f32 bit pattern: 1.0f32 = 0x3F800000.
        assert_eq!(
            deq(BlockType::BF16, &[0x80, 0x3F, 0x40, 0xC0]),
            vec![1.0, -3.0]
        );
    }

    #[test]
    fn q8_0_block() {
        // d = 0.5, q = -16..16  ->  x = q / 2
        let mut b = h(0.5).to_vec();
        b.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let want: Vec<f32> = (0..32).map(|i| (i as f32 - 16.0) * 0.5).collect();
        assert_eq!(deq(BlockType::Q8_0, &b), want);
    }

    #[test]
    fn q4_0_block() {
        // d = 2, byte i = (lo = i, hi = 15 - i): x[i] = 2(i-8), x[i+16] = 2(7-i)
        let mut b = h(2.0).to_vec();
        b.extend((0..16u8).map(|i| i | ((15 - i) << 4)));
        let y = deq(BlockType::Q4_0, &b);
        for i in 0..16 {
            assert_eq!(y[i], 2.0 * (i as f32 - 8.0));
            assert_eq!(y[i + 16], 2.0 * (7.0 - i as f32));
        }
    }

    #[test]
    fn q5_0_block_fifth_bit_from_qh() {
        // d = 0.5; qs[i] = 0x21 (low nibble 1, high 2); qh: bit 0 and bit 17 set
        let mut b = h(0.5).to_vec();
        b.extend_from_slice(&((1u32 << 0) | (1u32 << 17)).to_le_bytes());
        b.extend_from_slice(&[0x21; 16]);
        let y = deq(BlockType::Q5_0, &b);
        assert_eq!(y[0], 0.5 * ((1 | 16) - 16) as f32); // 0.5
        assert_eq!(y[1], 0.5 * (1 - 16) as f32); // -7.5
        assert_eq!(y[16], 0.5 * (2 - 16) as f32); // -7
        assert_eq!(y[17], 0.5 * ((2 | 16) - 16) as f32); // 1
    }

    #[test]
    fn q4_1_block_low_nibbles_first() {
        // d = 0.25, m = -1, byte i = (lo = i, hi = 3): x[i] = i/4 - 1, x[i+16] = 3/4 - 1
        let mut b = [h(0.25), h(-1.0)].concat();
        b.extend((0..16u8).map(|i| i | (3 << 4)));
        let y = deq(BlockType::Q4_1, &b);
        for i in 0..16 {
            assert_eq!(y[i], i as f32 * 0.25 - 1.0);
            assert_eq!(y[i + 16], -0.25);
        }
    }

    /// Pack 8 (scale, min) 6-bit pairs the way ggml's Q4_K/Q5_K quantiser does.
    fn pack_scales(sc: [u8; 8], mn: [u8; 8]) -> [u8; 12] {
        let mut q = [0u8; 12];
        for j in 0..8 {
            if j < 4 {
                q[j] = sc[j];
                q[j + 4] = mn[j];
            } else {
                q[j + 4] = (sc[j] & 15) | ((mn[j] & 15) << 4);
                q[j - 4] |= (sc[j] >> 4) << 6;
                q[j] |= (mn[j] >> 4) << 6;
            }
        }
        q
    }

    #[test]
    fn k_scale_packing_round_trips() {
        let sc = [1, 2, 63, 17, 40, 5, 33, 62];
        let mn = [0, 63, 7, 48, 21, 60, 1, 35];
        let q = pack_scales(sc, mn);
        for j in 0..8 {
            assert_eq!(scale_min_k4(j, &q), (sc[j], mn[j]), "pair {j}");
        }
    }

    #[test]
    fn q4_k_block() {
        // d = 0.5, dmin = 0.25; sub-block s has scale s+1 and min 2s; every
        // quant of sub-block s is (s mod 16): x = 0.5(s+1)(s) - 0.25(2s)
        let sc: [u8; 8] = core::array::from_fn(|s| s as u8 + 1);
        let mn: [u8; 8] = core::array::from_fn(|s| 2 * s as u8);
        let mut b = [h(0.5), h(0.25)].concat();
        b.extend_from_slice(&pack_scales(sc, mn));
        // qs chunk j holds sub-block 2j in low nibbles and 2j+1 in high nibbles
        for j in 0..4u8 {
            b.extend(std::iter::repeat_n((2 * j) | ((2 * j + 1) << 4), 32));
        }
        let y = deq(BlockType::Q4_K, &b);
        for (i, v) in y.iter().enumerate() {
            let s = (i / 32) as f32;
            assert_eq!(*v, 0.5 * (s + 1.0) * s - 0.25 * 2.0 * s, "element {i}");
        }
    }

    #[test]
    fn q5_k_block_high_bit() {
        // Same as Q4_K, but every quant also has its fifth bit set (+16) in
        // sub-blocks 0 and 5 only: qh bit s of byte l marks sub-block s.
        let sc: [u8; 8] = core::array::from_fn(|s| s as u8 + 1);
        let mn: [u8; 8] = core::array::from_fn(|s| 2 * s as u8);
        let mut b = [h(0.5), h(0.25)].concat();
        b.extend_from_slice(&pack_scales(sc, mn));
        b.extend(std::iter::repeat_n(0b0010_0001u8, 32));
        for j in 0..4u8 {
            b.extend(std::iter::repeat_n((2 * j) | ((2 * j + 1) << 4), 32));
        }
        let y = deq(BlockType::Q5_K, &b);
        for (i, v) in y.iter().enumerate() {
            let s = i / 32;
            let q = s as f32 + if s == 0 || s == 5 { 16.0 } else { 0.0 };
            assert_eq!(
                *v,
                0.5 * (s as f32 + 1.0) * q - 0.25 * 2.0 * s as f32,
                "element {i}"
            );
        }
    }

    #[test]
    fn q6_k_block() {
        // Element e of 256 lies in half n = e/128, quarter r = (e%128)/32, lane l = e%32.
        // Its 6-bit quant is ql nibble (r even: ql[64n+l] / ql[64n+l+32]) plus 2 bits of
        // qh[32n+l] at shift 2r; its scale is sc[8n + l/16 + 2r]. Choose ql = 0x21 everywhere
        // (low nibble 1, high nibble 2), qh = 0b11_10_01_00 (quarter r gets high bits r),
        // scales sc[k] = k - 8, d = 0.5:  q = nib + 16r - 32,  x = 0.5 (k-8) q.
        let mut b = vec![0x21u8; 128];
        b.extend(std::iter::repeat_n(0b1110_0100u8, 64));
        b.extend((0..16).map(|k| (k as i8 - 8) as u8));
        b.extend_from_slice(&h(0.5));
        let y = deq(BlockType::Q6_K, &b);
        for (e, v) in y.iter().enumerate() {
            let (n, r, l) = (e / 128, (e % 128) / 32, e % 32);
            let nib = if r < 2 { 1 } else { 2 };
            let q = (nib + 16 * r) as f32 - 32.0;
            let k = 8 * n + l / 16 + 2 * r;
            assert_eq!(*v, 0.5 * (k as f32 - 8.0) * q, "element {e}");
        }
    }

    #[test]
    fn wrong_length_is_an_error() {
        let mut y = vec![0.0; 32];
        assert!(dequantize(BlockType::Q4_1, &[0u8; 19], &mut y).is_err());
    }
}
