// Fused predicted update: one pass over a flat fp32 master partition.
//
// Reference: ds_hybrid.kernels.fused_update_reference (the arithmetic of
// zero_access.adam_direction + apply_predicted_update for one partition):
//
//   snapshot = master                                   (optional: rollback point)
//   d        = (m / bc1) / (sqrt(v / bc2) + eps)        (bias-corrected Adam direction)
//   u        = step * d + decay * master                (step = -scale*lr, decay = -lr*wd or 0)
//   master   = master + u
//   lp       = bf16(master) or fp16(master)              (optional: the model's copy)
//   sq      += u * u                                     (optional: squared update norm, fp64)
//
// The operations and their order are those of the torch reference, in fp32, so the
// masters agree to rounding (the reference's fp32 ops may be fused differently).
// Memory traffic per element: 12 bytes read (master, m, v), 4 written (master), plus
// 2 (lp) and 4 (snapshot) when asked for. Nothing else touches memory, so the kernel
// runs at the memory bandwidth: a grid-stride loop over 4-element vectors (16-byte
// loads) when every pointer is aligned, scalar otherwise.
//
// No headers: NVRTC (CuPy's compiler) and nvcc both accept this file as it is, and
// tests/cuda_emu runs it on the CPU (DSH_EMULATE) against the reference.
// Low-precision copies are written as raw 16-bit patterns (unsigned short).

#define DSH_FULL_MASK 0xffffffffu

// fp32 -> bf16, round to nearest even; NaN -> 0x7fc0 (torch's c10::BFloat16 rule).
__device__ __forceinline__ unsigned short dsh_f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)0x7fc0u;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

// fp32 -> fp16, IEEE round to nearest even (the hardware conversion; torch's rule too).
__device__ __forceinline__ unsigned short dsh_f32_to_f16(float f) {
    unsigned short h;
#ifdef DSH_EMULATE   // tests/cuda_emu: the host compiler's IEEE conversion
    const _Float16 v = (_Float16)f;
    __builtin_memcpy(&h, &v, 2);
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
#endif
    return h;
}

// LP: 0 = no low-precision copy, 1 = bf16, 2 = fp16.
template <int LP>
__device__ __forceinline__ unsigned short dsh_to_lp(float f) {
    return LP == 1 ? dsh_f32_to_bf16(f) : dsh_f32_to_f16(f);
}

// The update u of one element whose master is x (the new master is __fadd_rn(x, u)).
// The roundings are pinned (NVRTC contracts a multiply and an add into one fma by default, and
// which one it picks is the compiler's choice): the product rounded, the decay one fma as torch's
// add with alpha, the sum rounded: host_fold.cpp's held_adam (-ffp-contract=off) bit for bit.
__device__ __forceinline__ float dsh_update_of(float x, float m, float v, float step,
                                               float bc1, float bc2, float eps, float decay) {
    const float denom = sqrtf(v / bc2) + eps;
    const float d = (m / bc1) / denom;
    float u = __fmul_rn(d, step);
    if (decay != 0.0f) u = __fmaf_rn(x, decay, u);   // AdamW's decoupled decay (0: none; an inf master stays inf)
    return u;
}

// Block-wide sum of per-thread fp64 partials, then one atomicAdd per block.
__device__ __forceinline__ void dsh_block_sum_atomic(double val, double* out) {
    __shared__ double warp_sums[32];
    for (int off = 16; off > 0; off >>= 1) val += __shfl_xor_sync(DSH_FULL_MASK, val, off);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) warp_sums[warp] = val;
    __syncthreads();
    if (warp == 0) {
        const int nwarps = (blockDim.x + 31) >> 5;
        val = lane < nwarps ? warp_sums[lane] : 0.0;
        for (int off = 16; off > 0; off >>= 1) val += __shfl_xor_sync(DSH_FULL_MASK, val, off);
        if (lane == 0) atomicAdd(out, val);   // fp64 atomicAdd: sm_60 and later
    }
}

