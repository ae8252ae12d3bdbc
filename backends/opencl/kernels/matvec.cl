// Matrix-vector products for decode, on the GGUF's own blocks: y[at + r] = dot(W[r], x) (+ bias[r]) for the
// n rows of W, `at` placing them in a buffer several products share (Q, K and V of mixed types, say).
//
// OpenCL C 1.2 core only. Each work-item takes ROWS rows, so that every block of x it loads serves ROWS rows,
// and keeps each row's sum in a vector reduced once at the end. Measured on PoCL (2 cores, Q4_1 4096x4096):
// one row a work-item reducing every block 4.8 GB/s, a vector sum 6.3, four rows 9.5. The quantized types
// come in the "flat" layout, each block's scale (and minimum) in one buffer and its codes in another, so
// every load is aligned and as wide as the codes:
//   Q4_0: value = (q - 8) * d, 32 codes of 4 bits a block; GGUF packs element j with element j + 16
//   Q4_1: value = q * d + m
//   Q8_0: value = q * d, q signed
// Scales are halves, read with vload_half: no fp16 extension is needed.

#define ROWS 4

float sum16(float16 v) {
    float8 a = v.lo + v.hi;
    float4 b = a.lo + a.hi;
    return b.x + b.y + b.z + b.w;
}

float sum8(float8 v) {
    float4 b = v.lo + v.hi;
    return b.x + b.y + b.z + b.w;
}

// Row j of this work-item's ROWS, as an index; past the last row it repeats the last row, whose
// result is then not written.
#define ROW(j) min(get_global_id(0) * ROWS + (j), (size_t)n - 1)
#define FOR_ROWS(STEP) STEP(0) STEP(1) STEP(2) STEP(3)
#define PUT(j, value)                                                                                       \
    if (get_global_id(0) * ROWS + (j) < n)                                                                  \
        y[at + ROW(j)] = bias ? (value) + bias[ROW(j)] : (value);

// 4-bit codes of one block as floats: elements 0-15 (low nibbles) and 16-31 (high nibbles).
#define LOW(codes) convert_float16((codes) & (uchar16)0xF)
#define HIGH(codes) convert_float16((codes) >> (uchar16)4)

__kernel void matvec_f32(__global const float *w, __global const float *x, __global float *y,
                         __global const float *bias, int k, int at, int n) {
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

#define BLOCKS_START(j) size_t f##j = ROW(j) * (size_t)(k / 32); float16 a##j = 0.0f;

__kernel void matvec_q4_0(__global const half *d, __global const uchar *q, __global const float *x,
                          __global float *y, __global const float *bias, int k, int at, int n) {
#define Q4_0_STEP(j) { uchar16 c = vload16(f##j + b, q); a##j += vload_half(f##j + b, d) * ((LOW(c) - 8.0f) * xl + (HIGH(c) - 8.0f) * xh); }
#define Q4_0_END(j) PUT(j, sum16(a##j))
    FOR_ROWS(BLOCKS_START)
    for (int b = 0; b < k / 32; b++) {
        float16 xl = vload16(0, x + b * 32), xh = vload16(0, x + b * 32 + 16);
        FOR_ROWS(Q4_0_STEP)
    }
    FOR_ROWS(Q4_0_END)
}

__kernel void matvec_q4_1(__global const half *d, __global const half *m, __global const uchar *q,
                          __global const float *x, __global float *y, __global const float *bias, int k, int at,
                          int n) {
#define Q4_1_START(j) BLOCKS_START(j) float m##j = 0.0f;
#define Q4_1_STEP(j) { uchar16 c = vload16(f##j + b, q); a##j += vload_half(f##j + b, d) * (LOW(c) * xl + HIGH(c) * xh); m##j += vload_half(f##j + b, m) * block_sum; }
#define Q4_1_END(j) PUT(j, sum16(a##j) + m##j)
    FOR_ROWS(Q4_1_START)
    for (int b = 0; b < k / 32; b++) {
        float16 xl = vload16(0, x + b * 32), xh = vload16(0, x + b * 32 + 16);
        float block_sum = sum16(xl + xh);
        FOR_ROWS(Q4_1_STEP)
    }
    FOR_ROWS(Q4_1_END)
}

__kernel void matvec_q8_0(__global const half *d, __global const char *q, __global const float *x,
                          __global float *y, __global const float *bias, int k, int at, int n) {
#define Q8_0_STEP(j) a##j += vload_half(f##j + b, d) * (convert_float16(vload16(2 * (f##j + b), q)) * xl + convert_float16(vload16(2 * (f##j + b) + 1, q)) * xh);
#define Q8_0_END(j) PUT(j, sum16(a##j))
    FOR_ROWS(BLOCKS_START)
    for (int b = 0; b < k / 32; b++) {
        float16 xl = vload16(0, x + b * 32), xh = vload16(0, x + b * 32 + 16);
        FOR_ROWS(Q8_0_STEP)
    }
    FOR_ROWS(Q8_0_END)
}
