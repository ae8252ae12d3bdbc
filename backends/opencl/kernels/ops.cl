// Everything but the matrix products, for a chunk of one sequence's tokens (the second work dimension, t):
// norms, RoPE and the KV cache, and attention. OpenCL C 1.2 core only. Built with HEAD_DIM set
// to the model's, and KV_HALF defined for an f16 cache (stored through vstore_half: no fp16 extension).
//
// Every argument is set once, when the backend plans its kernels, but the chunk's first position: step[0],
// uploaded once a chunk. Token t is at position step[0] + t, its keys and values go to cells[step[0] + t],
// and it attends to the cells before.

#ifdef KV_HALF
#define KV_T half
#define KV_LOAD(i, p) vload_half((i), (p))
#define KV_LOAD8(i, p) vload_half8((i), (p))
#define KV_STORE(v, i, p) vstore_half((v), (i), (p))
#else
#define KV_T float
#define KV_LOAD(i, p) ((p)[i])
#define KV_LOAD8(i, p) vload8((i), (p))
#define KV_STORE(v, i, p) ((p)[i] = (v))
#endif
#define CHUNKS (HEAD_DIM / 8)  // a head's values as float8s: every head_dim the models use is a multiple of 8

float sum8(float8 v) {
    float4 b = v.lo + v.hi;
    return b.x + b.y + b.z + b.w;
}

// y = x / rms(x) * w for each of the rows (work-items) of n values from x + at in each token's row of x
// (`stride` apart); y may be x.
__kernel void rms_norm(__global float *x, __global const float *w, __global float *y, int n, float eps, int at,
                       int stride) {
    size_t row = (size_t)get_global_id(1) * stride + at + get_global_id(0) * n;
    float squares = 0.0f;
    for (int i = 0; i < n; i++)
        squares += x[row + i] * x[row + i];
    float scale = rsqrt(squares / n + eps);
    for (int i = 0; i < n; i++)
        y[row + i] = x[row + i] * scale * w[i];
}

// x += y, then h = rms_norm(x) * w: a block's residual add and the next norm, a work-item a token.
__kernel void add_norm(__global float *x, __global const float *y, __global const float *w, __global float *h,
                       int n, float eps) {
    size_t row = (size_t)get_global_id(1) * n;
    float squares = 0.0f;
    for (int i = 0; i < n; i++) {
        x[row + i] += y[row + i];
        squares += x[row + i] * x[row + i];
    }
    float scale = rsqrt(squares / n + eps);
    for (int i = 0; i < n; i++)
        h[row + i] = x[row + i] * scale * w[i];
}

// Indices of rotation pair i of a head: (2i, 2i + 1) in the "norm" style, (i, i + HEAD_DIM / 2) in "neox".
int2 pair_of(int i, int neox) {
    return neox ? (int2)(i, i + HEAD_DIM / 2) : (int2)(2 * i, 2 * i + 1);
}

// RoPE on the query heads (scaled by the attention's scale) and the key heads of each token's qkv = [q | k | v],
// with its position's cos and sin (tables of a row of HEAD_DIM / 2 a position), then its keys and values into its
// cell of the layer's cache: a work-item a rotation pair of one head.
__kernel void rope_store(__global float *qkv, __global const float *cos_, __global const float *sin_,
                         __global KV_T *keys, __global KV_T *values, __global const int *cells,
                         __global const int *step, int n_head, int n_kv, int neox, float scale) {
    int half_dim = HEAD_DIM / 2, t = get_global_id(1);
    int head = get_global_id(0) / half_dim, i = get_global_id(0) % half_dim;
    int2 ab = pair_of(i, neox);
    int q_dim = n_head * HEAD_DIM, kv_dim = n_kv * HEAD_DIM;
    __global float *row = qkv + (size_t)t * (q_dim + 2 * kv_dim);
    bool is_key = head >= n_head;
    int start = head * HEAD_DIM;  // keys follow the queries in qkv
    float s = is_key ? 1.0f : scale;
    size_t angle = (size_t)(step[0] + t) * half_dim + i;
    float c = cos_[angle] * s, sn = sin_[angle] * s;
    float x0 = row[start + ab.x], x1 = row[start + ab.y];
    float r0 = x0 * c - x1 * sn, r1 = x0 * sn + x1 * c;
    row[start + ab.x] = r0;
    row[start + ab.y] = r1;
    if (is_key) {
        int within = start - q_dim;  // this key head's place in the cell
        size_t cell = (size_t)cells[step[0] + t] * kv_dim + within;
        KV_STORE(r0, cell + ab.x, keys);
        KV_STORE(r1, cell + ab.y, keys);
        KV_STORE(row[q_dim + kv_dim + within + ab.x], cell + ab.x, values);
        KV_STORE(row[q_dim + kv_dim + within + ab.y], cell + ab.y, values);
    }
}

// Keys of the cells listed, rotated by one angle per pair (an eviction moving them back), in place.
__kernel void rerotate(__global KV_T *keys, __global const int *cells, __global const float *cos_,
                       __global const float *sin_, int n_kv, int neox) {
    int half_dim = HEAD_DIM / 2;
    int i = get_global_id(0) % half_dim, head = get_global_id(0) / half_dim;  // head over cells * n_kv
    size_t base = ((size_t)cells[head / n_kv] * n_kv + head % n_kv) * HEAD_DIM;
    int2 ab = pair_of(i, neox);
    float x0 = KV_LOAD(base + ab.x, keys), x1 = KV_LOAD(base + ab.y, keys);
    KV_STORE(x0 * cos_[i] - x1 * sin_[i], base + ab.x, keys);
    KV_STORE(x0 * sin_[i] + x1 * cos_[i], base + ab.y, keys);
}