// master, exp_avg, exp_avg_sq: n fp32 values. lp: n 16-bit values (LP != 0).
// snapshot: n fp32 values (SNAP). sq: one fp64 accumulator (SQ), zeroed by the caller.
// VEC: every pointer 16-byte aligned (lp: 8-byte), processed in float4 vectors; the
// n % 4 tail is done by the first threads of the grid.
template <int LP, bool SNAP, bool SQ, bool VEC>
__global__ void
fused_predicted_update(float* __restrict__ master, const float* __restrict__ exp_avg,
                       const float* __restrict__ exp_avg_sq, unsigned short* __restrict__ lp,
                       float* __restrict__ snapshot, double* __restrict__ sq, long long n,
                       float step, float bc1, float bc2, float eps, float decay) {
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    double acc = 0.0;
    if (VEC) {
        const long long nvec = n >> 2;
        float4* mv = reinterpret_cast<float4*>(master);
        const float4* av = reinterpret_cast<const float4*>(exp_avg);
        const float4* sv = reinterpret_cast<const float4*>(exp_avg_sq);
        for (long long i = tid; i < nvec; i += stride) {
            float4 x = mv[i];
            const float4 m = __ldg(av + i);
            const float4 v = __ldg(sv + i);
            if (SNAP) reinterpret_cast<float4*>(snapshot)[i] = x;
            const float u0 = dsh_update_of(x.x, m.x, v.x, step, bc1, bc2, eps, decay);
            const float u1 = dsh_update_of(x.y, m.y, v.y, step, bc1, bc2, eps, decay);
            const float u2 = dsh_update_of(x.z, m.z, v.z, step, bc1, bc2, eps, decay);
            const float u3 = dsh_update_of(x.w, m.w, v.w, step, bc1, bc2, eps, decay);
            x.x = x.x + u0; x.y = x.y + u1; x.z = x.z + u2; x.w = x.w + u3;
            mv[i] = x;
            if (LP != 0) {
                ushort4 h;
                h.x = dsh_to_lp<LP>(x.x); h.y = dsh_to_lp<LP>(x.y);
                h.z = dsh_to_lp<LP>(x.z); h.w = dsh_to_lp<LP>(x.w);
                reinterpret_cast<ushort4*>(lp)[i] = h;
            }
            if (SQ) acc += (double)u0 * u0 + (double)u1 * u1 + (double)u2 * u2 + (double)u3 * u3;
        }
        for (long long i = (nvec << 2) + tid; i < n; i += stride) {   // tail: n % 4 elements
            float x = master[i];
            if (SNAP) snapshot[i] = x;
            const float u = dsh_update_of(x, exp_avg[i], exp_avg_sq[i], step, bc1, bc2, eps, decay);
            x = x + u;
            master[i] = x;
            if (LP != 0) lp[i] = dsh_to_lp<LP>(x);
            if (SQ) acc += (double)u * u;
        }
    } else {
        for (long long i = tid; i < n; i += stride) {
            float x = master[i];
            if (SNAP) snapshot[i] = x;
            const float u = dsh_update_of(x, __ldg(exp_avg + i), __ldg(exp_avg_sq + i),
                                          step, bc1, bc2, eps, decay);
            x = x + u;
            master[i] = x;
            if (LP != 0) lp[i] = dsh_to_lp<LP>(x);
            if (SQ) acc += (double)u * u;
        }
    }
    if (SQ) dsh_block_sum_atomic(acc, sq);
}

