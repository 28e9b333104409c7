// Attention kernels for capture (causal, with column sums) and replay
// (decode queries over a compressed cache with per-entry logit bias; scoring
// rows). CPU twins: kernels/src/cpu/attention.rs, kernels/src/cpu/decode.rs.

// Causal attention of every head of a layer, batched: blockIdx.y is the
// query head h, which reads KV head h / group. q (heads, c, d); k, v
// (kv_heads, cap, d) caches holding keys 0 .. n - 1, n = pos0 + c; p (heads,
// c, n). A single head over a plain (n, d) key block is heads = group = 1,
// cap = n.
//
// Causal softmax rows: one BLOCK per (query row, head). exp in f32 of
// (s * scale - max * scale), normaliser summed in f64, zeros above the diagonal.
// window > 0: a sliding window of that many keys, the query at position t
// sees keys max(0, t - window + 1) ..= t and the older ones get exactly 0
// (Gemma 3's local layers; CPU twin: cpu::windowed_attention_head); 0: none.
extern "C" __global__ void causal_softmax(const float* q, const float* k, float* p, int c, int n,
                                          int d, int pos0, int cap, int group, float scale,
                                          int window) {
    __shared__ float shf[BLOCK];
    __shared__ double shd[BLOCK];
    int i = blockIdx.x, h = blockIdx.y;
    int valid = pos0 + i + 1;
    int lo = window > 0 && valid > window ? valid - window : 0;
    const float* qi = q + ((i64)h * c + i) * d;
    const float* kh = k + (i64)(h / group) * cap * d;
    float* row = p + ((i64)h * c + i) * n;
    float mx = -INFINITY;
    for (int j = threadIdx.x; j < n; j += BLOCK) {
        bool live = j >= lo && j < valid;
        float s = live ? dot_seq(qi, kh + (i64)j * d, d) : 0.0f;
        row[j] = s;
        if (live) mx = fmaxf(mx, s);
    }
    mx = block_max(mx, shf) * scale;
    double z = 0.0;
    for (int j = lo + threadIdx.x; j < valid; j += BLOCK) {
        float e = expf(row[j] * scale - mx);
        row[j] = e;
        z += (double)e;
    }
    z = block_sum(z, shd);
    float inv = (float)(1.0 / z);
    for (int j = threadIdx.x; j < n; j += BLOCK) row[j] = j >= lo && j < valid ? row[j] * inv : 0.0f;
}

// Split-K product with v: part (heads, c, splits, d) holds, for split s,
// sum over keys j in [s * KEY_SPLIT, min(n, (s + 1) * KEY_SPLIT)) of
// p[h, i, j] * v[j] in key order; blockIdx = (row, head, split), threads over
// d. Splitting the keys keeps a decode step (one row) from summing thousands
// of keys in one thread; the split size is fixed (not the GPU's), so results
// do not depend on the device.
extern "C" __global__ void probs_times_v(const float* p, const float* v, float* part, int c, int n,
                                         int d, int cap, int group) {
    int i = blockIdx.x, h = blockIdx.y, sp = blockIdx.z, splits = gridDim.z;
    const float* row = p + ((i64)h * c + i) * n;
    const float* vh = v + (i64)(h / group) * cap * d;
    int j0 = sp * KEY_SPLIT, j1 = min(n, j0 + KEY_SPLIT);
    for (int t = threadIdx.x; t < d; t += blockDim.x) {
        float acc = 0.0f;
        for (int j = j0; j < j1; ++j) acc += row[j] * vh[(i64)j * d + t];
        part[(((i64)h * c + i) * splits + sp) * d + t] = acc;
    }
}

// out (rows, d) = the sum over splits of part (rows, splits, d), in split
// order; one thread per output element.
extern "C" __global__ void sum_splits(const float* part, float* out, int rows, int splits, int d) {
    i64 e = global_id();
    if (e >= (i64)rows * d) return;
    i64 r = e / d;
    int t = (int)(e % d);
    float acc = 0.0f;
    for (int sp = 0; sp < splits; ++sp) acc += part[(r * splits + sp) * d + t];
    out[e] = acc;
}