// Attention in two kernels, so that a long context spreads over many work-items: attention_part takes one
// query head of one token and one of SPLITS equal parts of the positions it sees (those up to its own, within
// `window`: 0 for all, whose cells are listed in order), and keeps softmax(q . k) . v over its part unnormalised,
// with its running maximum rescaling the sums as it goes; attention_join weighs the parts by their maxima.
// SPLITS is set at build. A part's record in `parts`: its maximum, its total weight, then HEAD_DIM sums.
#define PART (HEAD_DIM + 2)
__kernel void attention_part(__global const float *qkv, __global const KV_T *keys, __global const KV_T *values,
                             __global const int *cells, __global const int *step, int n_kv, int window,
                             __global float *parts) {
    int h = get_global_id(0) / SPLITS, split = get_global_id(0) % SPLITS, t = get_global_id(1);
    int n_head = get_global_size(0) / SPLITS, kv_head = h / (n_head / n_kv);
    int n = step[0] + t + 1;  // positions this token sees, itself included
    int first = window ? max(0, n - window) : 0;
    int length = (n - first + SPLITS - 1) / SPLITS;
    int from = first + split * length, to = min(n, from + length);
    size_t query = ((size_t)t * (n_head + 2 * n_kv) + h) * CHUNKS;  // in float8s
    float8 q[CHUNKS], acc[CHUNKS];
    for (int c = 0; c < CHUNKS; c++) {
        q[c] = vload8(query + c, qkv);
        acc[c] = 0.0f;
    }
    // Eight positions at a time: their scores, one rescaling of the sums for all eight, and their weights as
    // one vector exp (one position at a time, two scalar exps a position bound the loop: 2.3x slower).
    float best = -INFINITY, total = 0.0f;
    for (int p0 = from; p0 < to; p0 += 8) {
        int count = min(8, to - p0);
        float scores[8];
        for (int j = 0; j < 8; j++) {
            float8 products = 0.0f;
            if (j < count) {
                size_t base = ((size_t)cells[p0 + j] * n_kv + kv_head) * CHUNKS;
                for (int c = 0; c < CHUNKS; c++)
                    products += q[c] * KV_LOAD8(base + c, keys);
            }
            scores[j] = j < count ? sum8(products) : -INFINITY;
        }
        float8 row = vload8(0, scores);
        float4 pairs = fmax(row.lo, row.hi);
        float top = fmax(best, fmax(fmax(pairs.x, pairs.y), fmax(pairs.z, pairs.w)));
        float shrink = exp(best - top);
        float8 weights = exp(row - top);  // a position past the part's end: exp(-inf) = 0
        total = total * shrink + sum8(weights);
        float w[8];
        vstore8(weights, 0, w);
        for (int c = 0; c < CHUNKS; c++)
            acc[c] *= shrink;
        for (int j = 0; j < count; j++) {
            size_t base = ((size_t)cells[p0 + j] * n_kv + kv_head) * CHUNKS;
            for (int c = 0; c < CHUNKS; c++)
                acc[c] += w[j] * KV_LOAD8(base + c, values);
        }
        best = top;
    }
    __global float *part = parts + (((size_t)t * n_head + h) * SPLITS + split) * PART;
    part[0] = best;
    part[1] = total;
    for (int c = 0; c < CHUNKS; c++)
        vstore8(acc[c], 0, part + 2 + 8 * c);
}

// One query head of one token (a work-item): its parts joined, each weighed by exp(its maximum - theirs).
__kernel void attention_join(__global const float *parts, __global float *out) {
    int h = get_global_id(0), t = get_global_id(1), n_head = get_global_size(0);
    __global const float *part = parts + ((size_t)t * n_head + h) * SPLITS * PART;
    float best = -INFINITY;
    for (int s = 0; s < SPLITS; s++)
        best = fmax(best, part[s * PART]);
    float8 acc[CHUNKS];
    for (int c = 0; c < CHUNKS; c++)
        acc[c] = 0.0f;
    float total = 0.0f;
    for (int s = 0; s < SPLITS; s++) {
        float weight = part[s * PART] == -INFINITY ? 0.0f : exp(part[s * PART] - best);  // an empty part: none
        total += weight * part[s * PART + 1];
        for (int c = 0; c < CHUNKS; c++)
            acc[c] += weight * vload8(0, part + s * PART + 2 + 8 * c);
    }
    for (int c = 0; c < CHUNKS; c++)
        vstore8(acc[c] / total, ((size_t)t * n_head + h) * CHUNKS + c, out);
}

// The greedy token of a row of n logits, in two kernels, so that only it comes back: each work-item of
// argmax_part scans `stretch` logits for the largest and where it is (the first of equals, and a NaN above
// everything: numpy's argmax), and argmax_join picks among the parts, writing `not_finite` where the winner is
// not finite (the engine's sign of corrupt weights).
__kernel void argmax_part(__global const float *row, int n, int stretch, __global float *best, __global int *at) {
    int part = get_global_id(0);
    int begin = min(part * stretch, n), end = min(begin + stretch, n);
    float top = -INFINITY;
    int where = begin;
    for (int i = begin; i < end; i++) {
        float v = row[i];
        if (isnan(v)) {
            top = v;
            where = i;
            break;
        }
        if (v > top) {
            top = v;
            where = i;
        }
    }
    best[part] = top;
    at[part] = where;
}

__kernel void argmax_join(__global const float *best, __global const int *at, int parts, int not_finite,
                          __global int *token) {
    float top = best[0];
    int where = at[0];
    for (int p = 1; p < parts && !isnan(top); p++) {
        if (isnan(best[p]) || best[p] > top) {
            top = best[p];
            where = at[p];
        }
    }
    token[0] = isfinite(top) ? where : not_finite;
}