// ---------------------------------------------------------------------------------------
// Drift shift: a drift Predict step on the device path (memory.offload_predict: device) into
// a 16-bit (or fp32) partition on the GPU, from the GPU's copy of the velocity:
//
//   x = round_X(float(x) + c * v),   v = float(q) * scale[i / 256] (int8) | float(v16) | v32
//
// Reference: ds_hybrid.kernels.drift_shift_reference (DevicePredict's torch ops: a chunk of
// the velocity dequantised into fp32, the 16-bit chunk widened, add_ with alpha, copied back,
// four kernels and some 29 bytes per element). Here 5 bytes per element with a bf16 partition
// and an int8 velocity (x read and written, the velocity read, a scale per 256 values). The
// add is a fused multiply-add, as torch's CUDA add with alpha (a + alpha * b, contracted by
// nvcc); a 16-bit x is rounded to nearest even, as its copy back.
// X: 0 = fp32, 1 = bf16, 2 = fp16 partition. VD: 0 = fp32, 1 = bf16, 2 = int8 velocity.
// VEC: x and v aligned to 4 of their elements, processed 4 at a time (one int8 scale block
// is 256 values, so the 4 share a scale); the n % 4 tail by the first threads of the grid.

__device__ __forceinline__ float dsh_bf16_to_f32(unsigned short h) {
    return __uint_as_float(((unsigned int)h) << 16);
}

__device__ __forceinline__ float dsh_f16_to_f32(unsigned short h) {
#ifdef DSH_EMULATE
    _Float16 v;
    __builtin_memcpy(&v, &h, 2);
    return (float)v;
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#endif
}

template <int VD>
__device__ __forceinline__ float dsh_velocity(const void* v, const float* scale, long long i) {
    if (VD == 0) return static_cast<const float*>(v)[i];
    if (VD == 1) return dsh_bf16_to_f32(static_cast<const unsigned short*>(v)[i]);
    return (float)static_cast<const signed char*>(v)[i] * __ldg(scale + (i >> 8));
}

template <int X>
__device__ __forceinline__ unsigned short dsh_shift16(unsigned short h, float v, float c) {
    const float w = X == 1 ? dsh_bf16_to_f32(h) : dsh_f16_to_f32(h);
    return dsh_to_lp<X>(fmaf(v, c, w));
}

template <int X, int VD>
__device__ __forceinline__ void dsh_shift_one(void* x, const void* v, const float* scale, long long i, float c) {
    const float vi = dsh_velocity<VD>(v, scale, i);
    if (X == 0) {
        float* xf = static_cast<float*>(x);
        xf[i] = fmaf(vi, c, xf[i]);
    } else {
        unsigned short* xh = static_cast<unsigned short*>(x);
        xh[i] = dsh_shift16<X>(xh[i], vi, c);
    }
}

template <int X, int VD, bool VEC>
__global__ void
drift_shift(void* __restrict__ x, const void* __restrict__ v, const float* __restrict__ scale, long long n,
            float c) {
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long done = 0;
    if (VEC) {
        const long long nvec = n >> 2;
        for (long long k = tid; k < nvec; k += stride) {
            float vv[4];
            if (VD == 0) {
                const float4 t = reinterpret_cast<const float4*>(v)[k];
                vv[0] = t.x; vv[1] = t.y; vv[2] = t.z; vv[3] = t.w;
            } else if (VD == 1) {
                const ushort4 t = reinterpret_cast<const ushort4*>(v)[k];
                vv[0] = dsh_bf16_to_f32(t.x); vv[1] = dsh_bf16_to_f32(t.y);
                vv[2] = dsh_bf16_to_f32(t.z); vv[3] = dsh_bf16_to_f32(t.w);
            } else {
                const char4 t = reinterpret_cast<const char4*>(v)[k];
                const float s = __ldg(scale + (k >> 6));   // (4k) / 256
                vv[0] = (float)t.x * s; vv[1] = (float)t.y * s; vv[2] = (float)t.z * s; vv[3] = (float)t.w * s;
            }
            if (X == 0) {
                float4 w = reinterpret_cast<float4*>(x)[k];
                w.x = fmaf(vv[0], c, w.x); w.y = fmaf(vv[1], c, w.y);
                w.z = fmaf(vv[2], c, w.z); w.w = fmaf(vv[3], c, w.w);
                reinterpret_cast<float4*>(x)[k] = w;
            } else {
                ushort4 h = reinterpret_cast<ushort4*>(x)[k];
                h.x = dsh_shift16<X>(h.x, vv[0], c); h.y = dsh_shift16<X>(h.y, vv[1], c);
                h.z = dsh_shift16<X>(h.z, vv[2], c); h.w = dsh_shift16<X>(h.w, vv[3], c);
                reinterpret_cast<ushort4*>(x)[k] = h;
            }
        }
        done = nvec << 2;
    }
    for (long long i = done + tid; i < n; i += stride) dsh_shift_one<X, VD>(x, v, scale, i, c);
}

