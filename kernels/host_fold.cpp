// The drift velocity's fold after a real step, on fp32 masters in host memory, in one pass.
//
// ds_hybrid/zero_access.py::fold_real_update does this with torch ops a chunk at a time: about
// twenty passes over each 16 MiB chunk (the Adam direction, the update, three dot products, the
// EMA, the int8 quantisation), each from DRAM: 3.5-6.5x DeepSpeed's own CPU Adam step on the same
// values (benchmarks/host_path.py), on a real step under ZeRO-Offload. Here every value is read once and the
// velocity written once, 256 values (one int8 scale block) at a time, on torch's intra-op
// threads. The arithmetic per value is the torch path's, in the same order and in fp32: an
// add with ``alpha`` is a fused multiply-add, as torch's vectorised CPU kernels compute it
// (vec::fmadd), and nothing else is contracted (built with -ffp-contract=off); the dot products
// accumulate in fp64 (the torch path: fp32 per chunk, then fp64). The int8 noise is the
// torch path's own: the caller passes, per chunk, the uniform values quant._cpu_noise drew and,
// where those are a window of its table, the window's offset, and the values are computed from it.
//
// Loaded by ds_hybrid/host_kernels.py (torch.utils.cpp_extension, built on first use).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kBlock = 256;  // quant.BLOCK: values per int8 scale
constexpr int kLanes = 16;       // independent fp32 partial sums per block: vectorisable without -ffast-math
constexpr int64_t kGroup = 64;   // blocks per partial sum of the fold (16384 values): see fold()

struct Sums {
  double dv = 0, vv = 0, dd = 0, ww = 0, m_abs = 0, v_sqrt = 0;
};

const float* ptr_or_null(const torch::Tensor& t) {
  return t.numel() ? t.data_ptr<float>() : nullptr;
}

struct Args {
  const float *w, *m, *v2, *before;
  float* v32;
  at::BFloat16* v16;
  int8_t* v8;
  float* scale;
  int64_t before_off = 0;   // the value ``before`` starts at (a snapshot of a range only: step_fusion's chunks)
  bool before_block = false;   // ``before`` is each block's own copy, made just before its update (adam_fold)
  const std::vector<const float*>* noise;
  const std::vector<int64_t>* noise_off;   // per chunk: its offset in the noise table, or -1 (read ``noise``)
  int64_t n, chunk;
  float lr, bc1, bc2, eps, beta, decay, neg_lr, inv_lr, mix;
  bool moments;
};

// kLanes fp32 lanes as one vector (GCC's vector extension): the lane sums below (the running max
// and min of the int8 quantisation keep the same lanes in two halves, see quantize()). Lane l holds
// what a scalar loop over the values l, l + kLanes, l + 2 kLanes, ... would, in that order; with
// -ffp-contract=off a += b * c is a multiply then an add, as in that loop.
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));

inline Lanes lanes_at(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof(Lanes));
  return v;
}

// One block of kBlock values (then, for int8, the quantisation): each value's direction, update
// and old velocity in plain loops over the block, which the compiler vectorises at full width
// (a loop over kLanes lanes with the lane sums inside it went out in 4-wide pieces, its divisions
// and square root the fold's bottleneck); the sums in kLanes lanes; then the new velocity. The
// last block, when short, is copied into zero-padded arrays first (as quant.CompactBuffer.store
// pads it) and written back after.
template <int VD, bool FROM_STATE, bool DECAY, bool FIRST>
void fold_values(const Args& A, const float* w, const float* m, const float* v2, const float* before,
                 const void* vin, float v_scale, float* x, Sums& s) {
  alignas(64) float d[kBlock], v_buf[kBlock];
  const float* v_old = VD == 0 ? static_cast<const float*>(vin) : v_buf;   // (fp32: read in place)
  for (int64_t j = 0; j < kBlock; ++j) {
    if (FROM_STATE) {
      const float a = (m[j] / A.bc1) / (std::sqrt(v2[j] / A.bc2) + A.eps);
      // torch.add(w, a, alpha=lr).mul_(k).sub_(a, alpha=lr): an add with alpha is torch's fmadd
      d[j] = DECAY ? std::fma(a, -A.lr, std::fma(a, A.lr, w[j]) * A.decay) : a * A.neg_lr;
    } else {
      d[j] = w[j] - before[j];
    }
  }
  if (VD == 1) {
    const auto* src = static_cast<const at::BFloat16*>(vin);
    for (int64_t j = 0; j < kBlock; ++j) v_buf[j] = static_cast<float>(src[j]);
  } else if (VD == 2) {
    const auto* src = static_cast<const int8_t*>(vin);
    for (int64_t j = 0; j < kBlock; ++j) v_buf[j] = static_cast<float>(src[j]) * v_scale;
  }
  Lanes dv = {}, vv = {}, dd = {}, ww = {};
  for (int64_t j0 = 0; j0 < kBlock; j0 += kLanes) {
    const Lanes dj = lanes_at(d + j0), vj = lanes_at(v_old + j0);
    dv += dj * vj;
    vv += vj * vj;
    dd += dj * dj;
    if (A.moments) {
      const Lanes wj = lanes_at(w + j0);
      ww += wj * wj;
    }
  }
  for (int l = 0; l < kLanes; ++l) {
    s.dv += dv[l];
    s.vv += vv[l];
    s.dd += dd[l];
    s.ww += ww[l];
  }
  // mul_(beta).add_(d, alpha=(1 - beta) / lr)
  for (int64_t j = 0; j < kBlock; ++j) x[j] = FIRST ? d[j] * A.inv_lr : std::fma(d[j], A.mix, v_old[j] * A.beta);
  if (A.moments && m != nullptr) {
    alignas(64) float m_abs[kBlock], v_sqrt[kBlock];
    for (int64_t j = 0; j < kBlock; ++j) {
      m_abs[j] = std::fabs(m[j]);
      v_sqrt[j] = std::sqrt(v2[j]);
    }
    Lanes ma = {}, vs = {};
    for (int64_t j0 = 0; j0 < kBlock; j0 += kLanes) {
      ma += lanes_at(m_abs + j0);
      vs += lanes_at(v_sqrt + j0);
    }
    for (int l = 0; l < kLanes; ++l) {
      s.m_abs += ma[l];
      s.v_sqrt += vs[l];
    }
  }
}

