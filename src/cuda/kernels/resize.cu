// gpufeed's kernels for the GPU decode (src/cuda/nvjpeg/): the crop, the antialiased bilinear
// resize, the horizontal flip, the normalisation and the cast of each decoded image into its
// place in the device batch.
//
// The resize is PIL's (ImagingResample with the bilinear filter), which torchvision uses on PIL
// images and which the CPU path's resizer (fast_image_resize) reproduces: for an output index i
// over a source range [in0, in0 + len) of an axis of `size` pixels resized to `out` pixels,
//
//   scale   = len / out,   filterscale = max(scale, 1),   support = filterscale
//   center  = in0 + (i + 0.5) * scale
//   first   = max(int(center - support + 0.5), 0),  end = min(int(center + support + 0.5), size)
//   w[j]    = tri((first + j - center + 0.5) / filterscale),  tri(t) = max(1 - |t|, 0)
//
// normalised to sum 1. The support grows with the downscale factor: that is the antialiasing.
// As PIL does, the horizontal pass runs first, over the source rows the vertical pass reads,
// and its result is rounded to 8 bits; the vertical pass rounds again, and only then is the
// value normalised (v / 255 - mean) / std and cast, as the CPU path does after its resize.
//
// Regenerate resize.ptx with build-ptx.sh (beside this file); the Rust side, which fills the
// ResizeSample descriptors and launches both kernels, is src/cuda/nvjpeg/resize.rs.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// One sample of a batch, as the host describes it (80 bytes; the same layout as
// `ResizeSample` in resize.rs).
struct ResizeSample {
    u64 src;       // the decoded image: RGB8 interleaved, rows `pitch` bytes apart
    u64 tmp;       // the horizontal pass's rows: `rows` rows of out_w * 3 bytes
    double left;   // the crop, in the decoded image's pixels
    double top;
    double width;
    double height;
    u32 pitch;
    u32 src_w;     // the decoded image's size (a region of the JPEG when decoded with an ROI)
    u32 src_h;
    u32 row0;      // the first source row the horizontal pass resamples
    u32 rows;      // how many
    u32 flip;      // mirror left to right
    u32 kind;      // 0: resize `src`; 1: a skipped sample, written as zeros
    u32 pad;
};

// The taps of output index `i` (see the top of the file): the first source index, their
// number, and what the weight of tap j is computed from, tri((base + j) * ss) * norm. The
// weights are computed again where they are used rather than kept in an array (which would
// live in local memory).
struct Taps {
    int first;
    int n;
    float base;
    float ss;
    float norm;
};

__device__ __forceinline__ float tri(float t) {
    t = fabsf(t);
    return t < 1.0f ? 1.0f - t : 0.0f;
}

__device__ __forceinline__ Taps taps(double in0, double len, int size, int out, int i) {
    double scale = len / (double)out;
    double filterscale = scale < 1.0 ? 1.0 : scale;
    double support = filterscale;
    double center = in0 + ((double)i + 0.5) * scale;
    int lo = (int)(center - support + 0.5);
    int hi = (int)(center + support + 0.5);
    if (lo < 0) lo = 0;
    if (hi > size) hi = size;
    Taps t;
    t.first = lo;
    t.n = hi > lo ? hi - lo : 0;
    t.base = (float)((double)lo - center + 0.5);
    t.ss = (float)(1.0 / filterscale);
    float sum = 0.0f;
    for (int j = 0; j < t.n; ++j) sum += tri((t.base + (float)j) * t.ss);
    t.norm = sum != 0.0f ? 1.0f / sum : 0.0f;
    return t;
}

__device__ __forceinline__ u8 round_u8(float v) {
    v = floorf(v + 0.5f);
    v = v < 0.0f ? 0.0f : (v > 255.0f ? 255.0f : v);
    return (u8)v;
}

