// Matrix-vector products for decode, on the GGUF's own blocks: y[at + r] = dot(W[r], x) (+ bias[r]), `at`
// placing the rows in a buffer several products share (Q, K and V of mixed types, say).
//
// OpenCL C 1.2 core only. One work-item per row, streaming its blocks with vector loads: on a CPU
// device (PoCL) that reaches 18-32 GB/s where a work-group per row with a local reduction gets
// about 3. The quantized types come in the "flat" layout, each block's scale (and minimum) in one
// buffer and its codes in another, so every load is aligned and as wide as the codes.
//   Q4_0: value = (q - 8) * d, 32 codes of 4 bits a block; GGUF packs element j with element j + 16
//   Q4_1: value = q * d + m
//   Q8_0: value = q * d, q signed
// Scales are halves, read with vload_half: no fp16 extension is needed.

float sum16(float16 v) {
    float8 a = v.lo + v.hi;
    float4 b = a.lo + a.hi;
    return b.x + b.y + b.z + b.w;
}

float sum8(float8 v) {
    float4 b = v.lo + v.hi;
    return b.x + b.y + b.z + b.w;
}

void put(__global float *y, int at, int r, float value, __global const float *bias) {
    y[at + r] = bias ? value + bias[r] : value;
}

__kernel void matvec_f32(__global const float *w, __global const float *x, __global float *y,
                         __global const float *bias, int k, int at) {
    int r = get_global_id(0);
    __global const float *row = w + (size_t)r * k;
    float8 acc = 0.0f;
    int i = 0;
    for (; i + 8 <= k; i += 8)
        acc += vload8(0, row + i) * vload8(0, x + i);
    float total = sum8(acc);
    for (; i < k; i++)
        total += row[i] * x[i];
    put(y, at, r, total, bias);
}

__kernel void matvec_f16(__global const half *w, __global const float *x, __global float *y,
                         __global const float *bias, int k, int at) {
    int r = get_global_id(0);
    size_t start = (size_t)r * k;
    float8 acc = 0.0f;
    int i = 0;
    for (; i + 8 <= k; i += 8)
        acc += vload_half8(0, w + start + i) * vload8(0, x + i);
    float total = sum8(acc);
    for (; i < k; i++)
        total += vload_half(start + i, w) * x[i];
    put(y, at, r, total, bias);
}

__kernel void matvec_q4_0(__global const half *d, __global const uchar *q, __global const float *x,
                          __global float *y, __global const float *bias, int k, int at) {
    int r = get_global_id(0);
    int blocks = k / 32;
    size_t first = (size_t)r * blocks;
    float total = 0.0f;
    for (int b = 0; b < blocks; b++) {
        uchar16 codes = vload16(first + b, q);
        float16 low = convert_float16(codes & (uchar16)0xF) - 8.0f;
        float16 high = convert_float16(codes >> (uchar16)4) - 8.0f;
        float16 products = low * vload16(0, x + b * 32) + high * vload16(0, x + b * 32 + 16);
        total += vload_half(first + b, d) * sum16(products);
    }
    put(y, at, r, total, bias);
}

__kernel void matvec_q4_1(__global const half *d, __global const half *m, __global const uchar *q,
                          __global const float *x, __global float *y, __global const float *bias, int k, int at) {
    int r = get_global_id(0);
    int blocks = k / 32;
    size_t first = (size_t)r * blocks;
    float total = 0.0f;
    for (int b = 0; b < blocks; b++) {
        uchar16 codes = vload16(first + b, q);
        float16 xl = vload16(0, x + b * 32), xh = vload16(0, x + b * 32 + 16);
        float16 products = convert_float16(codes & (uchar16)0xF) * xl + convert_float16(codes >> (uchar16)4) * xh;
        total += vload_half(first + b, d) * sum16(products) + vload_half(first + b, m) * sum16(xl + xh);
    }
    put(y, at, r, total, bias);
}

__kernel void matvec_q8_0(__global const half *d, __global const char *q, __global const float *x,
                          __global float *y, __global const float *bias, int k, int at) {
    int r = get_global_id(0);
    int blocks = k / 32;
    size_t first = (size_t)r * blocks;
    float total = 0.0f;
    for (int b = 0; b < blocks; b++) {
        float16 products = convert_float16(vload16(2 * (first + b), q)) * vload16(0, x + b * 32)
                         + convert_float16(vload16(2 * (first + b) + 1, q)) * vload16(0, x + b * 32 + 16);
        total += vload_half(first + b, d) * sum16(products);
    }
    put(y, at, r, total, bias);
}
