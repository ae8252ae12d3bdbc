// The matrix products. For decode, matrix-vector products on the GGUF's own blocks (matvec_<type>):
// y[at + r] = dot(W[r], x) (+ bias[r]) for the n rows of W, `at` placing them in a buffer several products
// share (Q, K and V of mixed types, say). For a prompt's tokens, each matrix is dequantized to float32
// (dequantize_<type>) and multiplied by the tokens' rows in tiles (gemm): unpacking a block once serves
// every token, where a product per token would unpack it again for each.
//
// OpenCL C 1.2 core only. Each work-item takes ROWS rows (2, 4 or 8: set at build, chosen per device by
// tuning.py), so that every block of x it loads serves ROWS rows, and keeps each row's sum in a vector
// reduced once at the end. The quantized types come in the "flat" layout, each block's scale (and minimum)
// in one buffer and its codes in another, so every load is aligned and as wide as the codes:
//   Q4_0: value = (q - 8) * d, 32 codes of 4 bits a block; GGUF packs element j with element j + 16
//   Q4_1: value = q * d + m
//   Q8_0: value = q * d, q signed
// A block's offset (Q4_0's -8 d, Q4_1's m) multiplies the block's sum of x, computed once for all ROWS rows.
// These types' scales are halves, read as bits (half_bits: no fp16 extension is needed), or, built with
// SCALE_FLOAT, float32 that the upload widened them to (tuning.py measures which is faster on the device).

#ifndef ROWS
#define ROWS 4
#endif

float sum16(float16 v) {
    float8 a = v.lo + v.hi;
    float4 b = a.lo + a.hi;
    return b.x + b.y + b.z + b.w;
}

float sum8(float8 v) {
    float4 b = v.lo + v.hi;
    return b.x + b.y + b.z + b.w;
}

// A half's value from its bits, without branches (scales are never infinite or NaN): a normal half's exponent
// rebased by 112 in a float's places, a subnormal one's 10 bits times 2^-24, so that no float is subnormal
// (devices may flush those to zero). PoCL's scalar vload_half branches on the exponent, which cost the 4-bit
// products a third of their speed (scripts/bench_opencl.py).
float half_bits(ushort h) {
    uint magnitude = h & 0x7fff;
    float value = magnitude < 0x400 ? (float)magnitude * 0x1p-24f : as_float((magnitude << 13) + 0x38000000u);
    return as_float(as_uint(value) | ((uint)(h & 0x8000) << 16));
}

#ifdef SCALE_FLOAT
#define SCALE_T float
#define SCALE(p, i) ((p)[i])
#else
#define SCALE_T ushort
#define SCALE(p, i) half_bits((p)[i])
#endif

// Row j of this work-item's ROWS, as an index; past the last row it repeats the last row, whose
// result is then not written.
#define ROW(j) min(get_global_id(0) * ROWS + (j), (size_t)n - 1)
#if ROWS == 2
#define FOR_ROWS(STEP) STEP(0) STEP(1)
#elif ROWS == 4
#define FOR_ROWS(STEP) STEP(0) STEP(1) STEP(2) STEP(3)
#elif ROWS == 8
#define FOR_ROWS(STEP) STEP(0) STEP(1) STEP(2) STEP(3) STEP(4) STEP(5) STEP(6) STEP(7)
#else
#error ROWS must be 2, 4 or 8
#endif
// The FFN's gate (SiLU, or GELU's tanh form, as models/reference.py writes them) times its up value.
float silu(float g) {
    return g * (0.5f + 0.5f * tanh(0.5f * g));
}

float gelu(float g) {
    return 0.5f * g * (1.0f + tanh(0.7978845608f * (g + 0.044715f * g * g * g)));
}