inline uint32_t mix32(uint32_t x) {   // quant._mix32 / fused_update.cu's dsh_mix32 ("lowbias32")
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// The noise table of quant._cpu_noise (quant.noise_table_values): value j of its kNoisePeriod is
// 24 bits of mix32(j ^ kNoiseKey), scaled to [0, 1) exactly. Computed here where a store's noise
// is a window of that table: beside a GPU the fold inside DeepSpeed's step is bound by memory,
// and reading the window was 4 of the pass's 34 bytes a value. (host_kernels.load checks these
// against quant.CHUNK and quant.NOISE_TABLE_SEED.)
constexpr int64_t kNoisePeriod = int64_t{1} << 22;
constexpr uint32_t kNoiseKey = 0x5EED;

inline void table_noise(int64_t first, float* u) {   // the table's values first, first + 1, ... (a block's)
  for (int64_t j = 0; j < kBlock; ++j) {
    const uint32_t idx = static_cast<uint32_t>((first + j) & (kNoisePeriod - 1));
    u[j] = static_cast<float>(mix32(idx ^ kNoiseKey) >> 8) * 0x1p-24f;
  }
}

// int8: absmax per block as max(max x, -min x), then x / scale + the noise, floored and clamped
// (quant.CompactBuffer.store's arithmetic)
// (The running max and min in kLanes lanes, each keeping the scalar rule's value: hi < x ? x : hi,
// lo > x ? x : lo. A loop over kLanes scalars with its compare-and-select was not vectorised, and
// neither was the select on a kLanes-wide Lanes without AVX-512: GCC 12 lowered it to scalar
// compares and moves, about eight instructions a value (a sixth to a fifth of the int8 one pass's
// time at 2^26 values on a 2-core AVX2 host, docs/memory.md). In halves of 8 lanes (one AVX2
// register) it is one max and one min per 8 values.)
typedef float HalfLanes __attribute__((vector_size(kLanes / 2 * sizeof(float))));

inline float quantize(const float* x, const float* u, int8_t* out) {
  HalfLanes hi_v[2], lo_v[2];
  std::memcpy(hi_v, x, sizeof hi_v);
  std::memcpy(lo_v, x, sizeof lo_v);
  for (int64_t j0 = kLanes; j0 < kBlock; j0 += kLanes) {
    for (int h = 0; h < 2; ++h) {   // lanes 0-7, then 8-15: lane l still sees x[l], x[l + kLanes], ...
      HalfLanes xv;
      std::memcpy(&xv, x + j0 + h * (kLanes / 2), sizeof xv);
      hi_v[h] = hi_v[h] < xv ? xv : hi_v[h];
      lo_v[h] = lo_v[h] > xv ? xv : lo_v[h];
    }
  }
  float hi[kLanes], lo[kLanes];
  std::memcpy(hi, hi_v, sizeof hi);
  std::memcpy(lo, lo_v, sizeof lo);
  float top = hi[0], bottom = lo[0];
  for (int l = 1; l < kLanes; ++l) {
    top = std::max(top, hi[l]);
    bottom = std::min(bottom, lo[l]);
  }
  const float sc = std::max(top, -bottom) / 127.0f;
  const float safe = sc > 0.0f ? sc : 1.0f;
  int32_t q[kBlock];
  for (int64_t j = 0; j < kBlock; ++j) {
    const float y = std::floor(x[j] / safe + u[j]);
    q[j] = static_cast<int32_t>(y < -127.0f ? -127.0f : (y > 127.0f ? 127.0f : y));
  }
  for (int64_t j = 0; j < kBlock; ++j) out[j] = static_cast<int8_t>(q[j]);
  return sc;
}

// A block's weights as they were before its update, copied by adam_fold's ``pre`` on the thread
// that folds the block next (A.before_block): the step's exact displacement, from L1.
alignas(64) thread_local float tl_before[kBlock];

template <int VD, bool FROM_STATE, bool DECAY, bool FIRST>
void fold_block(const Args& A, int64_t b, Sums& s) {
  const int64_t i0 = b * kBlock, len = std::min(kBlock, A.n - i0);
  const float* before = A.before_block ? tl_before : A.before ? A.before + (i0 - A.before_off) : nullptr;
  const float v_scale = VD == 2 ? A.scale[b] : 0.0f;
  float x[kBlock];
  const void* vin = VD == 0 ? static_cast<const void*>(A.v32 + i0)
                  : VD == 1 ? static_cast<const void*>(A.v16 + i0) : static_cast<const void*>(A.v8 + i0);
  if (len == kBlock) {
    fold_values<VD, FROM_STATE, DECAY, FIRST>(A, A.w + i0, A.m ? A.m + i0 : nullptr, A.v2 ? A.v2 + i0 : nullptr,
                                              before, vin, v_scale, x, s);
  } else {   // the partition's short last block: zero-padded copies
    float w[kBlock] = {0}, m[kBlock] = {0}, v2[kBlock] = {0}, before_pad[kBlock] = {0}, v32[kBlock] = {0};
    at::BFloat16 v16[kBlock];
    int8_t v8[kBlock] = {0};
    for (int64_t j = 0; j < kBlock; ++j) v16[j] = at::BFloat16(0.0f);
    std::memcpy(w, A.w + i0, len * sizeof(float));
    if (A.m) std::memcpy(m, A.m + i0, len * sizeof(float));
    if (A.v2) std::memcpy(v2, A.v2 + i0, len * sizeof(float));
    if (before) std::memcpy(before_pad, before, len * sizeof(float));
    if (VD == 0) std::memcpy(v32, A.v32 + i0, len * sizeof(float));
    if (VD == 1) std::memcpy(v16, A.v16 + i0, len * sizeof(at::BFloat16));
    if (VD == 2) std::memcpy(v8, A.v8 + i0, kBlock);   // (the int8 buffer is allocated in whole blocks)
    const void* pin = VD == 0 ? static_cast<const void*>(v32) : VD == 1 ? static_cast<const void*>(v16)
                                                                         : static_cast<const void*>(v8);
    fold_values<VD, FROM_STATE, DECAY, FIRST>(A, w, A.m ? m : nullptr, A.v2 ? v2 : nullptr, before_pad, pin,
                                              v_scale, x, s);
    for (int64_t j = len; j < kBlock; ++j) x[j] = 0.0f;   // as the torch path's zero padding
  }
  if (VD == 0) {
    std::memcpy(A.v32 + i0, x, len * sizeof(float));
  } else if (VD == 1) {
    for (int64_t j = 0; j < len; ++j) A.v16[i0 + j] = at::BFloat16(x[j]);   // round to nearest even, as copy_
  } else {
    const int64_t c = i0 / A.chunk, k = i0 - c * A.chunk, off = (*A.noise_off)[c];
    if (off >= 0) {   // a window of the noise table: its values computed, not read
      alignas(64) float u[kBlock];
      table_noise(off + k, u);
      A.scale[b] = quantize(x, u, A.v8 + i0);
    } else {
      A.scale[b] = quantize(x, (*A.noise)[c] + k, A.v8 + i0);
    }
  }
}

template <int VD, bool FROM_STATE, bool DECAY, bool FIRST>
void fold_blocks(const Args& A, int64_t b0, int64_t b1, Sums& s) {
  for (int64_t b = b0; b < b1; ++b) fold_block<VD, FROM_STATE, DECAY, FIRST>(A, b, s);
}

using BlocksFn = void (*)(const Args&, int64_t, int64_t, Sums&);

template <int VD>
BlocksFn pick(bool from_state, bool decay, bool first) {
  if (from_state) {
    if (decay) return first ? fold_blocks<VD, true, true, true> : fold_blocks<VD, true, true, false>;
    return first ? fold_blocks<VD, true, false, true> : fold_blocks<VD, true, false, false>;
  }
  return first ? fold_blocks<VD, false, false, true> : fold_blocks<VD, false, false, false>;
}

}  // namespace

