// RSSM ensemble: one GRU + prior step, and a K-step imagined rollout with the heads.
//
// Reference: ds_hybrid/dynamics/rssm.py, RSSMEnsemble.step / prior / heads / rollout
// (ds_hybrid.kernels.rssm_step and rssm_rollout dispatch here or to it).
//
// Layout (all fp32, contiguous, every member's weights stacked on a leading axis E):
//   W_in [E, S+A, H]  b_in [E, 1, H]     u  = silu([z, a] @ W_in + b_in)
//   W_ih [E, H, 3D]   b_ih [E, 1, 3D]    gi = u @ W_ih + b_ih          (gate order r, z, n)
//   W_hh [E, D, 3D]   b_hh [E, 1, 3D]    gh = h @ W_hh + b_hh
//                                        r = sig(gi_r + gh_r); g = sig(gi_z + gh_z)
//                                        n = tanh(gi_n + r * gh_n); h' = (1 - g) n + g h
//   W_pr [E, D, 2S]   b_pr [E, 1, 2S]    prior: mean = first S, std = softplus(last S) + min_std
//   W_h1 [E, D+S, H]  b_h1 [E, 1, H]     heads: y = silu([h, z] @ W_h1 + b_h1) @ W_h2 + b_h2
//   W_h2 [E, H, HO]   b_h2 [E, 1, HO]    HO = 2 KH + 2: loss mean [KH], loss std [KH],
//                                        scale mean, scale std (stds: softplus + 1e-2)
//
// One block per (batch row, member): grid (B, E). The block keeps its row's state
// [h | z | a] in shared memory for the whole launch; the rollout runs its K steps
// without leaving the chip (only the per-step outputs are written). Weights are read
// from global memory (L2-resident: one member is about 1.4 MB, and the B blocks of a
// member share it). Every matrix-vector product uses the whole block: the reduction
// over inputs is split into groups of threads whose partial sums meet in shared memory.
//
// Sizes (D, S, H, A, HO, K) are arguments; blockDim is any multiple of 32 up to 1024.

#define DSH_MAX_THREADS 1024
#ifndef DSH_DYNAMIC_SMEM   // tests/cuda_emu (the CPU emulation) defines its own
#define DSH_DYNAMIC_SMEM(T, name) extern __shared__ T name[]
#endif

__device__ __forceinline__ float dsh_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float dsh_silu(float x) { return x / (1.0f + expf(-x)); }
// torch.nn.functional.softplus (beta 1, threshold 20).
__device__ __forceinline__ float dsh_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// out[j] = bias[j] + sum_k x[k] * W[k * ld + j] for j < nout, k < nin.
// x, out, scratch in shared memory (scratch: blockDim floats); W, bias in global memory.
// Ends with __syncthreads(): out is visible to the whole block.
__device__ void dsh_matvec(const float* __restrict__ x, int nin, const float* __restrict__ W,
                           int ld, int nout, const float* __restrict__ bias,
                           float* __restrict__ out, float* __restrict__ scratch) {
    const int t = threadIdx.x, nt = blockDim.x;
    if (nout >= nt) {                       // one output (or more) per thread
        for (int j = t; j < nout; j += nt) {
            float acc = 0.0f;
#pragma unroll 4
            for (int k = 0; k < nin; ++k) acc += x[k] * __ldg(W + (long long)k * ld + j);
            out[j] = __ldg(bias + j) + acc;
        }
        __syncthreads();
        return;
    }
    const int groups = nt / nout;           // threads per output, each a slice of the inputs
    const int chunk = (nin + groups - 1) / groups;
    if (t < groups * nout) {
        const int j = t % nout, g = t / nout;
        const int k0 = g * chunk, k1 = min(nin, k0 + chunk);
        float acc = 0.0f;
#pragma unroll 4
        for (int k = k0; k < k1; ++k) acc += x[k] * __ldg(W + (long long)k * ld + j);
        scratch[t] = acc;
    }
    __syncthreads();
    for (int j = t; j < nout; j += nt) {
        float acc = 0.0f;
        for (int g = 0; g < groups; ++g) acc += scratch[g * nout + j];
        out[j] = __ldg(bias + j) + acc;
    }
    __syncthreads();
}