#ifdef GATE
// Built with GATE (silu or gelu) for the FFN's gate and up stacked with their rows interleaved, gate row i then
// up row i: each pair is written as one value, GATE(gate) * up, at row i, so no kernel of its own applies the gate.
// ROWS is even, so a work-item's pairs are whole; `pending` holds a pair's gate until its up value.
#define OUTPUTS float pending = 0.0f;
#define PUT(j, value)                                                                                       \
    if ((j) % 2 == 0)                                                                                       \
        pending = (value);                                                                                  \
    else if (get_global_id(0) * ROWS + (j) < n)                                                             \
        y[at + (get_global_id(0) * ROWS + (j)) / 2] = GATE(pending) * (value);
#else
#define OUTPUTS
#define PUT(j, value)                                                                                       \
    if (get_global_id(0) * ROWS + (j) < n)                                                                  \
        y[at + ROW(j)] = bias ? (value) + bias[ROW(j)] : (value);
#endif

// 4-bit codes of one block as floats: elements 0-15 (low nibbles) and 16-31 (high nibbles).
#define LOW(codes) convert_float16((codes) & (uchar16)0xF)
#define HIGH(codes) convert_float16((codes) >> (uchar16)4)
// The dot product of a block's 32 values, as 16 floats for elements 0-15 and 16-31, with x's (xl, xh), in
// eight lanes.
#define DOT32(L, H) ((L).lo * xl.lo + (L).hi * xl.hi + (H).lo * xh.lo + (H).hi * xh.hi)
// The loop over a row's blocks of 32, x's block loaded once for all ROWS rows, with its sum.
#define FOR_BLOCKS(STEP)                                                                                    \
    for (int b = 0; b < k / 32; b++) {                                                                      \
        float16 xl = vload16(0, x + b * 32), xh = vload16(0, x + b * 32 + 16);                              \
        float block_sum = sum16(xl + xh);                                                                   \
        FOR_ROWS(STEP)                                                                                      \
    }

__kernel void matvec_f32(__global const float *w, __global const float *x, __global float *y,
                         __global const float *bias, int k, int at, int n) {
    OUTPUTS
#define F32_START(j) __global const float *w##j = w + ROW(j) * (size_t)k; float8 a##j = 0.0f;
#define F32_STEP(j) a##j += vload8(0, w##j + i) * xs;
#define F32_TAIL(j) float t##j = sum8(a##j); for (int e = i; e < k; e++) t##j += w##j[e] * x[e]; PUT(j, t##j)
    FOR_ROWS(F32_START)
    int i = 0;
    for (; i + 8 <= k; i += 8) {
        float8 xs = vload8(0, x + i);
        FOR_ROWS(F32_STEP)
    }
    FOR_ROWS(F32_TAIL)
}

__kernel void matvec_f16(__global const half *w, __global const float *x, __global float *y,
                         __global const float *bias, int k, int at, int n) {
    OUTPUTS
#define F16_START(j) size_t w##j = ROW(j) * (size_t)k; float8 a##j = 0.0f;
#define F16_STEP(j) a##j += vload_half8(0, w + w##j + i) * xs;
#define F16_TAIL(j) float t##j = sum8(a##j); for (int e = i; e < k; e++) t##j += vload_half(w##j + e, w) * x[e]; PUT(j, t##j)
    FOR_ROWS(F16_START)
    int i = 0;
    for (; i + 8 <= k; i += 8) {
        float8 xs = vload8(0, x + i);
        FOR_ROWS(F16_STEP)
    }
    FOR_ROWS(F16_TAIL)
}

// Each row's sums: its products in eight lanes, and its blocks' offsets times their sums of x.
#define BLOCKS_START(j) size_t f##j = ROW(j) * (size_t)(k / 32); float8 a##j = 0.0f; float m##j = 0.0f;
#define BLOCKS_END(j) PUT(j, sum8(a##j) + m##j)
// A block's codes widened to ints once; its nibbles from them.
#define NIBBLES(j) int16 c = convert_int16(vload16(f##j + b, q)); float16 lo = convert_float16(c & 15), hi = convert_float16(c >> 4);

__kernel void matvec_q4_0(__global const SCALE_T *d, __global const uchar *q, __global const float *x,
                          __global float *y, __global const float *bias, int k, int at, int n) {
    OUTPUTS
#define Q4_0_STEP(j) { NIBBLES(j) float s = SCALE(d, f##j + b); a##j += s * DOT32(lo, hi); m##j -= 8.0f * s * block_sum; }
    FOR_ROWS(BLOCKS_START)
    FOR_BLOCKS(Q4_0_STEP)
    FOR_ROWS(BLOCKS_END)
}