// Returns {d.v_old, v_old.v_old, d.d, w.w, sum|m|, sum sqrt(v2)} with d = lr x the step's update
// (the caller scales, as the torch path does). velocity dtype: 0 fp32, 1 bf16, 2 int8.
//
// ``b0``, ``b1``: the range of blocks to fold (all: 0 and -1), indices into the whole partition (the
// noise of chunk c covers its blocks wherever the range starts); a range starts and ends on a
// kGroup boundary or at the partition's end. The sums add up kGroup blocks at a time, each group
// from zero, and the groups in order into ``acc`` (fp64, 6 values, read and written; the returned
// values are its new ones): a partition folded in one call or range by range in order (inside
// DeepSpeed's CPU Adam step, step_fusion.py) gives the same sums bit for bit, on any thread count.
// ``pre`` (adam_fold below): each block's own work, run just before the block is folded.
using PreBlock = std::function<void(int64_t)>;

std::vector<double> fold_core(torch::Tensor w, torch::Tensor m, torch::Tensor v2, torch::Tensor before,
                              torch::Tensor vdata, torch::Tensor vscale, std::vector<torch::Tensor> noise,
                              std::vector<int64_t> noise_off, int64_t vdtype, int64_t chunk, double lr, double wd, double beta, double bc1,
                              double bc2, double eps, bool from_state, bool first, bool moments, int64_t b0,
                              int64_t b1, torch::Tensor acc, const PreBlock* pre, bool before_block = false) {
  const int64_t n = w.numel();
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == torch::kFloat32, "host_fold: masters must be contiguous fp32");
  TORCH_CHECK(chunk % kBlock == 0, "host_fold: the chunk must be a multiple of the block");
  for (const auto* t : {&m, &v2}) {
    TORCH_CHECK(t->numel() == 0 || (t->numel() == n && t->is_contiguous() && t->scalar_type() == torch::kFloat32),
                "host_fold: Adam moments must be contiguous fp32 like the masters");
  }
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  if (b1 < 0) b1 = blocks;
  // The snapshot: of the whole partition, or of the folded range only (its values from b0's first)
  const int64_t range = std::min(n, b1 * kBlock) - std::min(n, b0 * kBlock);
  TORCH_CHECK(before.numel() == 0 || ((before.numel() == n || before.numel() == range) && before.is_contiguous() &&
                                      before.scalar_type() == torch::kFloat32),
              "host_fold: the snapshot must be contiguous fp32, of the partition or of the folded range");
  TORCH_CHECK(from_state ? (m.numel() == n && v2.numel() == n) : (before_block || before.numel() > 0),
              "host_fold: from_state needs the moments, else the snapshot");
  TORCH_CHECK(vdtype >= 0 && vdtype <= 2, "host_fold: velocity dtype code must be 0, 1 or 2");
  if (vdtype == 2) {
    TORCH_CHECK(vscale.numel() >= blocks && vdata.numel() >= blocks * kBlock, "host_fold: int8 buffer too small");
    TORCH_CHECK(static_cast<int64_t>(noise.size()) == (n + chunk - 1) / chunk, "host_fold: one noise tensor per chunk");
    TORCH_CHECK(noise_off.size() == noise.size(), "host_fold: one noise offset per chunk (-1: read the tensor)");
    for (const int64_t off : noise_off)
      TORCH_CHECK(off >= -1 && off < kNoisePeriod, "host_fold: a noise offset lies in the table's period or is -1");
  } else {
    TORCH_CHECK(vdata.numel() >= n, "host_fold: velocity buffer too small");
  }
  std::vector<const float*> noise_ptr;
  for (int64_t c = 0; c < static_cast<int64_t>(noise.size()); ++c) {
    const auto& t = noise[c];
    const int64_t len = std::min(chunk, n - c * chunk);
    TORCH_CHECK(t.is_contiguous() && t.scalar_type() == torch::kFloat32 && t.numel() >= (len + kBlock - 1) / kBlock * kBlock,
                "host_fold: each chunk's noise must be contiguous fp32 covering its whole blocks");
    noise_ptr.push_back(t.data_ptr<float>());
  }
  Args A;
  A.w = w.data_ptr<float>();
  A.m = ptr_or_null(m);
  A.v2 = ptr_or_null(v2);
  A.before = ptr_or_null(before);
  A.before_off = before.numel() == n ? 0 : b0 * kBlock;
  A.before_block = before_block;
  A.v32 = vdtype == 0 ? vdata.data_ptr<float>() : nullptr;
  A.v16 = vdtype == 1 ? vdata.data_ptr<at::BFloat16>() : nullptr;
  A.v8 = vdtype == 2 ? vdata.data_ptr<int8_t>() : nullptr;
  A.scale = vdtype == 2 ? vscale.data_ptr<float>() : nullptr;
  A.noise = &noise_ptr;
  A.noise_off = &noise_off;
  A.n = n;
  A.chunk = chunk;
  // Scalars as the torch path's fp32 kernels see them (a Python float becomes the op's float).
  A.lr = static_cast<float>(lr);
  A.bc1 = static_cast<float>(bc1);
  A.bc2 = static_cast<float>(bc2);
  A.eps = static_cast<float>(eps);
  A.beta = static_cast<float>(beta);
  A.decay = static_cast<float>(-lr * wd / (1.0 - lr * wd));
  A.neg_lr = static_cast<float>(-lr);
  A.inv_lr = static_cast<float>(1.0 / lr);
  A.mix = static_cast<float>((1.0 - beta) / lr);
  A.moments = moments;
  const bool decay = from_state && wd != 0.0;
  const BlocksFn run = vdtype == 0 ? pick<0>(from_state, decay, first)
                       : vdtype == 1 ? pick<1>(from_state, decay, first) : pick<2>(from_state, decay, first);
  TORCH_CHECK(0 <= b0 && b0 <= b1 && b1 <= blocks && b0 % kGroup == 0 && (b1 % kGroup == 0 || b1 == blocks),
              "host_fold: the block range must lie in the partition and start and end on a group boundary");
  TORCH_CHECK(acc.is_contiguous() && acc.scalar_type() == torch::kFloat64 && acc.numel() == 6,
              "host_fold: acc must be 6 contiguous fp64 sums");
  // Fixed groups of kGroup blocks, summed each from zero (in parallel), then in order.
  const int64_t groups = (b1 - b0 + kGroup - 1) / kGroup;
  std::vector<Sums> partial(groups);
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t e = std::min(b1, b0 + (g + 1) * kGroup);
      if (pre == nullptr) {
        run(A, b0 + g * kGroup, e, partial[g]);
        continue;
      }
      for (int64_t b = b0 + g * kGroup; b < e; ++b) {   // each block's own work first, then its fold
        (*pre)(b);
        run(A, b, b + 1, partial[g]);
      }
    }
  });
  double* t = acc.data_ptr<double>();
  for (const auto& s : partial) {
    t[0] += s.dv; t[1] += s.vv; t[2] += s.dd; t[3] += s.ww; t[4] += s.m_abs; t[5] += s.v_sqrt;
  }
  return {t[0], t[1], t[2], t[3], t[4], t[5]};
}