// The horizontal pass: for sample blockIdx.y, every (row, column) of its `rows` x out_w
// resampled rows, the three channels, rounded to 8 bits into `tmp`.
extern "C" __global__ void gpufeed_resize_rows(const ResizeSample* samples, u32 out_w) {
    const ResizeSample s = samples[blockIdx.y];
    if (s.kind != 0) return;
    const u32 total = s.rows * out_w;
    const u8* src = (const u8*)s.src;
    u8* tmp = (u8*)s.tmp;
    for (u32 k = blockIdx.x * blockDim.x + threadIdx.x; k < total; k += gridDim.x * blockDim.x) {
        u32 r = k / out_w;
        u32 x = k - r * out_w;
        Taps t = taps(s.left, s.width, (int)s.src_w, (int)out_w, (int)x);
        u32 row = s.row0 + r;
        if (row >= s.src_h) row = s.src_h - 1;
        const u8* line = src + (u64)row * s.pitch + (u64)t.first * 3;
        float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f;
        for (int j = 0; j < t.n; ++j) {
            float w = tri((t.base + (float)j) * t.ss) * t.norm;
            a0 += w * (float)line[3 * j];
            a1 += w * (float)line[3 * j + 1];
            a2 += w * (float)line[3 * j + 2];
        }
        u8* o = tmp + ((u64)r * out_w + x) * 3;
        o[0] = round_u8(a0);
        o[1] = round_u8(a1);
        o[2] = round_u8(a2);
    }
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Round to nearest even, as half::bf16::from_f32 does; NaN stays a quiet NaN.
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

// The vertical pass and the write: for sample blockIdx.y, every output pixel (y, x): the taps
// of `tmp`, rounded to 8 bits, mirrored if the sample is flipped, then cast to `dtype`
// (0 f32, 1 f16, 2 bf16: v * a[c] + b[c]; 3 u8: v) at dst + sample * sample_bytes, in CHW
// (`chw` = 1) or HWC order. Skipped samples are written as zeros.
extern "C" __global__ void gpufeed_resize_cols(const ResizeSample* samples, u64 dst,
                                               u64 sample_bytes, u32 out_h, u32 out_w, u32 dtype,
                                               u32 chw, float a0, float a1, float a2, float b0,
                                               float b1, float b2) {
    const ResizeSample s = samples[blockIdx.y];
    const u32 total = out_h * out_w;
    u8* base = (u8*)(dst + (u64)blockIdx.y * sample_bytes);
    const u32 esize = dtype == 0 ? 4 : (dtype == 3 ? 1 : 2);
    const u8* tmp = (const u8*)s.tmp;
    for (u32 k = blockIdx.x * blockDim.x + threadIdx.x; k < total; k += gridDim.x * blockDim.x) {
        u32 y = k / out_w;
        u32 x = k - y * out_w;
        float v[3] = {0.0f, 0.0f, 0.0f};
        if (s.kind == 0) {
            Taps t = taps(s.top, s.height, (int)s.src_h, (int)out_h, (int)y);
            float acc[3] = {0.0f, 0.0f, 0.0f};
            for (int j = 0; j < t.n; ++j) {
                float w = tri((t.base + (float)j) * t.ss) * t.norm;
                int r = t.first + j - (int)s.row0;
                if (r < 0) r = 0;
                if (r >= (int)s.rows) r = (int)s.rows - 1;
                const u8* p = tmp + ((u64)r * out_w + x) * 3;
                acc[0] += w * (float)p[0];
                acc[1] += w * (float)p[1];
                acc[2] += w * (float)p[2];
            }
            v[0] = (float)round_u8(acc[0]);
            v[1] = (float)round_u8(acc[1]);
            v[2] = (float)round_u8(acc[2]);
        }
        u32 xo = s.flip ? out_w - 1 - x : x;
        const float a[3] = {a0, a1, a2};
        const float b[3] = {b0, b1, b2};
        for (u32 c = 0; c < 3; ++c) {
            u64 at = chw ? ((u64)c * out_h + y) * out_w + xo : ((u64)y * out_w + xo) * 3 + c;
            u8* o = base + at * esize;
            if (s.kind != 0) {
                for (u32 e = 0; e < esize; ++e) o[e] = 0;
                continue;
            }
            float f = v[c] * a[c] + b[c];
            switch (dtype) {
                case 0: *(float*)o = f; break;
                case 1: *(u16*)o = f32_to_f16(f); break;
                case 2: *(u16*)o = f32_to_bf16(f); break;
                default: *o = (u8)v[c]; break;
            }
        }
    }
}
