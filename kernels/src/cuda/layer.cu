// The element-wise and row-wise operations of a llama block.
// CPU twins: kernels/src/cpu/norm.rs and kernels/src/cpu/rope.rs.

// out (rows, dim) = table[ids[r]] rows; one thread per element.
extern "C" __global__ void embedding(const float* table, const unsigned int* ids, float* out,
                                     int dim, i64 n) {
    i64 i = global_id();
    if (i >= n) return;
    i64 r = i / dim;
    out[i] = table[(i64)ids[r] * dim + (i % dim)];
}

// RMSNorm of each row of x (rows, dim) in place; one BLOCK per row; the mean
// square is summed in f64.
extern "C" __global__ void rms_norm(float* x, const float* w, int dim, float eps) {
    __shared__ double sh[BLOCK];
    float* row = x + (i64)blockIdx.x * dim;
    double acc = 0.0;
    for (int j = threadIdx.x; j < dim; j += BLOCK) acc += (double)row[j] * (double)row[j];
    double ms = block_sum(acc, sh) / (double)dim;
    float inv = (float)(1.0 / sqrt(ms + (double)eps));
    for (int j = threadIdx.x; j < dim; j += BLOCK) row[j] = row[j] * inv * w[j];
}

// gate = silu(gate) * up, element-wise: g / (1 + e^-g) * up, as the CPU
// twin computes it (kv_exp).
extern "C" __global__ void silu_mul(float* gate, const float* up, i64 n) {
    i64 i = global_id();
    if (i >= n) return;
    float g = gate[i];
    gate[i] = g / (1.0f + kv_exp(-g)) * up[i];
}

// gate = gelu_tanh(gate) * up, element-wise (Gemma's GeGLU): the CPU twin's
// f32 operations in its order: gelu(x) = 0.5 x (1 + tanh(z)) computed as
// x / (1 + e^(-2z)), z = sqrt(2/pi) (x + 0.044715 x^3).
extern "C" __global__ void gelu_tanh_mul(float* gate, const float* up, i64 n) {
    i64 i = global_id();
    if (i >= n) return;
    float x = gate[i];
    float c = __int_as_float(0x3d372713) * x * x * x;
    float z = __int_as_float(0x3f4c422a) * (x + c);
    gate[i] = x / (1.0f + kv_exp(-2.0f * z)) * up[i];
}

// x *= s, element-wise (Gemma's embedding scale).
extern "C" __global__ void scale_inplace(float* x, float s, i64 n) {
    i64 i = global_id();
    if (i >= n) return;
    x[i] *= s;
}

// Rotate x (rows, n_heads, head_dim) in place by a (rows, half, 2) cos/sin
// table; one thread per rotated pair. interleaved: pairs (2i, 2i+1), else
// (i, i + half).
extern "C" __global__ void rope(float* x, const float* table, int rows, int n_heads,
                                int head_dim, int half, int interleaved) {
    i64 t = global_id();
    if (t >= (i64)rows * n_heads * half) return;
    int i = (int)(t % half);
    i64 rh = t / half;
    int r = (int)(rh / n_heads);
    float* head = x + rh * head_dim;
    float c = table[((i64)r * half + i) * 2], s = table[((i64)r * half + i) * 2 + 1];
    int a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half;
    float x0 = head[a], x1 = head[b];
    head[a] = x0 * c - x1 * s;
    head[b] = x1 * c + x0 * s;
}

// x += y, element-wise (the residual stream). CPU twin: the add in
// Backend::add_assign (kernels/src/resident.rs).
extern "C" __global__ void add_inplace(float* x, const float* y, i64 n) {
    i64 i = global_id();
    if (i >= n) return;
    x[i] += y[i];
}

// (c, heads, d) row-major <-> (heads, c, d) head-major; one thread per
// element of the output. to_heads: row-major in, head-major out.
// CPU twin: Backend::transpose_heads (kernels/src/resident.rs).
extern "C" __global__ void transpose_heads(const float* x, float* out, int c, int heads, int d,
                                           int to_heads) {
    i64 i = global_id();
    i64 n = (i64)c * heads * d;
    if (i >= n) return;
    int e = (int)(i % d);
    i64 r = i / d;
    if (to_heads) {
        // out index (h, t, e) <- x (t, h, e)
        int t = (int)(r % c), h = (int)(r / c);
        out[i] = x[((i64)t * heads + h) * d + e];
    } else {
        // out index (t, h, e) <- x (h, t, e)
        int h = (int)(r % heads), t = (int)(r / heads);
        out[i] = x[((i64)h * c + t) * d + e];
    }
}

// Fallback product when cuBLAS is absent: out[m, n] = x[m, k] . w[n, k]^T,
// 16x16 tiles, each output summed in k order.
#define TILE 16
extern "C" __global__ void linear_tiled(const float* x, const float* w, float* out, int m, int k,
                                        int n) {
    __shared__ float xs[TILE][TILE + 1];
    __shared__ float ws[TILE][TILE + 1];
    int r = blockIdx.y * TILE + threadIdx.y, c = blockIdx.x * TILE + threadIdx.x;
    float acc = 0.0f;
    for (int t0 = 0; t0 < k; t0 += TILE) {
        int tx = t0 + threadIdx.x;
        xs[threadIdx.y][threadIdx.x] = (r < m && tx < k) ? x[(i64)r * k + tx] : 0.0f;
        int wr = blockIdx.x * TILE + threadIdx.y;
        ws[threadIdx.y][threadIdx.x] = (wr < n && tx < k) ? w[(i64)wr * k + tx] : 0.0f;
        __syncthreads();
        for (int t = 0; t < TILE; ++t) acc += xs[threadIdx.y][t] * ws[threadIdx.x][t];
        __syncthreads();
    }
    if (r < m && c < n) out[(i64)r * n + c] = acc;
}
