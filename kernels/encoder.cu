// State encoder: the 39 window features (features 0-38 of the 64) from the histories.
//
// Reference: ds_hybrid/dynamics/window.py, window_features(hist [8, 32] float64,
// counts [8] int32) -> [39] float64 (ds_hybrid.kernels.window_features dispatches here
// or to it). Same feature table, same channels; computed in fp64.
//
// One block of 256 threads per history (grid: N histories, [N, 8, 32] -> [N, 39]).
// Each warp owns one group of features; lane i holds position i of a channel's
// right-aligned 32-step history, so a window of the last n values is lanes 32-n..31
// and every mean, sum, min and max is a warp reduction (shuffles, no shared memory).
//
//   warp 0  loss: last, mean / std over 4, 8, 16, 32, min / max over 32     (0-10)
//   warp 1  loss: least-squares slope over 8, 16, 32; curvature over 16, 32 (11-15)
//   warp 2  loss, last 16: line residual / mean, rises, sign changes, z-score (35-38)
//   warp 3  log gradient norm (16-21)     warp 4  log update norm (22-24)
//   warp 5  direction cosine (25-27)      warp 6  projection (28-30)
//   warp 7  loss-prediction error, signed error, acceptance (31-34)
//
// Least squares on x centred at 0 (x_i = i - (n - 1) / 2), as the reference: the slope
// is sum(x y) / sum(x^2); the quadratic coefficient is the [1, x^2] part of the normal
// equations (x is orthogonal to both): c = (n sum(x^2 y) - sum(x^2) sum(y)) /
// (n sum(x^4) - sum(x^2)^2). The reference solves the same problem with a QR
// factorisation (torch.linalg.lstsq): the two agree to fp64 rounding.

#define DSH_FULL_MASK 0xffffffffu
#define DSH_WINDOW 32
#define DSH_CHANNELS 8
#define DSH_FEATURES 39
#define DSH_INF __longlong_as_double(0x7ff0000000000000LL)

__device__ __forceinline__ double dsh_wsum(double v) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(DSH_FULL_MASK, v, off);
    return v;
}
__device__ __forceinline__ double dsh_wmin(double v) {
    for (int off = 16; off > 0; off >>= 1) v = fmin(v, __shfl_xor_sync(DSH_FULL_MASK, v, off));
    return v;
}
__device__ __forceinline__ double dsh_wmax(double v) {
    for (int off = 16; off > 0; off >>= 1) v = fmax(v, __shfl_xor_sync(DSH_FULL_MASK, v, off));
    return v;
}

// Window of the last n values (lanes 32-n..31). All 32 lanes must call these.
__device__ __forceinline__ bool dsh_in(int lane, int n) { return lane >= DSH_WINDOW - n; }

__device__ __forceinline__ double dsh_mean(double y, int lane, int n) {
    return n > 0 ? dsh_wsum(dsh_in(lane, n) ? y : 0.0) / n : 0.0;
}
// Population standard deviation (torch's std(unbiased=False)); 0 for fewer than 2 values.
__device__ __forceinline__ double dsh_std(double y, int lane, int n) {
    const double m = dsh_mean(y, lane, n);
    const double d = dsh_in(lane, n) ? y - m : 0.0;
    const double var = dsh_wsum(d * d);
    return n > 1 ? sqrt(var / n) : 0.0;
}
__device__ __forceinline__ double dsh_x(int lane, int n) {   // centred abscissa
    return (double)(lane - (DSH_WINDOW - n)) - 0.5 * (n - 1);
}
__device__ __forceinline__ double dsh_slope(double y, int lane, int n) {
    const double x = dsh_in(lane, n) ? dsh_x(lane, n) : 0.0;
    const double sxy = dsh_wsum(dsh_in(lane, n) ? x * y : 0.0);
    const double sxx = dsh_wsum(x * x);
    return n > 1 ? sxy / sxx : 0.0;
}
__device__ __forceinline__ double dsh_curvature(double y, int lane, int n) {
    const bool in = dsh_in(lane, n);
    const double x = in ? dsh_x(lane, n) : 0.0, x2 = x * x;
    const double sy = dsh_wsum(in ? y : 0.0), sx2 = dsh_wsum(x2), sx4 = dsh_wsum(x2 * x2);
    const double sx2y = dsh_wsum(in ? x2 * y : 0.0);
    return n > 2 ? (n * sx2y - sx2 * sy) / (n * sx4 - sx2 * sx2) : 0.0;
}