std::vector<double> fold(torch::Tensor w, torch::Tensor m, torch::Tensor v2, torch::Tensor before,
                         torch::Tensor vdata, torch::Tensor vscale, std::vector<torch::Tensor> noise,
                         std::vector<int64_t> noise_off, int64_t vdtype, int64_t chunk, double lr, double wd,
                         double beta, double bc1, double bc2, double eps, bool from_state, bool first, bool moments,
                         int64_t b0, int64_t b1, torch::Tensor acc) {
  return fold_core(w, m, v2, before, vdata, vscale, noise, noise_off, vdtype, chunk, lr, wd, beta, bc1, bc2, eps,
                   from_state, first, moments, b0, b1, acc, nullptr);
}

// ---------------------------------------------------------------------------------------------
// x += c * v for each coefficient c in order, x in host memory: a drift Predict step's update of
// a copy of the weights (zero_access.apply_velocity_update on the fp32 masters; the device path's
// DevicePredict._add_to_shards where the 16-bit partition lives in host memory: ZeRO 3 with
// offload_param: cpu, or DeepSpeed's CPU accelerator) and a kept run's commit into the fp32
// masters (DevicePredict._add_to_masters). The torch path dequantises a chunk of the velocity,
// widens the 16-bit chunk to fp32, adds and narrows it back: some 29 bytes of traffic per value
// and step. Here each value is read and written once. The arithmetic is the torch path's: the
// add with alpha is a fused multiply-add (vec::fmadd), and a 16-bit copy is rounded to 16 bits
// (nearest even) after every step, as its fp32 work chunk is copied back after every step.
// ---------------------------------------------------------------------------------------------