struct DshRSSMWeights {
    const float *W_in, *b_in, *W_ih, *b_ih, *W_hh, *b_hh, *W_pr, *b_pr, *W_h1, *b_h1, *W_h2, *b_h2;
};

// Shared-memory layout of one block (floats), dynamic, sized by the launcher:
//   state [D + S + A]  (h | z | a)   u [H]   gi [3D]   gh [3D]   pr [2S]   x1 [H]   y [HO]
//   scratch [blockDim]

// One GRU transition of state = [h | z | a] in place (h <- h'), for member e's weights
// (pointers already offset to the member). Ends synchronised.
__device__ void dsh_gru(float* state, float* u, float* gi, float* gh, float* scratch,
                        const DshRSSMWeights& w, int D, int S, int H, int A) {
    float* h = state;
    dsh_matvec(state + D, S + A, w.W_in, H, H, w.b_in, u, scratch);
    for (int j = threadIdx.x; j < H; j += blockDim.x) u[j] = dsh_silu(u[j]);
    __syncthreads();
    dsh_matvec(u, H, w.W_ih, 3 * D, 3 * D, w.b_ih, gi, scratch);
    dsh_matvec(h, D, w.W_hh, 3 * D, 3 * D, w.b_hh, gh, scratch);
    for (int j = threadIdx.x; j < D; j += blockDim.x) {
        const float r = dsh_sigmoid(gi[j] + gh[j]);
        const float g = dsh_sigmoid(gi[D + j] + gh[D + j]);
        const float n = tanhf(gi[2 * D + j] + r * gh[2 * D + j]);
        h[j] = (1.0f - g) * n + g * h[j];
    }
    __syncthreads();
}

// The kernels take the 12 stacked tensors in RSSMEnsemble.PARAM_ORDER minus the
// embedding / posterior (W_in, b_in, W_ih, b_ih, W_hh, b_hh, W_pr, b_pr, W_h1, b_h1,
// W_h2, b_h2); this points at member e's slices.
#define DSH_WEIGHT_PARAMS                                                                  \
    const float* __restrict__ W_in, const float* __restrict__ b_in,                        \
    const float* __restrict__ W_ih, const float* __restrict__ b_ih,                        \
    const float* __restrict__ W_hh, const float* __restrict__ b_hh,                        \
    const float* __restrict__ W_pr, const float* __restrict__ b_pr,                        \
    const float* __restrict__ W_h1, const float* __restrict__ b_h1,                        \
    const float* __restrict__ W_h2, const float* __restrict__ b_h2

__device__ __forceinline__ DshRSSMWeights dsh_member(DSH_WEIGHT_PARAMS, int e, int D, int S,
                                                     int H, int A, int HO) {
    DshRSSMWeights m;
    m.W_in = W_in + (long long)e * (S + A) * H;   m.b_in = b_in + (long long)e * H;
    m.W_ih = W_ih + (long long)e * H * 3 * D;     m.b_ih = b_ih + (long long)e * 3 * D;
    m.W_hh = W_hh + (long long)e * D * 3 * D;     m.b_hh = b_hh + (long long)e * 3 * D;
    m.W_pr = W_pr + (long long)e * D * 2 * S;     m.b_pr = b_pr + (long long)e * 2 * S;
    m.W_h1 = W_h1 + (long long)e * (D + S) * H;   m.b_h1 = b_h1 + (long long)e * H;
    m.W_h2 = W_h2 + (long long)e * H * HO;        m.b_h2 = b_h2 + (long long)e * HO;
    return m;
}

#define DSH_WEIGHT_ARGS W_in, b_in, W_ih, b_ih, W_hh, b_hh, W_pr, b_pr, W_h1, b_h1, W_h2, b_h2

