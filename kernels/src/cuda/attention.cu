// Attention kernels for capture (causal, with column sums) and replay
// (decode queries over a compressed cache with per-entry logit bias; scoring
// rows). CPU twins: kernels/src/cpu/attention.rs, kernels/src/cpu/decode.rs.

// Causal softmax rows: p (c, n) for queries q (c, d) at positions pos0 + i over
// keys k (n, d), n = pos0 + c. One BLOCK per query row. exp in f32 of
// (s * scale - max * scale), normaliser summed in f64, zeros above the diagonal.
extern "C" __global__ void causal_softmax(const float* q, const float* k, float* p, int n, int d,
                                          int pos0, float scale) {
    __shared__ float shf[BLOCK];
    __shared__ double shd[BLOCK];
    int i = blockIdx.x;
    int valid = pos0 + i + 1;
    const float* qi = q + (i64)i * d;
    float* row = p + (i64)i * n;
    float mx = -INFINITY;
    for (int j = threadIdx.x; j < n; j += BLOCK) {
        float s = j < valid ? dot_seq(qi, k + (i64)j * d, d) : 0.0f;
        row[j] = s;
        if (j < valid) mx = fmaxf(mx, s);
    }
    mx = block_max(mx, shf) * scale;
    double z = 0.0;
    for (int j = threadIdx.x; j < valid; j += BLOCK) {
        float e = expf(row[j] * scale - mx);
        row[j] = e;
        z += (double)e;
    }
    z = block_sum(z, shd);
    float inv = (float)(1.0 / z);
    for (int j = threadIdx.x; j < n; j += BLOCK) row[j] = j < valid ? row[j] * inv : 0.0f;
}

// out (c, d) = p (c, n) . v (n, d); one block per row, threads over d, sum in
// key order.
extern "C" __global__ void probs_times_v(const float* p, const float* v, float* out, int n, int d) {
    int i = blockIdx.x;
    const float* row = p + (i64)i * n;
    for (int t = threadIdx.x; t < d; t += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < n; ++j) acc += row[j] * v[(i64)j * d + t];
        out[(i64)i * d + t] = acc;
    }
}

// colsum[j] += sum_i p[i, j] for j < m, rows added in order (as the CPU does).
extern "C" __global__ void column_sums(const float* p, float* colsum, int c, int n, int m) {
    i64 j = global_id();
    if (j >= m) return;
    float acc = colsum[j];
    for (int i = 0; i < c; ++i) acc += p[(i64)i * n + j];
    colsum[j] = acc;
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