template <typename T, int VD>
void shift_blocks(T* x, const void* vdata, const float* vscale, const std::vector<float>& coefs, int64_t n,
                  int64_t b0, int64_t b1, double* sumsq) {
  float vbuf[kBlock], w[kBlock];
  double sq = 0;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t i0 = b * kBlock, len = std::min(kBlock, n - i0);
    const float* __restrict__ v = vbuf;
    if constexpr (VD == 0) {
      v = static_cast<const float*>(vdata) + i0;
    } else if constexpr (VD == 1) {
      const auto* src = static_cast<const at::BFloat16*>(vdata) + i0;
      for (int64_t j = 0; j < len; ++j) vbuf[j] = static_cast<float>(src[j]);
    } else {   // int8 x the block's scale (quant.CompactBuffer.load: float(q) * scale)
      const auto* src = static_cast<const int8_t*>(vdata) + i0;
      const float s = vscale[b];
      for (int64_t j = 0; j < len; ++j) vbuf[j] = static_cast<float>(src[j]) * s;
    }
    if (sumsq != nullptr) {
      float acc[kLanes] = {0};
      int64_t j0 = 0;
      for (; j0 + kLanes <= len; j0 += kLanes)
        for (int l = 0; l < kLanes; ++l) acc[l] += v[j0 + l] * v[j0 + l];
      for (int64_t j = j0; j < len; ++j) acc[0] += v[j] * v[j];
      for (int l = 0; l < kLanes; ++l) sq += acc[l];
    }
    if constexpr (std::is_same<T, float>::value) {   // fp32: in place, one fused multiply-add per step
      float* __restrict__ xf = x + i0;
      for (const float c : coefs)
        for (int64_t j = 0; j < len; ++j) xf[j] = std::fma(v[j], c, xf[j]);
    } else {   // 16-bit: widened once, rounded back to 16 bits after every step as the torch path's copy
      for (int64_t j = 0; j < len; ++j) w[j] = static_cast<float>(x[i0 + j]);
      for (const float c : coefs)
        for (int64_t j = 0; j < len; ++j) w[j] = static_cast<float>(static_cast<T>(std::fma(v[j], c, w[j])));
      for (int64_t j = 0; j < len; ++j) x[i0 + j] = static_cast<T>(w[j]);
    }
  }
  if (sumsq != nullptr) *sumsq = sq;
}

template <typename T>
double shift_typed(torch::Tensor x, torch::Tensor vdata, torch::Tensor vscale, int64_t vdtype,
                   const std::vector<float>& coefs, bool want_sumsq) {
  const int64_t n = x.numel(), blocks = (n + kBlock - 1) / kBlock;
  T* xp = x.data_ptr<T>();
  const void* vp = vdata.data_ptr();
  const float* sp = vdtype == 2 ? vscale.data_ptr<float>() : nullptr;
  using Fn = void (*)(T*, const void*, const float*, const std::vector<float>&, int64_t, int64_t, int64_t, double*);
  const Fn run = vdtype == 0 ? shift_blocks<T, 0> : vdtype == 1 ? shift_blocks<T, 1> : shift_blocks<T, 2>;
  // A fixed split into one range of blocks per thread, as the fold's: the sum of squares adds up
  // in the same order on every call with the same thread count.
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), blocks));
  std::vector<double> partial(parts, 0.0);
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      run(xp, vp, sp, coefs, n, blocks * p / parts, blocks * (p + 1) / parts, want_sumsq ? &partial[p] : nullptr);
  });
  double total = 0;
  for (const double s : partial) total += s;
  return total;
}