// colsum (heads, tracked): colsum[h, j] += sum_i p[h, i, j] for j < m; as
// the CPU does, each block of ATTN_ROWS rows is added in order from zero into
// a part, and the parts are added to the column sum in order; blockIdx.y is
// the head.
extern "C" __global__ void column_sums(const float* p, float* colsum, int c, int n, int m,
                                       int tracked) {
    i64 j = global_id();
    if (j >= m) return;
    int h = blockIdx.y;
    const float* ph = p + (i64)h * c * n;
    float acc = colsum[(i64)h * tracked + j];
    for (int i0 = 0; i0 < c; i0 += ATTN_ROWS) {
        int i1 = min(c, i0 + ATTN_ROWS);
        float part = 0.0f;
        for (int i = i0; i < i1; ++i) part += ph[(i64)i * n + j];
        acc += part;
    }
    colsum[(i64)h * tracked + j] = acc;
}

// Decode queries over a cache with logit bias. q (nq, d); keys, vals (n, d);
// bias (n); w (nq, n) gets exp(logit - max) in f64; z (nq) their sums; out
// (nq, d) = sum_e (w_e / z) v_e accumulated in f32 in entry order.
extern "C" __global__ void attend_biased(const float* q, const float* keys, const float* vals,
                                         const float* bias, double* w, double* z, float* out,
                                         int n, int d, float scale) {
    __shared__ float shf[BLOCK];
    __shared__ double shd[BLOCK];
    int i = blockIdx.x;
    const float* qi = q + (i64)i * d;
    double* wi = w + (i64)i * n;
    float mx = -INFINITY;
    for (int e = threadIdx.x; e < n; e += BLOCK) {
        float l = dot_seq(qi, keys + (i64)e * d, d) * scale + bias[e];
        wi[e] = (double)l;
        mx = fmaxf(mx, l);
    }
    mx = block_max(mx, shf);
    double acc = 0.0;
    for (int e = threadIdx.x; e < n; e += BLOCK) {
        double x = exp((double)((float)wi[e] - mx));
        wi[e] = x;
        acc += x;
    }
    double zi = block_sum(acc, shd);
    if (threadIdx.x == 0) z[i] = zi;
    __syncthreads();
    for (int t = threadIdx.x; t < d; t += BLOCK) {
        float o = 0.0f;
        for (int e = 0; e < n; ++e) o += (float)(wi[e] / zi) * vals[(i64)e * d + t];
        out[(i64)i * d + t] = o;
    }
}

// Scoring rows: row r is q[r] over keys 0 .. lens[r] with logits
// dot * scale * gains[r], softmax (f32 exp, f64 normaliser), zero beyond.
extern "C" __global__ void attention_rows(const float* q, const float* keys, const int* lens,
                                          const float* gains, float* out, int n, int d,
                                          float scale) {
    __shared__ float shf[BLOCK];
    __shared__ double shd[BLOCK];
    int r = blockIdx.x;
    int len = lens[r];
    const float* qr = q + (i64)r * d;
    float* row = out + (i64)r * n;
    float mx = -INFINITY;
    for (int j = threadIdx.x; j < len; j += BLOCK) {
        float x = dot_seq(qr, keys + (i64)j * d, d) * scale * gains[r];
        row[j] = x;
        mx = fmaxf(mx, x);
    }
    mx = block_max(mx, shf);
    double z = 0.0;
    for (int j = threadIdx.x; j < len; j += BLOCK) {
        float e = expf(row[j] - mx);
        row[j] = e;
        z += (double)e;
    }
    z = block_sum(z, shd);
    float inv = (float)(1.0 / z);
    for (int j = threadIdx.x; j < n; j += BLOCK) row[j] = j < len ? row[j] * inv : 0.0f;
}