__kernel void matvec_q4_1(__global const SCALE_T *d, __global const SCALE_T *m, __global const uchar *q,
                          __global const float *x, __global float *y, __global const float *bias, int k, int at,
                          int n) {
    OUTPUTS
#define Q4_1_STEP(j) { NIBBLES(j) a##j += SCALE(d, f##j + b) * DOT32(lo, hi); m##j += SCALE(m, f##j + b) * block_sum; }
    FOR_ROWS(BLOCKS_START)
    FOR_BLOCKS(Q4_1_STEP)
    FOR_ROWS(BLOCKS_END)
}

__kernel void matvec_q8_0(__global const SCALE_T *d, __global const char *q, __global const float *x,
                          __global float *y, __global const float *bias, int k, int at, int n) {
    OUTPUTS
#define Q8_0_STEP(j) {                                                                                      \
        float16 lo = convert_float16(vload16(2 * (f##j + b), q)), hi = convert_float16(vload16(2 * (f##j + b) + 1, q)); \
        a##j += SCALE(d, f##j + b) * DOT32(lo, hi); }
    FOR_ROWS(BLOCKS_START)
    FOR_BLOCKS(Q8_0_STEP)
    FOR_ROWS(BLOCKS_END)
}

// -- rows across lanes: Q4_0, Q4_1 and Q8_0 ----------------------------------------------------------------
// The "lanes" layout: each work-item takes 16 rows, one a lane of float16 sums, so that every product of a code
// and x is a 16-wide vector operation with x's value the same in each lane, and the work-item reads its rows'
// blocks as one stream. Rows come in groups of 16 (the last group padded with zero rows), and within a group
// block by block, a vector of codes for the group's 16 rows side by side:
//   4 bits: four 32-bit words a row's block, word v holding elements 8v to 8v + 7, element 8v + j in bits 4j to
//           4j + 3 (the upload reorders GGUF's bytes, whose byte p holds elements p and p + 16);
//   Q8_0:   32 bytes a row's block, in order.
// The blocks' 16 float32 scales lie in a buffer of their own in the same order, and Q4_1's minimums in another.
// On PoCL a 16384x8192 product takes under half the flat layout's time at 4 bits (scripts/bench_opencl.py); a GPU
// wants the flat one, and the timing (tuning.py) chooses.
#define LANE_ROW0 (get_global_id(0) * 16)
// A block's codes times x's (xb: the block's 32 values), a row a lane, into four sums, so that each product need
// not wait for the one before: at 4 bits on PoCL, 1.04 to 1.08 times as fast as with one sum. x's values are read
// one at a time, which a CPU device broadcasts from memory: taken from a vector register instead, each costs a
// shuffle, and the 4-bit products ran 1.2 to 1.3 times as long (docs/BENCHMARKS.md).
// A 4-bit code c of each lane's word w as the float 1 + c / 16: c moved to the top of a float's fraction, under
// the exponent of 1.0, by a shift and a mask-and-or (one instruction on AVX-512) instead of masking, widening and
// converting: the 4-bit products take 0.9 of the time on PoCL. The sum of (1 + c / 16) x is x's block sum plus
// the sum of c x / 16, recovered by a subtraction that cancels: its rounding is a few float32 ulps of 16 times
// the block's sum of |x|, 1.5 to 3 times the direct sum's error (about 1e-7 of the sum of |w x|).
#define NIBBLE(w, j)                                                                                        \
    as_float16((((j) * 4 <= 19 ? (w) << (uint16)(19 - (j) * 4) : (w) >> (uint16)((j) * 4 - 19)) & 0x780000u) | \
               0x3F800000u)
#define NIBBLES_X(v)                                                                                        \
    {                                                                                                       \
        uint16 w = vload16(codes + (v), q);                                                                 \
        s0 += NIBBLE(w, 0) * xb[8 * (v)]; s1 += NIBBLE(w, 1) * xb[8 * (v) + 1];                             \
        s2 += NIBBLE(w, 2) * xb[8 * (v) + 2]; s3 += NIBBLE(w, 3) * xb[8 * (v) + 3];                         \
        s0 += NIBBLE(w, 4) * xb[8 * (v) + 4]; s1 += NIBBLE(w, 5) * xb[8 * (v) + 5];                         \
        s2 += NIBBLE(w, 6) * xb[8 * (v) + 6]; s3 += NIBBLE(w, 7) * xb[8 * (v) + 7];                         \
    }
#define EACH_WORD(STEP) STEP(0) STEP(1) STEP(2) STEP(3)
#define BYTES_X(e)                                                                                          \
    s0 += convert_float16(vload16(codes + (e), q)) * xb[e];                                                 \
    s1 += convert_float16(vload16(codes + (e) + 1, q)) * xb[(e) + 1];                                       \
    s2 += convert_float16(vload16(codes + (e) + 2, q)) * xb[(e) + 2];                                       \
    s3 += convert_float16(vload16(codes + (e) + 3, q)) * xb[(e) + 3];
#define EACH_FOURTH_BYTE(STEP) STEP(0) STEP(4) STEP(8) STEP(12) STEP(16) STEP(20) STEP(24) STEP(28)
// The loop over a group's blocks; `codes` in vectors of q, VECTORS a block, which EACH(STEP) covers. A work-item
// past the last group (whole work-groups round the count up) reads nothing.
#define FOR_LANE_BLOCKS(VECTORS, EACH, STEP)                                                                \
    if (LANE_ROW0 >= n)                                                                                     \
        return;                                                                                             \
    size_t first = get_global_id(0) * (size_t)(k / 32);                                                     \
    float16 acc = 0.0f;                                                                                     \
    for (int b = 0; b < k / 32; b++) {                                                                      \
        __global const float *xb = x + b * 32;                                                              \
        float16 s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;                                                 \
        size_t codes = (first + b) * VECTORS;                                                               \
        EACH(STEP)                                                                                          \
        float16 s = (s0 + s2) + (s1 + s3);                                                                  \
        LANE_BLOCK_END                                                                                      \
    }                                                                                                       \
    put_lanes(acc, y, bias, at, n);

// The 16 rows' sums, written as PUT writes a row's (the rows past n left alone).
void put_lanes(float16 acc, __global float *y, __global const float *bias, int at, int n) {
    float sums[16];
    vstore16(acc, 0, sums);
    size_t r0 = LANE_ROW0;
    for (int i = 0; i < 16 && r0 + i < n; i++) {
#ifdef GATE
        if (i % 2)
            y[at + (r0 + i) / 2] = GATE(sums[i - 1]) * sums[i];
#else
        y[at + r0 + i] = bias ? sums[i] + bias[r0 + i] : sums[i];
#endif
    }
}

// s is the sum of (1 + c / 16) x: the codes' sum with x is 16 (s - block_sum), the offset's (Q4_0's -8, Q4_1's m)
// the offset times block_sum, the sum of x's block.
#define BLOCK_SUM sum16(vload16(0, xb) + vload16(1, xb))
__kernel void matvec_q4_0_lanes(__global const float *d, __global const uint *q, __global const float *x,
                                __global float *y, __global const float *bias, int k, int at, int n) {
#define LANE_BLOCK_END                                                                                      \
    {                                                                                                       \
        float16 scale = vload16(first + b, d);                                                              \
        float block_sum = BLOCK_SUM;                                                                        \
        acc += scale * (16.0f * (s - block_sum)) - 8.0f * scale * block_sum;                                \
    }
    FOR_LANE_BLOCKS(4, EACH_WORD, NIBBLES_X)
#undef LANE_BLOCK_END
}

__kernel void matvec_q4_1_lanes(__global const float *d, __global const float *m, __global const uint *q,
                                __global const float *x, __global float *y, __global const float *bias, int k,
                                int at, int n) {
#define LANE_BLOCK_END                                                                                      \
    {                                                                                                       \
        float block_sum = BLOCK_SUM;                                                                        \
        acc += vload16(first + b, d) * (16.0f * (s - block_sum)) + vload16(first + b, m) * block_sum;      \
    }
    FOR_LANE_BLOCKS(4, EACH_WORD, NIBBLES_X)
#undef LANE_BLOCK_END
}

__kernel void matvec_q8_0_lanes(__global const float *d, __global const char *q, __global const float *x,
                                __global float *y, __global const float *bias, int k, int at, int n) {
#define LANE_BLOCK_END acc += vload16(first + b, d) * s;
    FOR_LANE_BLOCKS(32, EACH_FOURTH_BYTE, BYTES_X)
#undef LANE_BLOCK_END
}

// Q5_0: value = (q - 16) * d, q's low 4 bits packed as Q4_0's and its fifth bits in a 32-bit word a block
// (bit j for element j): q of 16 elements from `first` on, given their low 4 bits.
float16 q5_0_codes(float16 low, uint high, uint first) {
    const uint16 bits = (uint16)(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return low + 16.0f * convert_float16(((uint16)high >> (bits + first)) & 1u);
}

__kernel void matvec_q5_0(__global const SCALE_T *d, __global const uint *high, __global const uchar *q,
                          __global const float *x, __global float *y, __global const float *bias, int k, int at,
                          int n) {
    OUTPUTS
#define Q5_0_STEP(j) {                                                                                      \
        uchar16 c = vload16(f##j + b, q);                                                                   \
        uint h = high[f##j + b];                                                                            \
        float s = SCALE(d, f##j + b);                                                                       \
        a##j += s * DOT32(q5_0_codes(LOW(c), h, 0), q5_0_codes(HIGH(c), h, 16)); m##j -= 16.0f * s * block_sum; }
    FOR_ROWS(BLOCKS_START)
    FOR_BLOCKS(Q5_0_STEP)
    FOR_ROWS(BLOCKS_END)
}

// K-quants: super-blocks of 256 elements.
#define SUPER_START(j) size_t s##j = ROW(j) * (size_t)(k / 256); float16 a##j = 0.0f; float m##j = 0.0f;
#define SUPER_END(j) PUT(j, sum16(a##j) - m##j)

// Q4_K: eight blocks of 32, block i's value d * sc_i * q - dmin * m_i, sc_i and m_i 6-bit, packed in 12 bytes
// (gguf-py's Q4_K.get_scale_min); codes in 32-byte groups, the low nibbles one block, the high the next.
int2 q4_k_scale_min(__global const uchar *s, int i) {
    return i < 4 ? (int2)(s[i] & 63, s[i + 4] & 63)
                 : (int2)((s[i + 4] & 15) | ((s[i - 4] >> 6) << 4), (s[i + 4] >> 4) | ((s[i] >> 6) << 4));
}

__kernel void matvec_q4_k(__global const ushort *d, __global const ushort *dmin, __global const uchar *scales,
                          __global const uchar *q, __global const float *x, __global float *y,
                          __global const float *bias, int k, int at, int n) {
    OUTPUTS
#define Q4_K_STEP(j) {                                                                                      \
        __global const uchar *sc = scales + (s##j + b) * 12;                                                \
        float dd = half_bits(d[s##j + b]), dm = half_bits(dmin[s##j + b]);                                  \
        for (int g = 0; g < 4; g++) {                                                                       \
            int2 lo = q4_k_scale_min(sc, 2 * g), hi = q4_k_scale_min(sc, 2 * g + 1);                       \
            uchar16 c0 = vload16(0, q + (s##j + b) * 128 + g * 32), c1 = vload16(0, q + (s##j + b) * 128 + g * 32 + 16); \
            a##j += dd * lo.x * (LOW(c0) * xs[4 * g] + LOW(c1) * xs[4 * g + 1])                            \
                  + dd * hi.x * (HIGH(c0) * xs[4 * g + 2] + HIGH(c1) * xs[4 * g + 3]);                     \
            m##j += dm * (lo.y * sums[2 * g] + hi.y * sums[2 * g + 1]);                                     \
        } }
    FOR_ROWS(SUPER_START)
    for (int b = 0; b < k / 256; b++) {
        float16 xs[16];
        float sums[8];
        for (int i = 0; i < 16; i++)
            xs[i] = vload16(0, x + b * 256 + i * 16);
        for (int i = 0; i < 8; i++)
            sums[i] = sum16(xs[2 * i] + xs[2 * i + 1]);
        FOR_ROWS(Q4_K_STEP)
    }
    FOR_ROWS(SUPER_END)
}

// Q6_K: sixteen blocks of 16, value d * sc * (q - 32), sc signed 8-bit; q's low 4 bits in ql, high 2 in qh.
// Element 128h + 32s + i (h: half, s: quarter, i < 32): ql byte 64h + 32(s % 2) + i, its low nibble for
// s < 2 and high one after; qh byte 32h + i, bits 2s and 2s + 1.
float16 q6_k_codes(__global const uchar *ql, __global const uchar *qh, size_t sb, int h, int s, int i0) {
    uchar16 low = vload16(0, ql + sb * 128 + 64 * h + 32 * (s % 2) + i0);
    uchar16 top = vload16(0, qh + sb * 64 + 32 * h + i0);
    uchar16 nibble = s < 2 ? low & (uchar16)0xF : low >> (uchar16)4;
    return convert_float16(nibble | (((top >> (uchar16)(2 * s)) & (uchar16)3) << (uchar16)4)) - 32.0f;
}

__kernel void matvec_q6_k(__global const uchar *ql, __global const uchar *qh, __global const char *scales,
                          __global const ushort *d, __global const float *x, __global float *y,
                          __global const float *bias, int k, int at, int n) {
    OUTPUTS
#define Q6_K_STEP(j) {                                                                                      \
        size_t sb = s##j + b;                                                                               \
        float dd = half_bits(d[sb]);                                                                        \
        for (int h = 0; h < 2; h++)                                                                         \
            for (int s = 0; s < 4; s++)                                                                     \
                for (int i0 = 0; i0 < 32; i0 += 16) {                                                       \
                    float scale = dd * scales[sb * 16 + 8 * h + 2 * s + i0 / 16];                          \
                    a##j += scale * q6_k_codes(ql, qh, sb, h, s, i0) * xs[8 * h + 2 * s + i0 / 16];         \
                } }
#define Q6_K_START(j) size_t s##j = ROW(j) * (size_t)(k / 256); float16 a##j = 0.0f;
#define Q6_K_END(j) PUT(j, sum16(a##j))
    FOR_ROWS(Q6_K_START)
    for (int b = 0; b < k / 256; b++) {
        float16 xs[16];
        for (int i = 0; i < 16; i++)
            xs[i] = vload16(0, x + b * 256 + i * 16);
        FOR_ROWS(Q6_K_STEP)
    }
    FOR_ROWS(Q6_K_END)
}

// -- for a prompt: dequantize, then multiply in tiles ---------------------------------------------------------
// Each dequantize_<type> writes its block's (or super-block's) values at its place in W, (n, k) float32.

__kernel void dequantize_f16(__global const half *w, __global float *out) {
    out[get_global_id(0)] = vload_half(get_global_id(0), w);
}

__kernel void dequantize_q4_0(__global const SCALE_T *d, __global const uchar *q, __global float *out) {
    size_t b = get_global_id(0);
    uchar16 c = vload16(b, q);
    float scale = SCALE(d, b);
    vstore16((LOW(c) - 8.0f) * scale, 2 * b, out);
    vstore16((HIGH(c) - 8.0f) * scale, 2 * b + 1, out);
}

__kernel void dequantize_q4_1(__global const SCALE_T *d, __global const SCALE_T *m, __global const uchar *q,
                              __global float *out) {
    size_t b = get_global_id(0);
    uchar16 c = vload16(b, q);
    float scale = SCALE(d, b), least = SCALE(m, b);
    vstore16(LOW(c) * scale + least, 2 * b, out);
    vstore16(HIGH(c) * scale + least, 2 * b + 1, out);
}

__kernel void dequantize_q5_0(__global const SCALE_T *d, __global const uint *high, __global const uchar *q,
                              __global float *out) {
    size_t b = get_global_id(0);
    uchar16 c = vload16(b, q);
    float scale = SCALE(d, b);
    vstore16((q5_0_codes(LOW(c), high[b], 0) - 16.0f) * scale, 2 * b, out);
    vstore16((q5_0_codes(HIGH(c), high[b], 16) - 16.0f) * scale, 2 * b + 1, out);
}

__kernel void dequantize_q8_0(__global const SCALE_T *d, __global const char *q, __global float *out) {
    size_t b = get_global_id(0);
    float scale = SCALE(d, b);
    vstore16(convert_float16(vload16(2 * b, q)) * scale, 2 * b, out);
    vstore16(convert_float16(vload16(2 * b + 1, q)) * scale, 2 * b + 1, out);
}

// The lanes layout's blocks (above), a work-item a row's block (n * k / 32 of them, so a group's padding
// rows are never reached): row r of a group is lane r of each vector of codes and of the scales.
#define LANE_BLOCK(VECTORS)                                                                                 \
    size_t row = get_global_id(0) / (k / 32), b = get_global_id(0) % (k / 32), lane = row % 16;           \
    size_t block = (row / 16) * (k / 32) + b, codes = block * VECTORS * 16 + lane;                         \
    float scale = d[block * 16 + lane];                                                                     \
    __global float *w = out + row * k + b * 32;

// A 4-bit lanes block's element e: word e / 8's bits 4 (e % 8) to 4 (e % 8) + 3.
#define LANE_CODE(e) ((q[codes + 16 * ((e) / 8)] >> (4 * ((e) % 8))) & 15)

__kernel void dequantize_q4_0_lanes(__global const float *d, __global const uint *q, __global float *out, int k) {
    LANE_BLOCK(4)
    for (int e = 0; e < 32; e++)
        w[e] = ((int)LANE_CODE(e) - 8) * scale;
}

__kernel void dequantize_q4_1_lanes(__global const float *d, __global const float *m, __global const uint *q,
                                    __global float *out, int k) {
    LANE_BLOCK(4)
    float least = m[block * 16 + lane];
    for (int e = 0; e < 32; e++)
        w[e] = LANE_CODE(e) * scale + least;
}

__kernel void dequantize_q8_0_lanes(__global const float *d, __global const char *q, __global float *out, int k) {
    LANE_BLOCK(32)
    for (int p = 0; p < 32; p++)
        w[p] = q[codes + 16 * p] * scale;
}

__kernel void dequantize_q4_k(__global const ushort *d, __global const ushort *dmin, __global const uchar *scales,
                              __global const uchar *q, __global float *out) {
    size_t sb = get_global_id(0);
    float dd = half_bits(d[sb]), dm = half_bits(dmin[sb]);
    for (int g = 0; g < 4; g++) {
        int2 lo = q4_k_scale_min(scales + sb * 12, 2 * g), hi = q4_k_scale_min(scales + sb * 12, 2 * g + 1);
        for (int half16 = 0; half16 < 2; half16++) {
            uchar16 c = vload16(0, q + sb * 128 + g * 32 + half16 * 16);
            vstore16(dd * lo.x * LOW(c) - dm * lo.y, sb * 16 + 4 * g + half16, out);
            vstore16(dd * hi.x * HIGH(c) - dm * hi.y, sb * 16 + 4 * g + 2 + half16, out);
        }
    }
}

__kernel void dequantize_q6_k(__global const uchar *ql, __global const uchar *qh, __global const char *scales,
                              __global const ushort *d, __global float *out) {
    size_t sb = get_global_id(0);
    float dd = half_bits(d[sb]);
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int i0 = 0; i0 < 32; i0 += 16) {
                int block = 8 * h + 2 * s + i0 / 16;  // of 16 elements
                vstore16(dd * scales[sb * 16 + block] * q6_k_codes(ql, qh, sb, h, s, i0), sb * 16 + block, out);
            }
}

// Y[t][at + r] = dot(W[r], X[t]) (+ bias[r]) for n rows of W (n, k) and `tokens` rows of X: a work-item
// takes 4 rows and 4 tokens, 16 sums of 8 lanes, every row of W it loads serving 4 tokens.
__kernel void gemm(__global const float *w, __global const float *x, __global float *y, __global const float *bias,
                   int k, int n, int tokens, int ldx, int ldy, int at) {
    int r0 = get_global_id(0) * 4, t0 = get_global_id(1) * 4;
#define W_ROW(j) __global const float *w##j = w + (size_t)min(r0 + j, n - 1) * k;
#define X_ROW(j) __global const float *x##j = x + (size_t)min(t0 + j, tokens - 1) * ldx;
    W_ROW(0) W_ROW(1) W_ROW(2) W_ROW(3)
    X_ROW(0) X_ROW(1) X_ROW(2) X_ROW(3)
#define SUMS(r) float8 s##r##0 = 0.0f, s##r##1 = 0.0f, s##r##2 = 0.0f, s##r##3 = 0.0f;
    SUMS(0) SUMS(1) SUMS(2) SUMS(3)
    int i = 0;
    for (; i + 8 <= k; i += 8) {
        float8 u0 = vload8(0, x0 + i), u1 = vload8(0, x1 + i), u2 = vload8(0, x2 + i), u3 = vload8(0, x3 + i);
#define ROW_TIMES_TOKENS(r) { float8 v = vload8(0, w##r + i); s##r##0 += v * u0; s##r##1 += v * u1; s##r##2 += v * u2; s##r##3 += v * u3; }
        ROW_TIMES_TOKENS(0) ROW_TIMES_TOKENS(1) ROW_TIMES_TOKENS(2) ROW_TIMES_TOKENS(3)
    }
#define TOTAL(r, t) float total##r##t = sum8(s##r##t); for (int e = i; e < k; e++) total##r##t += w##r[e] * x##t[e];
#define TOTALS(r) TOTAL(r, 0) TOTAL(r, 1) TOTAL(r, 2) TOTAL(r, 3)
    TOTALS(0) TOTALS(1) TOTALS(2) TOTALS(3)
#ifdef GATE  // rows interleaved gate, up (as the matrix-vector kernels take them): a pair is one value at row / 2
#define OUT(g, u, t) if (r0 + u < n && t0 + t < tokens) y[(size_t)(t0 + t) * ldy + at + (r0 + g) / 2] = GATE(total##g##t) * total##u##t;
#define OUT_PAIR(g, u) OUT(g, u, 0) OUT(g, u, 1) OUT(g, u, 2) OUT(g, u, 3)
    OUT_PAIR(0, 1) OUT_PAIR(2, 3)
#else
#define OUT(r, t) if (r0 + r < n && t0 + t < tokens) y[(size_t)(t0 + t) * ldy + at + r0 + r] = bias ? total##r##t + bias[r0 + r] : total##r##t;
#define OUT_ROW(r) OUT(r, 0) OUT(r, 1) OUT(r, 2) OUT(r, 3)
    OUT_ROW(0) OUT_ROW(1) OUT_ROW(2) OUT_ROW(3)
#endif
}

// Each token's gate_up = [gate | up], n_ff each: gate = act(gate) * up in place, where the gate and up matrices
// are of different types and so run as products of their own.
__kernel void silu_gate(__global float *gate_up, int n_ff) {
    size_t i = (size_t)get_global_id(1) * 2 * n_ff + get_global_id(0);
    gate_up[i] = silu(gate_up[i]) * gate_up[i + n_ff];
}

__kernel void gelu_gate(__global float *gate_up, int n_ff) {
    size_t i = (size_t)get_global_id(1) * 2 * n_ff + get_global_id(0);
    gate_up[i] = gelu(gate_up[i]) * gate_up[i + n_ff];
}