// Returns sum v.v over the values (fp64 over blocks of fp32 lanes) when asked, else 0.
double shift(torch::Tensor x, torch::Tensor vdata, torch::Tensor vscale, int64_t vdtype, std::vector<double> coefs,
             bool sumsq) {
  const int64_t n = x.numel();
  TORCH_CHECK(x.is_contiguous() && x.device().is_cpu(), "host_shift: the weights must be contiguous, in host memory");
  TORCH_CHECK(vdtype >= 0 && vdtype <= 2, "host_shift: velocity dtype code must be 0, 1 or 2");
  const auto want = vdtype == 0 ? torch::kFloat32 : vdtype == 1 ? torch::kBFloat16 : torch::kInt8;
  TORCH_CHECK(vdata.is_contiguous() && vdata.scalar_type() == want && vdata.numel() >= n,
              "host_shift: the velocity buffer does not match its dtype code or is too small");
  if (vdtype == 2)
    TORCH_CHECK(vscale.is_contiguous() && vscale.scalar_type() == torch::kFloat32 &&
                    vscale.numel() >= (n + kBlock - 1) / kBlock,
                "host_shift: one fp32 scale per int8 block is needed");
  std::vector<float> c;   // (a Python float becomes the op's fp32 alpha, as in torch's add_)
  for (const double v : coefs)
    if (v != 0.0) c.push_back(static_cast<float>(v));   // the torch path skips a zero coefficient
  if (n == 0 || (c.empty() && !sumsq)) return 0.0;
  switch (x.scalar_type()) {
    case torch::kFloat32: return shift_typed<float>(x, vdata, vscale, vdtype, c, sumsq);
    case torch::kBFloat16: return shift_typed<at::BFloat16>(x, vdata, vscale, vdtype, c, sumsq);
    case torch::kFloat16: return shift_typed<at::Half>(x, vdata, vscale, vdtype, c, sumsq);
    default: TORCH_CHECK(false, "host_shift: the weights must be fp32, bf16 or fp16, not ", x.scalar_type());
  }
  return 0.0;
}

// A kept gradient Predict run's masters caught up with the 16-bit weights the run moved
// (grad_predict._catch_up): master = (master - round16(master)) + w, per value, in that order and
// with those two roundings, as the torch ops (sub_ then add_) compute it; round16 is torch's
// round-to-nearest-even narrowing. One pass: the master read and written once, w read once
// (the torch ops: five passes and two widened transients per chunk).
template <typename T>
void catch_up_typed(float* m, const T* w, int64_t n) {
  at::parallel_for(0, n, 1 << 15, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      const float r = static_cast<float>(static_cast<T>(m[i]));
      const float t = m[i] - r;
      m[i] = t + static_cast<float>(w[i]);
    }
  });
}

void catch_up(torch::Tensor master, torch::Tensor w) {
  TORCH_CHECK(master.is_contiguous() && master.device().is_cpu() && master.scalar_type() == torch::kFloat32,
              "host_catch_up: the master must be contiguous fp32 in host memory");
  TORCH_CHECK(w.is_contiguous() && w.device().is_cpu() && w.numel() == master.numel(),
              "host_catch_up: the weights must be contiguous, in host memory, as many as the master's");
  const int64_t n = master.numel();
  switch (w.scalar_type()) {
    case torch::kBFloat16: catch_up_typed<at::BFloat16>(master.data_ptr<float>(), w.data_ptr<at::BFloat16>(), n); break;
    case torch::kFloat16: catch_up_typed<at::Half>(master.data_ptr<float>(), w.data_ptr<at::Half>(), n); break;
    default: TORCH_CHECK(false, "host_catch_up: the weights must be bf16 or fp16, not ", w.scalar_type());
  }
}

// A gradient Predict step's update of a 16-bit partition in host memory (ZeRO 3 with
// offload_param: cpu; kernels.held_adam_step_reference): Adam's step from the run's first moment
// m and the held second moment v, the bf16 weight written back rounded stochastically. The torch
// reference's operations in its order, each rounded to fp32 as it rounds them:
//   denom = sqrt(v / bc2) + eps;  u = ((m / bc1) / denom) * (-lr);  u = fma(w, decay, u) (an add
//   with alpha, torch's vectorised fmadd);  w = w + u;  then quant.stochastic_round_bf16_: 16
//   random bits of (key, index) added to w's bits, the low 16 cleared, narrowed exactly.
// One pass: x read and written, m and v read (the torch ops: about twenty passes per chunk, most
// of them the random bits' int64 hash).

inline uint32_t sr_bits(uint32_t key, int64_t i) {   // quant.sr_bits: 16 random bits of value i
  const uint64_t u = static_cast<uint64_t>(i);
  return mix32(static_cast<uint32_t>(u & 0xFFFFFFFFu) ^ mix32(static_cast<uint32_t>(u >> 32) ^ key)) & 0xFFFFu;
}