// hist [N, 8, 32] fp64 (right-aligned), counts [N, 8] int32 -> out [N, 39] fp64.
extern "C" __global__ void __launch_bounds__(256)
window_features(const double* __restrict__ hist, const int* __restrict__ counts,
                double* __restrict__ out) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const double* hs = hist + (long long)blockIdx.x * DSH_CHANNELS * DSH_WINDOW;
    const int* cs = counts + (long long)blockIdx.x * DSH_CHANNELS;
    double* o = out + (long long)blockIdx.x * DSH_FEATURES;
    for (int j = threadIdx.x; j < DSH_FEATURES; j += blockDim.x) o[j] = 0.0;
    __syncthreads();
    if (warp >= 8) return;
    const int c_loss = max(cs[0], 0);
    const double loss = hs[lane];
    switch (warp) {
    case 0: if (c_loss > 0) {
        const int windows[4] = {4, 8, 16, 32};
        double res[8];
        for (int j = 0; j < 4; ++j) {
            const int n = min(c_loss, windows[j]);
            res[j] = dsh_mean(loss, lane, n);
            res[4 + j] = dsh_std(loss, lane, n);
        }
        const int n32 = min(c_loss, 32);
        const double lo = dsh_wmin(dsh_in(lane, n32) ? loss : DSH_INF);
        const double hi = dsh_wmax(dsh_in(lane, n32) ? loss : -DSH_INF);
        if (lane == 31) {
            o[0] = loss;
            for (int j = 0; j < 8; ++j) o[1 + j] = res[j];
            o[9] = lo;
            o[10] = hi;
        }
    } break;
    case 1: if (c_loss > 0) {
        const double s8 = dsh_slope(loss, lane, min(c_loss, 8));
        const double s16 = dsh_slope(loss, lane, min(c_loss, 16));
        const double s32 = dsh_slope(loss, lane, min(c_loss, 32));
        const double q16 = dsh_curvature(loss, lane, min(c_loss, 16));
        const double q32 = dsh_curvature(loss, lane, min(c_loss, 32));
        if (lane == 0) { o[11] = s8; o[12] = s16; o[13] = s32; o[14] = q16; o[15] = q32; }
    } break;
    case 2: {
        const int n = min(c_loss, 16);
        if (n >= 3) {
            const double m = dsh_mean(loss, lane, n), sd = dsh_std(loss, lane, n);
            const double slope = dsh_slope(loss, lane, n);
            const double resid = loss - (m + slope * dsh_x(lane, n));
            const double rsd = dsh_std(resid, lane, n);
            // Changes d_i = y_{i+1} - y_i for the window's lanes but the last.
            const double next = __shfl_down_sync(DSH_FULL_MASK, loss, 1);
            const double d = next - loss;
            const bool has_d = dsh_in(lane, n) && lane < DSH_WINDOW - 1;
            const double rises = dsh_wsum(has_d && d > 0.0 ? 1.0 : 0.0);
            const double d_next = __shfl_down_sync(DSH_FULL_MASK, d, 1);
            const bool has_pair = dsh_in(lane, n) && lane < DSH_WINDOW - 2;
            const double flips = dsh_wsum(has_pair && d * d_next < 0.0 ? 1.0 : 0.0);
            if (lane == 31) {
                o[35] = rsd / fmax(fabs(m), 1e-8);
                o[36] = rises / (n - 1);
                o[37] = flips / (n - 2);
                o[38] = sd > 0.0 ? (loss - m) / sd : 0.0;
            }
        }
    } break;
    case 3: {
        const int c = max(cs[1], 0);
        if (c > 0) {
            const double g = hs[1 * DSH_WINDOW + lane];
            const double m8 = dsh_mean(g, lane, min(c, 8)), m32 = dsh_mean(g, lane, min(c, 32));
            const double s8 = dsh_std(g, lane, min(c, 8)), sl16 = dsh_slope(g, lane, min(c, 16));
            if (lane == 31) { o[16] = g; o[17] = m8; o[18] = m32; o[19] = s8; o[20] = sl16; o[21] = g - m32; }
        }
    } break;
    case 4: {
        const int c = max(cs[2], 0);
        if (c > 0) {
            const double u = hs[2 * DSH_WINDOW + lane];
            const double m8 = dsh_mean(u, lane, min(c, 8));
            if (lane == 31) { o[22] = u; o[23] = m8; o[24] = u - m8; }
        }
    } break;
    case 5: {
        const int c = max(cs[3], 0);
        if (c > 0) {
            const double v = hs[3 * DSH_WINDOW + lane];
            const int n = min(c, 8);
            const double m = dsh_mean(v, lane, n);
            const double lo = dsh_wmin(dsh_in(lane, n) ? v : DSH_INF);
            if (lane == 31) { o[25] = v; o[26] = m; o[27] = lo; }
        }
    } break;
    case 6: {
        const int c = max(cs[4], 0);
        if (c > 0) {
            const double v = hs[4 * DSH_WINDOW + lane];
            const int n = min(c, 8);
            const double m = dsh_mean(v, lane, n), s = dsh_std(v, lane, n);
            if (lane == 31) { o[28] = v; o[29] = m; o[30] = s; }
        }
    } break;
    case 7: {
        const int ce = max(cs[5], 0), cse = max(cs[6], 0), ca = max(cs[7], 0);
        const double e = hs[5 * DSH_WINDOW + lane];
        const double me = dsh_mean(e, lane, min(ce, 8));
        const double mse = dsh_mean(hs[6 * DSH_WINDOW + lane], lane, min(cse, 8));
        const double ma = dsh_mean(hs[7 * DSH_WINDOW + lane], lane, min(ca, 8));
        if (lane == 31) {
            if (ce > 0) { o[31] = e; o[32] = me; }
            if (cse > 0) o[33] = mse;
            if (ca > 0) o[34] = ma;
        }
    } break;
    }
}