// One step for every member and batch row: h_out = step(h, z, a), and the prior on h_out.
// h [E, B, D], z [E, B, S], a [E, B, A] -> h_out [E, B, D], prior_mean / prior_std [E, B, S].
extern "C" __global__ void __launch_bounds__(DSH_MAX_THREADS)
rssm_step(DSH_WEIGHT_PARAMS, const float* __restrict__ h, const float* __restrict__ z,
          const float* __restrict__ a, float* __restrict__ h_out, float* __restrict__ prior_mean,
          float* __restrict__ prior_std, int B, int D, int S, int H, int A, int HO, float min_std) {
    DSH_DYNAMIC_SMEM(float, smem);
    const int b = blockIdx.x, e = blockIdx.y;
    const long long row = (long long)e * B + b;
    float *state = smem, *u = state + D + S + A, *gi = u + H, *gh = gi + 3 * D, *pr = gh + 3 * D;
    float* scratch = pr + 2 * S + H + HO;
    const DshRSSMWeights m = dsh_member(DSH_WEIGHT_ARGS, e, D, S, H, A, HO);
    for (int j = threadIdx.x; j < D; j += blockDim.x) state[j] = h[row * D + j];
    for (int j = threadIdx.x; j < S; j += blockDim.x) state[D + j] = z[row * S + j];
    for (int j = threadIdx.x; j < A; j += blockDim.x) state[D + S + j] = a[row * A + j];
    __syncthreads();
    dsh_gru(state, u, gi, gh, scratch, m, D, S, H, A);
    dsh_matvec(state, D, m.W_pr, 2 * S, 2 * S, m.b_pr, pr, scratch);
    for (int j = threadIdx.x; j < D; j += blockDim.x) h_out[row * D + j] = state[j];
    for (int j = threadIdx.x; j < S; j += blockDim.x) {
        prior_mean[row * S + j] = pr[j];
        prior_std[row * S + j] = dsh_softplus(pr[S + j]) + min_std;
    }
}

// K imagined steps from (h, z) under actions [E, B, K, A]: h = step(h, z, a_k); z = prior
// mean of h; heads on [h, z]. Writes h_seq [E, B, K, D], z_seq [E, B, K, S] and
// heads [E, B, K, HO] with the std columns already transformed (softplus + 1e-2).
extern "C" __global__ void __launch_bounds__(DSH_MAX_THREADS)
rssm_rollout(DSH_WEIGHT_PARAMS, const float* __restrict__ h, const float* __restrict__ z,
             const float* __restrict__ actions, float* __restrict__ h_seq, float* __restrict__ z_seq,
             float* __restrict__ heads, int B, int D, int S, int H, int A, int HO, int K) {
    DSH_DYNAMIC_SMEM(float, smem);
    const int b = blockIdx.x, e = blockIdx.y;
    const long long row = (long long)e * B + b;
    float *state = smem, *u = state + D + S + A, *gi = u + H, *gh = gi + 3 * D, *pr = gh + 3 * D;
    float *x1 = pr + 2 * S, *y = x1 + H, *scratch = y + HO;
    const DshRSSMWeights m = dsh_member(DSH_WEIGHT_ARGS, e, D, S, H, A, HO);
    const int KH = (HO - 2) / 2;   // the loss head's horizon
    for (int j = threadIdx.x; j < D; j += blockDim.x) state[j] = h[row * D + j];
    for (int j = threadIdx.x; j < S; j += blockDim.x) state[D + j] = z[row * S + j];
    for (int k = 0; k < K; ++k) {
        const long long rk = row * K + k;
        for (int j = threadIdx.x; j < A; j += blockDim.x) state[D + S + j] = actions[rk * A + j];
        __syncthreads();
        dsh_gru(state, u, gi, gh, scratch, m, D, S, H, A);
        dsh_matvec(state, D, m.W_pr, 2 * S, S, m.b_pr, pr, scratch);   // prior mean only
        for (int j = threadIdx.x; j < S; j += blockDim.x) state[D + j] = pr[j];
        __syncthreads();
        dsh_matvec(state, D + S, m.W_h1, H, H, m.b_h1, x1, scratch);
        for (int j = threadIdx.x; j < H; j += blockDim.x) x1[j] = dsh_silu(x1[j]);
        __syncthreads();
        dsh_matvec(x1, H, m.W_h2, HO, HO, m.b_h2, y, scratch);
        for (int j = threadIdx.x; j < D; j += blockDim.x) h_seq[rk * D + j] = state[j];
        for (int j = threadIdx.x; j < S; j += blockDim.x) z_seq[rk * S + j] = state[D + j];
        for (int j = threadIdx.x; j < HO; j += blockDim.x) {
            const bool is_std = (j >= KH && j < 2 * KH) || j == 2 * KH + 1;
            heads[rk * HO + j] = is_std ? dsh_softplus(y[j]) + 1e-2f : y[j];
        }
        // The next step's first read of state (the action slots) is behind a barrier.
    }
}