template <typename S>
void held_adam_typed(at::BFloat16* x, const S* m, const S* v, int64_t n, float neg_lr, float bc1, float bc2,
                     float eps, float decay, uint32_t key) {
  at::parallel_for(0, n, 1 << 14, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      const float denom = std::sqrt(static_cast<float>(v[i]) / bc2) + eps;
      float u = ((static_cast<float>(m[i]) / bc1) / denom) * neg_lr;
      float w = static_cast<float>(x[i]);
      if (decay != 0.0f) u = std::fma(w, decay, u);
      w = w + u;
      uint32_t bits;
      std::memcpy(&bits, &w, sizeof bits);
      bits = (bits + sr_bits(key, i)) & 0xFFFF0000u;   // (int32 addition: wraps as torch's add_)
      std::memcpy(&w, &bits, sizeof w);
      x[i] = static_cast<at::BFloat16>(w);   // exact: the dropped bits are zero
    }
  });
}

void held_adam(torch::Tensor x, torch::Tensor m, torch::Tensor v, double lr, double bc1, double bc2, double eps,
               double decay, int64_t key) {
  TORCH_CHECK(x.is_contiguous() && x.device().is_cpu() && x.scalar_type() == torch::kBFloat16,
              "host_held_adam: the weights must be contiguous bf16 in host memory");
  TORCH_CHECK(m.is_contiguous() && v.is_contiguous() && m.device().is_cpu() && v.device().is_cpu() &&
                  m.scalar_type() == v.scalar_type() && m.numel() == x.numel() && v.numel() == x.numel(),
              "host_held_adam: the moments must be contiguous, in host memory, of one dtype and as many as x");
  const int64_t n = x.numel();
  // (the Python floats become the torch ops' fp32 scalars)
  const float neg_lr = static_cast<float>(-lr), b1 = static_cast<float>(bc1), b2 = static_cast<float>(bc2);
  const float e = static_cast<float>(eps), d = static_cast<float>(decay);
  const uint32_t k = static_cast<uint32_t>(key & 0xFFFFFFFF);
  switch (m.scalar_type()) {
    case torch::kFloat32:
      held_adam_typed<float>(x.data_ptr<at::BFloat16>(), m.data_ptr<float>(), v.data_ptr<float>(), n, neg_lr, b1,
                             b2, e, d, k);
      break;
    case torch::kBFloat16:
      held_adam_typed<at::BFloat16>(x.data_ptr<at::BFloat16>(), m.data_ptr<at::BFloat16>(),
                                    v.data_ptr<at::BFloat16>(), n, neg_lr, b1, b2, e, d, k);
      break;
    default: TORCH_CHECK(false, "host_held_adam: the moments must be fp32 or bf16, not ", m.scalar_type());
  }
}

// ---------------------------------------------------------------------------------------------
// DeepSpeed's CPU Adam step with a kept run's commit before it and the fold after it, one pass
// (memory.fold_in_step, ds_hybrid/step_fusion.py). Under ZeRO-Offload DeepSpeed's step is bound by
// memory (28 bytes a value); the fold's arithmetic, as a pass of its own, reads the masters and
// moments again. Here each block of 256 values takes the commit's additions, then Adam's update,
// then the fold, while it is in L1: the fold adds its arithmetic and the velocity's bytes, not a
// second read of the partition.
//
// Adam's update is DeepSpeed's Step_AVX, value by value (csrc/includes/cpu_adam.h, 0.19.8): the same
// IEEE operations in the same order, its fused multiply-adds as std::fma (this file is built with
// -ffp-contract=off, so nothing else is fused), so every value is what DeepSpeed's SIMD lanes
// compute. The scalars (``adam``: beta1, beta2, 1 - beta1, 1 - beta2, the bias correction of the
// second moment, eps, the step size, the decoupled decay, the L2 decay) are DeepSpeed's own for
// the step, as step_fusion.AdamScalars mirrors them. The range covers whole groups only, a multiple
// of every SIMD width: DeepSpeed's scalar tail, at a partition's end, stays with DeepSpeed.
// The commit: ``cdata`` / ``cscale`` (dtype code ``cdtype``) with ``coefs`` in order, as shift().
// ``displacement``: the fold takes the block's own move, its weights copied (after the commit, in L1)
// just before the update, as fold() from a snapshot; else it rebuilds the update from the moments
// as fold() from the state does (three divisions and a square root a value more).
// ---------------------------------------------------------------------------------------------

struct AdamScalars {
  float b1, b2, omb1, omb2, bias2, eps, step_size, w_decay, l2;
};

// One block of DeepSpeed's Step_AVX, value by value (see above).
template <bool L2, bool DECAY>
void adam_block(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m, float* __restrict__ v,
                const AdamScalars& S) {
  const float b1 = S.b1, b2 = S.b2, omb1 = S.omb1, omb2 = S.omb2, bias2 = S.bias2, eps = S.eps,
              step_size = S.step_size, w_decay = S.w_decay, l2 = S.l2;
  for (int64_t j = 0; j < kBlock; ++j) {
    float grad = g[j];
    float param = p[j];
    if (L2) grad = std::fma(param, l2, grad);
    float mom = m[j] * b1;
    mom = std::fma(grad, omb1, mom);
    float var = v[j] * b2;
    const float g2 = grad * grad;
    var = std::fma(g2, omb2, var);
    float upd = std::sqrt(var);
    upd = std::fma(upd, bias2, eps);
    upd = mom / upd;
    if (DECAY) param = std::fma(param, w_decay, param);
    p[j] = std::fma(upd, step_size, param);
    m[j] = mom;
    v[j] = var;
  }
}