// ---------------------------------------------------------------------------------------
// Held Adam step: a Predict step that took its own gradient (hybrid_predict.predictor.direction:
// gradient) on the device path, into a bf16 (or fp32) partition on the GPU, from the run's first
// moment m (which already holds the step's gradient) and the second moment v held from the last
// real step:
//
//   w = float(x) + u,   u = (m / bc1) / (sqrt(v / bc2) + eps) * step + decay * float(x)
//   x = w (fp32) | the bf16 of w rounded stochastically: the top 16 bits of bits(w) + r,
//                  r = 16 random bits, a hash of (key, i)
//
// Reference: ds_hybrid.kernels.held_adam_step_reference (the same fp32 operations, the same
// random bits: quant.sr_bits). An Adam step is often under half a bf16 step of the weight it
// moves; round to nearest would drop it, stochastic rounding keeps it on average. The random bits
// are a function of (key, i) alone, so a rerun and a resume draw the same ones. X: 0 = fp32,
// 1 = bf16 partition. S: 0 = fp32, 1 = bf16 m and v. Bytes per element with bf16 x, m and v: 8
// (the torch ops it replaces move about 100). One element a thread, grid-stride.

__device__ __forceinline__ unsigned int dsh_mix32(unsigned int x) {   // "lowbias32" (C. Wellons)
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

__device__ __forceinline__ unsigned int dsh_sr_bits(unsigned int key, long long i) {
    const unsigned long long u = (unsigned long long)i;
    return dsh_mix32((unsigned int)u ^ dsh_mix32((unsigned int)(u >> 32) ^ key)) & 0xffffu;
}

template <int D>
__device__ __forceinline__ float dsh_load(const void* p, long long i) {
    return D == 0 ? static_cast<const float*>(p)[i] : dsh_bf16_to_f32(static_cast<const unsigned short*>(p)[i]);
}

template <int X, int S>
__global__ void
held_adam_step(void* __restrict__ x, const void* __restrict__ m, const void* __restrict__ v, long long n,
               float step, float bc1, float bc2, float eps, float decay, unsigned int key) {
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = tid; i < n; i += stride) {
        const float xf = dsh_load<X>(x, i);
        const float w = __fadd_rn(xf, dsh_update_of(xf, dsh_load<S>(m, i), dsh_load<S>(v, i), step, bc1, bc2, eps, decay));
        if (X == 0) {
            static_cast<float*>(x)[i] = w;
        } else {   // (a carry rounds the magnitude up; uint32 wrap-around as the reference's int32)
            static_cast<unsigned short*>(x)[i] = (unsigned short)((__float_as_uint(w) + dsh_sr_bits(key, i)) >> 16);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Shard fold: a real step's fold into the drift velocity from the 16-bit shards
// (hybrid_predict.memory.fold_source: weights16, ds_hybrid/shard_fold.py), on the GPU in one pass:
//
//   d    = float(after) - float(before)            (the step's update: lr times its direction)
//   sums += (d * v, v * v, d * d, float(after)^2)  (v the velocity before the fold; fp64; the last
//                                                   only with MOM)
//   v    = first ? d * inv_lr : fma(d, gain, v * beta)           (gain = (1 - beta) / lr)
//   store v: fp32 | bf16 (nearest even) | int8: per 256 values scale = max|v| / 127 and
//            q = clamp(floor(v / s + r), -127, 127), s = scale or 1 where it is 0, r in [0, 1)
//            24 random bits of a hash of (key, i) (dsh_uniform)
//
// Reference: ds_hybrid.kernels.shard_fold_reference (the same fp32 operations, the same random
// numbers: quant.sr_uniform). zero_access.fold_real_update's torch ops take about 20 kernels a
// 4M-value chunk and some 100 bytes a value; here 6 with bf16 shards and an int8 velocity (both
// shards read, the velocity read and written, a scale per 256 values). The sums are fp64 sums of
// exact fp64 products (the torch ops' are fp32 dots). One 256-thread block per 256 values of the
// velocity at a time (grid-stride), so an int8 block's absolute maximum is one block reduction;
// values past n in the last int8 block are written 0, as the torch ops' zero padding quantises.
// X: 0 = fp32, 1 = bf16, 2 = fp16 shards. VD: 0 = fp32, 1 = bf16, 2 = int8 velocity.

#define DSH_FOLD_THREADS 256

__device__ __forceinline__ float dsh_uniform(unsigned int key, long long i) {   // [0, 1), 24 bits
    const unsigned long long u = (unsigned long long)i;
    const unsigned int h = dsh_mix32((unsigned int)u ^ dsh_mix32((unsigned int)(u >> 32) ^ key));
    return (float)(h >> 8) * 5.9604644775390625e-08f;   // 2^-24: exact
}

template <int X>
__device__ __forceinline__ float dsh_shard(const void* p, long long i) {
    if (X == 0) return static_cast<const float*>(p)[i];
    const unsigned short h = static_cast<const unsigned short*>(p)[i];
    return X == 1 ? dsh_bf16_to_f32(h) : dsh_f16_to_f32(h);
}

template <int X, int VD, bool MOM>
__global__ void __launch_bounds__(DSH_FOLD_THREADS)
shard_fold(const void* __restrict__ after, const void* __restrict__ before, void* __restrict__ v,
           float* __restrict__ scale, double* __restrict__ sums, long long n, float inv_lr, float beta,
           float gain, int first, unsigned int key) {
    __shared__ float warp_max[DSH_FOLD_THREADS / 32];
    __shared__ double warp_sums[4][DSH_FOLD_THREADS / 32];
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    double s_dv = 0.0, s_vv = 0.0, s_dd = 0.0, s_ww = 0.0;
    const long long nblocks = (n + DSH_FOLD_THREADS - 1) / DSH_FOLD_THREADS;
    for (long long b = blockIdx.x; b < nblocks; b += gridDim.x) {
        const long long i = b * DSH_FOLD_THREADS + t;
        const bool in = i < n;
        float vn = 0.0f;
        if (in) {
            const float a = dsh_shard<X>(after, i);
            const float d = __fadd_rn(a, -dsh_shard<X>(before, i));
            // (not dsh_velocity: its __ldg reads the scale through the read-only cache, and this
            // kernel writes it)
            const float vo = VD == 0 ? static_cast<const float*>(v)[i]
                           : VD == 1 ? dsh_bf16_to_f32(static_cast<const unsigned short*>(v)[i])
                                     : (float)static_cast<const signed char*>(v)[i] * scale[b];
            s_dv += (double)d * (double)vo;
            s_vv += (double)vo * (double)vo;
            s_dd += (double)d * (double)d;
            if (MOM) s_ww += (double)a * (double)a;
            vn = first ? __fmul_rn(d, inv_lr) : __fmaf_rn(d, gain, __fmul_rn(vo, beta));
        }
        if (VD == 0) {
            if (in) static_cast<float*>(v)[i] = vn;
        } else if (VD == 1) {
            if (in) static_cast<unsigned short*>(v)[i] = dsh_f32_to_bf16(vn);
        } else {
            // (every thread of the block read its value and this block's scale above; the
            // barriers order those reads before the scale is written)
            float m = fabsf(vn);
            for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(DSH_FULL_MASK, m, off));
            if (lane == 0) warp_max[warp] = m;
            __syncthreads();
            m = warp_max[0];
            for (int w = 1; w < DSH_FOLD_THREADS / 32; ++w) m = fmaxf(m, warp_max[w]);
            __syncthreads();   // (warp_max is written again for the next block)
            const float sc = m / 127.0f;
            const float safe = sc > 0.0f ? sc : 1.0f;
            float q = 0.0f;
            if (in) q = fminf(fmaxf(floorf(__fadd_rn(vn / safe, dsh_uniform(key, i))), -127.0f), 127.0f);
            static_cast<signed char*>(v)[i] = (signed char)q;   // (the block's padding past n: 0)
            if (t == 0) scale[b] = sc;
        }
    }
    // The block's four sums, then one atomicAdd each.
    double part[4] = {s_dv, s_vv, s_dd, s_ww};
    for (int k = 0; k < 4; ++k)
        for (int off = 16; off > 0; off >>= 1) part[k] += __shfl_xor_sync(DSH_FULL_MASK, part[k], off);
    if (lane == 0)
        for (int k = 0; k < 4; ++k) warp_sums[k][warp] = part[k];
    __syncthreads();
    if (t < 4 && (MOM || t < 3)) {
        double total = 0.0;
        for (int w = 0; w < DSH_FOLD_THREADS / 32; ++w) total += warp_sums[t][w];
        atomicAdd(sums + t, total);
    }
}

// Every variant, instantiated here so that `nvcc -c` compiles them all and NVRTC finds
// them by name (ds_hybrid.kernels asks for "fused_predicted_update<LP,SNAP,SQ,VEC>",
// "drift_shift<X,VD,VEC>", "held_adam_step<X,S>" and "shard_fold<X,VD,MOM>").
#define DSH_INST(LP, SNAP, SQ, VEC)                                                         \
    template __global__ void fused_predicted_update<LP, SNAP, SQ, VEC>(                   \
        float*, const float*, const float*, unsigned short*, float*, double*, long long,   \
        float, float, float, float, float);
#define DSH_INST_VEC(LP, SNAP, SQ) DSH_INST(LP, SNAP, SQ, true) DSH_INST(LP, SNAP, SQ, false)
#define DSH_INST_SQ(LP, SNAP) DSH_INST_VEC(LP, SNAP, true) DSH_INST_VEC(LP, SNAP, false)
#define DSH_INST_SNAP(LP) DSH_INST_SQ(LP, true) DSH_INST_SQ(LP, false)
DSH_INST_SNAP(0)
DSH_INST_SNAP(1)
DSH_INST_SNAP(2)

#define DSH_INST_SHIFT(X, VD) \
    template __global__ void drift_shift<X, VD, true>(void*, const void*, const float*, long long, float); \
    template __global__ void drift_shift<X, VD, false>(void*, const void*, const float*, long long, float);
#define DSH_INST_SHIFT_X(X) DSH_INST_SHIFT(X, 0) DSH_INST_SHIFT(X, 1) DSH_INST_SHIFT(X, 2)
DSH_INST_SHIFT_X(0)
DSH_INST_SHIFT_X(1)
DSH_INST_SHIFT_X(2)

#define DSH_INST_HELD(X, S) \
    template __global__ void held_adam_step<X, S>(void*, const void*, const void*, long long, float, float, float, \
                                                  float, float, unsigned int);
DSH_INST_HELD(0, 0)
DSH_INST_HELD(0, 1)
DSH_INST_HELD(1, 0)
DSH_INST_HELD(1, 1)

#define DSH_INST_FOLD(X, VD)                                                                                     \
    template __global__ void shard_fold<X, VD, true>(const void*, const void*, void*, float*, double*, long long, \
                                                     float, float, float, int, unsigned int);                   \
    template __global__ void shard_fold<X, VD, false>(const void*, const void*, void*, float*, double*, long long, \
                                                      float, float, float, int, unsigned int);
#define DSH_INST_FOLD_X(X) DSH_INST_FOLD(X, 0) DSH_INST_FOLD(X, 1) DSH_INST_FOLD(X, 2)
DSH_INST_FOLD_X(0)
DSH_INST_FOLD_X(1)
DSH_INST_FOLD_X(2)
