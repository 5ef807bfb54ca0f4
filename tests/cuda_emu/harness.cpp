// Entry points (extern "C", for ctypes) that run kernels/*.cu under cuda_emu.h on the CPU.
// Built by tests/test_kernels_emulated.py:  g++ -std=c++20 -O1 -pthread -shared -fPIC
//   -I tests/cuda_emu -I kernels harness.cpp -o libkernels_emu.so
#include "cuda_emu.h"

#include "fused_update.cu"
#include "rssm.cu"
#include "encoder.cu"

template <int LP, bool SNAP, bool SQ, bool VEC>
static void run_update(int blocks, int threads, float* master, const float* m, const float* v,
                       unsigned short* lp, float* snap, double* sq, long long n, float step, float bc1,
                       float bc2, float eps, float decay) {
    emu::launch(dim3(blocks), dim3(threads), 0, [=] {
        fused_predicted_update<LP, SNAP, SQ, VEC>(master, m, v, lp, snap, sq, n, step, bc1, bc2, eps, decay);
    });
}

extern "C" int emu_fused_update(int lp, int snap, int sq, int vec, int blocks, int threads, float* master,
                                const float* m, const float* v, unsigned short* lpbuf, float* snapbuf,
                                double* sqbuf, long long n, float step, float bc1, float bc2, float eps,
                                float decay) {
#define DSH_CASE(L, S, Q, V)                                                                       \
    if (lp == L && snap == S && sq == Q && vec == V) {                                             \
        run_update<L, S, Q, V>(blocks, threads, master, m, v, lpbuf, snapbuf, sqbuf, n, step, bc1, \
                               bc2, eps, decay);                                                   \
        return 0;                                                                                  \
    }
#define DSH_CASE_V(L, S, Q) DSH_CASE(L, S, Q, 1) DSH_CASE(L, S, Q, 0)
#define DSH_CASE_Q(L, S) DSH_CASE_V(L, S, 1) DSH_CASE_V(L, S, 0)
#define DSH_CASE_S(L) DSH_CASE_Q(L, 1) DSH_CASE_Q(L, 0)
    DSH_CASE_S(0)
    DSH_CASE_S(1)
    DSH_CASE_S(2)
    return 1;
}

extern "C" int emu_drift_shift(int x, int vd, int vec, int blocks, int threads, void* xp, const void* v,
                               const float* scale, long long n, float c) {
#define DSH_SHIFT_CASE(X, VD, V)                                                                 \
    if (x == X && vd == VD && vec == V) {                                                        \
        emu::launch(dim3(blocks), dim3(threads), 0, [=] { drift_shift<X, VD, V>(xp, v, scale, n, c); }); \
        return 0;                                                                                \
    }
#define DSH_SHIFT_CASE_V(X, VD) DSH_SHIFT_CASE(X, VD, true) DSH_SHIFT_CASE(X, VD, false)
#define DSH_SHIFT_CASE_X(X) DSH_SHIFT_CASE_V(X, 0) DSH_SHIFT_CASE_V(X, 1) DSH_SHIFT_CASE_V(X, 2)
    DSH_SHIFT_CASE_X(0)
    DSH_SHIFT_CASE_X(1)
    DSH_SHIFT_CASE_X(2)
    return 1;
}

extern "C" int emu_held_adam_step(int x, int s, int blocks, int threads, void* xp, const void* m, const void* v,
                                  long long n, float step, float bc1, float bc2, float eps, float decay,
                                  unsigned int key) {
#define DSH_HELD_CASE(X, S)                                                                                   \
    if (x == X && s == S) {                                                                                   \
        emu::launch(dim3(blocks), dim3(threads), 0,                                                           \
                    [=] { held_adam_step<X, S>(xp, m, v, n, step, bc1, bc2, eps, decay, key); });             \
        return 0;                                                                                             \
    }
    DSH_HELD_CASE(0, 0)
    DSH_HELD_CASE(0, 1)
    DSH_HELD_CASE(1, 0)
    DSH_HELD_CASE(1, 1)
    return 1;
}

extern "C" int emu_shard_fold(int x, int vd, int mom, int blocks, int threads, const void* after,
                              const void* before, void* v, float* scale, double* sums, long long n, float inv_lr,
                              float beta, float gain, int first, unsigned int key) {
#define DSH_FOLD_CASE(X, VD, M)                                                                              \
    if (x == X && vd == VD && mom == M) {                                                                    \
        emu::launch(dim3(blocks), dim3(threads), 0,                                                          \
                    [=] { shard_fold<X, VD, M>(after, before, v, scale, sums, n, inv_lr, beta, gain, first, key); }); \
        return 0;                                                                                            \
    }
#define DSH_FOLD_CASE_M(X, VD) DSH_FOLD_CASE(X, VD, true) DSH_FOLD_CASE(X, VD, false)
#define DSH_FOLD_CASE_X(X) DSH_FOLD_CASE_M(X, 0) DSH_FOLD_CASE_M(X, 1) DSH_FOLD_CASE_M(X, 2)
    DSH_FOLD_CASE_X(0)
    DSH_FOLD_CASE_X(1)
    DSH_FOLD_CASE_X(2)
    return 1;
}

static size_t rssm_smem(int D, int S, int H, int A, int HO, int threads) {
    return 4 * (size_t)(D + S + A + H + 6 * D + 2 * S + H + HO + threads);
}

// W: the 12 weight pointers in ds_hybrid.kernels.RSSM_WEIGHTS order.
extern "C" void emu_rssm_step(int E, int B, int threads, const float** W, const float* h, const float* z,
                              const float* a, float* h_out, float* pm, float* ps, int D, int S, int H, int A,
                              int HO, float min_std) {
    emu::launch(dim3(B, E), dim3(threads), rssm_smem(D, S, H, A, HO, threads), [=] {
        rssm_step(W[0], W[1], W[2], W[3], W[4], W[5], W[6], W[7], W[8], W[9], W[10], W[11], h, z, a, h_out,
                  pm, ps, B, D, S, H, A, HO, min_std);
    });
}

extern "C" void emu_rssm_rollout(int E, int B, int threads, const float** W, const float* h, const float* z,
                                 const float* actions, float* h_seq, float* z_seq, float* heads, int D, int S,
                                 int H, int A, int HO, int K) {
    emu::launch(dim3(B, E), dim3(threads), rssm_smem(D, S, H, A, HO, threads), [=] {
        rssm_rollout(W[0], W[1], W[2], W[3], W[4], W[5], W[6], W[7], W[8], W[9], W[10], W[11], h, z, actions,
                     h_seq, z_seq, heads, B, D, S, H, A, HO, K);
    });
}

extern "C" void emu_window_features(int N, const double* hist, const int* counts, double* out) {
    emu::launch(dim3(N), dim3(256), 0, [=] { window_features(hist, counts, out); });
}