std::vector<double> adam_fold(torch::Tensor p, torch::Tensor g, torch::Tensor m, torch::Tensor v,
                              std::vector<double> adam, torch::Tensor cdata, torch::Tensor cscale, int64_t cdtype,
                              std::vector<double> coefs, torch::Tensor vdata, torch::Tensor vscale,
                              std::vector<torch::Tensor> noise, std::vector<int64_t> noise_off, int64_t vdtype,
                              int64_t chunk, double lr, double wd,
                              double beta, double bc1, double bc2, double eps, bool first, bool moments,
                              int64_t b1, torch::Tensor acc, bool displacement) {
  const int64_t n = p.numel();
  for (const auto* t : {&p, &g, &m, &v}) {
    TORCH_CHECK(t->is_contiguous() && t->device().is_cpu() && t->scalar_type() == torch::kFloat32 &&
                t->numel() == n, "host_adam_fold: weights, gradient and moments must be contiguous fp32 in host "
                "memory, of one length");
  }
  TORCH_CHECK(adam.size() == 9, "host_adam_fold: nine Adam scalars");
  TORCH_CHECK(b1 % kGroup == 0 && b1 * kBlock <= n, "host_adam_fold: whole groups only");
  TORCH_CHECK(coefs.empty() || (cdtype >= 0 && cdtype <= 2 && cdata.is_contiguous() && cdata.numel() >= b1 * kBlock &&
                                (cdtype != 2 || cscale.numel() >= b1)),
              "host_adam_fold: the commit's velocity does not cover the range");
  const AdamScalars S{static_cast<float>(adam[0]), static_cast<float>(adam[1]), static_cast<float>(adam[2]),
                      static_cast<float>(adam[3]), static_cast<float>(adam[4]), static_cast<float>(adam[5]),
                      static_cast<float>(adam[6]), static_cast<float>(adam[7]), static_cast<float>(adam[8])};
  const float w_decay = S.w_decay, l2 = S.l2;
  float* P = p.data_ptr<float>();
  const float* G = g.data_ptr<float>();
  float* M = m.data_ptr<float>();
  float* V = v.data_ptr<float>();
  std::vector<float> cf(coefs.begin(), coefs.end());
  const void* cp = coefs.empty() ? nullptr : cdata.data_ptr();
  const float* cs = cdtype == 2 && !coefs.empty() ? cscale.data_ptr<float>() : nullptr;
  const PreBlock pre = [&](int64_t b) {
    const int64_t i0 = b * kBlock;
    if (!cf.empty()) {
      if (cdtype == 0) shift_blocks<float, 0>(P, cp, cs, cf, n, b, b + 1, nullptr);
      else if (cdtype == 1) shift_blocks<float, 1>(P, cp, cs, cf, n, b, b + 1, nullptr);
      else shift_blocks<float, 2>(P, cp, cs, cf, n, b, b + 1, nullptr);
    }
    if (displacement) std::memcpy(tl_before, P + i0, sizeof tl_before);   // (after the commit: the step's own move)
    if (l2 != 0.0f) adam_block<true, false>(P + i0, G + i0, M + i0, V + i0, S);
    else if (w_decay != 0.0f) adam_block<false, true>(P + i0, G + i0, M + i0, V + i0, S);
    else adam_block<false, false>(P + i0, G + i0, M + i0, V + i0, S);
  };
  return fold_core(p, m, v, torch::empty({0}, p.options()), vdata, vscale, noise, noise_off, vdtype, chunk, lr, wd,
                   beta, bc1, bc2, eps, !displacement, first, moments, 0, b1, acc, &pre, displacement);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  // The GIL is released for the pass: with memory.fold_overlap it runs on a host thread while the
  // main thread launches the next step's forward and backward (the arguments are converted first).
  mod.def("fold", &fold, "the drift velocity's fold on host masters, one pass (see host_fold.cpp)",
          pybind11::call_guard<pybind11::gil_scoped_release>());
  // Released too: a kept run's commit runs on a host thread (memory.commit_overlap).
  mod.def("shift", &shift, "x += c v for each step's coefficient, one pass (see host_fold.cpp)",
          pybind11::call_guard<pybind11::gil_scoped_release>());
  // Released too: the gradient run's commit runs on a host thread (memory.commit_overlap).
  mod.def("catch_up", &catch_up, "master = (master - round16(master)) + w, one pass (see host_fold.cpp)",
          pybind11::call_guard<pybind11::gil_scoped_release>());
  // Released too, as DeepSpeed's own step releases it.
  mod.def("adam_fold", &adam_fold, "DeepSpeed's CPU Adam step with the commit and the fold, one pass",
          pybind11::call_guard<pybind11::gil_scoped_release>());
  // Released too: the main thread's gradient Predict step, but the GIL is not needed for it.
  mod.def("held_adam", &held_adam, "Adam's step with the second moment held, bf16 x rounded stochastically, one pass",
          pybind11::call_guard<pybind11::gil_scoped_release>());
}
