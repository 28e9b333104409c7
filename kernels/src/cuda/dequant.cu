// GGUF block dequantisation, one thread per output element.
// CPU twin: kernels/src/cpu/dequant.rs (same formulas, same operation order).

extern "C" __global__ void dequant_f32(const u8* src, float* out, i64 n) {
    i64 i = global_id();
    if (i < n) out[i] = __uint_as_float(ld32(src + 4 * i));
}

extern "C" __global__ void dequant_f16(const u8* src, float* out, i64 n) {
    i64 i = global_id();
    if (i < n) out[i] = f16_at(src + 2 * i);
}

extern "C" __global__ void dequant_bf16(const u8* src, float* out, i64 n) {
    i64 i = global_id();
    if (i < n) out[i] = bf2f(ld16(src + 2 * i));
}

// Q8_0: 34 bytes per 32 elements: f16 d; i8 q[32]
extern "C" __global__ void dequant_q8_0(const u8* src, float* out, i64 n) {
    i64 i = global_id();
    if (i >= n) return;
    const u8* b = src + (i / 32) * 34;
    int j = (int)(i % 32);
    out[i] = f16_at(b) * (float)(signed char)b[2 + j];
}

// Q4_0: 18 bytes per 32: f16 d; u8 qs[16]; low nibbles are elements 0..16
extern "C" __global__ void dequant_q4_0(const u8* src, float* out, i64 n) {
    i64 i = global_id();
    if (i >= n) return;
    const u8* b = src + (i / 32) * 18;
    int j = (int)(i % 32);
    u8 q = b[2 + (j % 16)];
    int nib = j < 16 ? (q & 15) : (q >> 4);
    out[i] = f16_at(b) * (float)(nib - 8);
}

// Q4_1: 20 bytes per 32: f16 d, m; u8 qs[16]
extern "C" __global__ void dequant_q4_1(const u8* src, float* out, i64 n) {
    i64 i = global_id();
    if (i >= n) return;
    const u8* b = src + (i / 32) * 20;
    int j = (int)(i % 32);
    u8 q = b[4 + (j % 16)];
    int nib = j < 16 ? (q & 15) : (q >> 4);
    out[i] = f16_at(b) * (float)nib + f16_at(b + 2);
}

// The j-th 6-bit (scale, min) pair of a K-quant super-block's 12 scale bytes.
__device__ __forceinline__ void scale_min_k4(int j, const u8* q, int* sc, int* m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Q4_K: 144 bytes per 256: f16 d, dmin; u8 scales[12]; u8 qs[128]
extern "C" __global__ void dequant_q4_k(const u8* src, float* out, i64 n) {
    i64 i = global_id();
    if (i >= n) return;
    const u8* b = src + (i / 256) * 144;
    int e = (int)(i % 256);
    int j = e / 64, w = e % 64, l = w % 32, hi = w >= 32;
    int sc, m;
    scale_min_k4(2 * j + hi, b + 4, &sc, &m);
    float dd = f16_at(b) * (float)sc, mm = f16_at(b + 2) * (float)m;
    u8 q = b[16 + 32 * j + l];
    int nib = hi ? (q >> 4) : (q & 15);
    out[i] = dd * (float)nib - mm;
}

// Q5_K: 176 bytes per 256: f16 d, dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]
extern "C" __global__ void dequant_q5_k(const u8* src, float* out, i64 n) {
    i64 i = global_id();
    if (i >= n) return;
    const u8* b = src + (i / 256) * 176;
    int e = (int)(i % 256);
    int j = e / 64, w = e % 64, l = w % 32, hi = w >= 32;
    int sc, m;
    scale_min_k4(2 * j + hi, b + 4, &sc, &m);
    float dd = f16_at(b) * (float)sc, mm = f16_at(b + 2) * (float)m;
    u8 q = b[48 + 32 * j + l];
    u8 mask = hi ? (u8)(2 << (2 * j)) : (u8)(1 << (2 * j));
    int v = (hi ? (q >> 4) : (q & 15)) + ((b[16 + l] & mask) ? 16 : 0);
    out[i] = dd * (float)v - mm;
}

// Q6_K: 210 bytes per 256: u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d
extern "C" __global__ void dequant_q6_k(const u8* src, float* out, i64 n) {
    i64 i = global_id();
    if (i >= n) return;
    const u8* b = src + (i / 256) * 210;
    int e = (int)(i % 256);
    int half = e / 128, r = e % 128, quarter = r / 32, l = r % 32, is = l / 16;
    const u8* ql = b + 64 * half;
    const u8* qh = b + 128 + 32 * half;
    const signed char* sc = (const signed char*)(b + 192 + 8 * half);
    int q;
    switch (quarter) {
        case 0: q = (ql[l] & 15) | ((qh[l] & 3) << 4); break;
        case 1: q = (ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4); break;
        case 2: q = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4); break;
        default: q = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4); break;
    }
    out[i] = f16_at(b + 208) * (float)sc[is + 2 * quarter] * (float)(q - 32);
}
