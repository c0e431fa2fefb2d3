// Fused Hajek decode over a compressed KV cache, CPU (see kvcert/kernels/cpu/__init__.py).
//
// For one (batch, KV head) the G = g * t query rows of the group share one read of K and V:
//
//   s_ir  = tau q_r . k_i - log pi_i              (-inf on padding: the slot is skipped)
//   a_ir  = softmax_i(s_ir),  lse_r = logsumexp_i s_ir,  o_r = sum_i a_ir v_i
//   c_ir  = (1 - pi_i) a_ir^2
//   trace_r = sum_i c_ir ||v_i - o_r||^2
//           = sum_i c_ir ||v_i - mu||^2 - 2 (o_r - mu) . sum_i c_ir (v_i - mu) + ||o_r - mu||^2 sum_i c_ir
//
// The slots are cut into `splits` ranges per head (flash-decoding's split-K, so that a few heads fill
// every thread). Each range keeps, per row, online-softmax sums relative to its running max m:
// l = sum p, o = sum p v, P2 = sum p^2, C = sum w, S = sum w (v - mu), R = sum w ||v - mu||^2 (and
// per coordinate sum w (v - mu)^2), with p = e^{s - m}, w = (1 - pi) p^2 and mu the range's centre
// (the caller's value centre, else the range's first kept value). The merge rescales the
// ranges to the global max and evaluates the centred form above once o is known: K and V are read
// from memory once, and the centring keeps the fp32 expansion well conditioned.
//
// Threads: at::parallel_for over (head, range) tasks, then over rows for the merge, so the op runs
// on torch's intra-op pool (at::get_num_threads(); built with -fopenmp, which at::parallel_for needs to
// run in parallel at all, sharing torch's libgomp). Vector code: register-blocked micro-kernels on
// vector types as wide as the machine's registers for head dimensions 64 and 128 (scores: a few query
// rows against each key row; values: [p; w] times the tile's value rows, the accumulators in
// registers), `#pragma omp simd` loops otherwise, -march=native.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kTile = 64;     // slots per score tile (scores and weights stay in L1)
constexpr int64_t kHead = 8;      // scalars at the head of a partial row: m, l, C, R, P2 (padded; the sketch's
                                  // pass: P[5] = the range's largest ||v - mu||^2 over its kept slots, and the HT
                                  // trace's sums C_ht = sum (1 - pi) p^2 in P[6], R_ht = sum (1 - pi) p^2 r in P[7])
constexpr int64_t kMinSplit = 256;  // slots per range at least
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kInf = std::numeric_limits<float>::infinity();

// x as float32 and contiguous: x itself when it already is (no dispatcher call on the per-step path), else a copy.
inline at::Tensor f32_contiguous(const at::Tensor& x) {
  return x.scalar_type() == at::kFloat && x.is_contiguous() ? x : x.to(at::kFloat).contiguous();
}

// x as float32, any strides: x itself when it already is.
inline at::Tensor as_f32(const at::Tensor& x) { return x.scalar_type() == at::kFloat ? x : x.to(at::kFloat); }

inline float bf16_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// A row of `len` values as float: the row itself for float32, converted into `buf` for bfloat16.
inline const float* as_float(const float* src, int64_t, float*) { return src; }
inline const float* as_float(const c10::BFloat16* src, int64_t len, float* buf) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t x = 0; x < len; ++x) buf[x] = bf16_to_float(s[x]);
  return buf;
}

// e^x for x <= 0 (x = -inf gives 0): Cephes' single-precision expf (x = n ln2 + r, |r| <= ln2 / 2,
// degree-6 polynomial in r, about 1 ulp), branch-free so that the loops calling it vectorize.
// Below -87 (e^x < 1.7e-38, about FLT_MIN) the result is 0.
__attribute__((always_inline)) inline float exp_nonpos(float x) {
  const float xc = x < -87.0f ? -87.0f : x;
  const float fn = std::floor(xc * 1.44269504088896341f + 0.5f);  // 1 / ln 2
  float r = xc - fn * 0.693359375f;                                 // ln 2, high part (exact product)
  r = r - fn * -2.12194440e-4f;                                     // ln 2, low part
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(fn) + 127) << 23;  // 2^n
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return x < -87.0f ? 0.0f : p * two_n;
}

// 1 - e^x = -expm1(x) for x <= 0 (x = -inf gives 1), to a few ulp relative: the Taylor series of
// expm1 to x^9 / 9! above -0.5 (no cancellation as x -> 0, i.e. pi -> 1), 1 - e^x below. Branch-free.
__attribute__((always_inline)) inline float one_minus_exp(float x) {
  float p = 1.0f / 362880.0f;
  p = p * x + 1.0f / 40320.0f;
  p = p * x + 1.0f / 5040.0f;
  p = p * x + 1.0f / 720.0f;
  p = p * x + 1.0f / 120.0f;
  p = p * x + 1.0f / 24.0f;
  p = p * x + 1.0f / 6.0f;
  p = p * x + 0.5f;
  p = p * x + 1.0f;
  const float small = 0.0f - p * (x > -0.5f ? x : -0.5f);
  const float large = 1.0f - exp_nonpos(x);  // both sides computed: a select, no branch, so the loop vectorizes
  return x > -0.5f ? small : large;
}

struct Shape {
  int64_t H, h_kv, G, n, d, dv, splits, stride;
  bool per_coord;
  // the cluster (sketch) design's kept pass: w = pi (1 - pi) p^2 (the c' rows) and, in the place of
  // P2 = sum p^2, K = sum pi p (the kept share kappa = K / l); beside them the HT trace's rows
  // w_ht = (1 - pi) p^2 (P[6], P[7] and a third dv-vector S_ht = sum w_ht (v - mu)); see hajek_decode_sketch
  bool sketch = false;
  // the quantized pass (hajek_decode_quantized): K and V dequantized from int8 codes and float16 scales in the
  // tile loop (QuantKV); beside the trace's sums, the rounding variance's: P[5] = sum p^2 e_v (the value term),
  // P[6] = sum wq, P[7] = sum wq ||v - mu||^2 and a third dv-vector sum wq (v - mu), wq = sigma2 p^2. Combined
  // (the rule's variance trace + V_q only): wq added to the trace's weights w instead (no third vector), P[5] as above
  bool quant = false, combined = false;
  // a logit softcap c > 0 (Gemma 2): each score is c tanh(tau q.k / c) before the offset -log pi (0: none)
  float softcap = 0.0f;
};

// Strided views of the inputs: head (b, h) starts at base + b * sb + h * sh; slot i at + i * sn.
template <typename T>
struct Heads {
  const T* base;
  int64_t sb, sh, sn;
  const T* head(int64_t bh, int64_t h_kv) const { return base + (bh / h_kv) * sb + (bh % h_kv) * sh; }
};

template <typename T>
Heads<T> heads(const at::Tensor& x) {
  return {x.data_ptr<T>(), x.stride(0), x.stride(1), x.stride(2)};
}

// ---------------------------------------------------------------------------------------------
// Vector registers as GCC/Clang vector extensions, as wide as the machine's: 16 floats (one zmm)
// with AVX-512, 8 floats (one ymm) otherwise (AVX2; two q registers with NEON). The micro-kernels
// size their register blocks by kRegs, the vector registers the ISA has, so that their accumulators
// stay in registers (a 16-float type on AVX2 takes two ymm per value and spilled every accumulator
// of the value loop: 5-9x slower than SDPA on the same slots).
#if defined(__AVX512F__)
#define KVCERT_VW 16
constexpr int kRegs = 32;
#else
#define KVCERT_VW 8
constexpr int kRegs = 16;
#endif
typedef float vf __attribute__((vector_size(KVCERT_VW * 4)));
typedef int32_t vi __attribute__((vector_size(KVCERT_VW * 4)));
constexpr int64_t kW = KVCERT_VW;

inline vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void vstore(float* p, const vf& v) { std::memcpy(p, &v, sizeof v); }
#if defined(__clang__)
#define KVCERT_SHUFFLE(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define KVCERT_SHUFFLE(v, ...) __builtin_shuffle(v, vi{__VA_ARGS__})
#endif
inline float hsum(vf v) {  // the lanes' sum by a shuffle tree
#if KVCERT_VW == 16
  v += KVCERT_SHUFFLE(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += KVCERT_SHUFFLE(v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += KVCERT_SHUFFLE(v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += KVCERT_SHUFFLE(v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
#else
  v += KVCERT_SHUFFLE(v, 4, 5, 6, 7, 0, 1, 2, 3);
  v += KVCERT_SHUFFLE(v, 2, 3, 0, 1, 6, 7, 4, 5);
  v += KVCERT_SHUFFLE(v, 1, 0, 3, 2, 5, 4, 7, 6);
#endif
  return v[0];
}

// One tile of `cnt` kept slots as float rows (krow[j], vrow[j]), its offsets -log pi and 1 - pi.
struct Tile {
  int64_t cnt;
  const float* const* krow;
  const float* const* vrow;
  const float* off;
  const float* omp;
};

// Scores sc[r * kTile + j] = q_r . k_j + off_j for rows r0 .. r0 + RB - 1 (q already scaled).
// (The query rows are held in registers where RB rows and a key row fit, else read from L1.)
template <int64_t D, int RB>
void scores_block(const float* q, const Tile& t, float* sc) {
  constexpr int64_t NV = D / kW;
  constexpr bool HOLD = (RB + 1) * NV + 2 <= kRegs;
  vf qv[HOLD ? RB : 1][NV];
  if (HOLD)
    for (int r = 0; r < RB; ++r)
      for (int64_t u = 0; u < NV; ++u) qv[HOLD ? r : 0][u] = vload(q + r * D + u * kW);
  for (int64_t j = 0; j < t.cnt; ++j) {
    const float* k = t.krow[j];
    for (int r = 0; r < RB; ++r) {
      vf a = vf{}, b = vf{};
      for (int64_t u = 0; u < NV; ++u)
        (u & 1 ? b : a) += (HOLD ? qv[HOLD ? r : 0][u] : vload(q + r * D + u * kW)) * vload(k + u * kW);
      sc[r * kTile + j] = hsum(a + b) + t.off[j];
    }
  }
}

template <int64_t D>
void scores_fixed(const float* q, int64_t G, const Tile& t, float* sc) {
  // the query rows of one block: as many as fit in registers beside a key row (at least 1, at most 4)
  constexpr int RBMAX = std::max<int>(1, std::min<int>(4, (kRegs - 2) / static_cast<int>(D / kW) - 1));
  for (int64_t r0 = 0; r0 < G; r0 += RBMAX) {
    const float* qr = q + r0 * D;
    float* s = sc + r0 * kTile;
    switch (std::min<int64_t>(RBMAX, G - r0)) {
      case 4: scores_block<D, 4>(qr, t, s); break;
      case 3: scores_block<D, 3>(qr, t, s); break;
      case 2: scores_block<D, 2>(qr, t, s); break;
      default: scores_block<D, 1>(qr, t, s); break;
    }
  }
}

void scores_generic(const float* q, int64_t G, int64_t d, const Tile& t, float* sc) {
  for (int64_t j = 0; j < t.cnt; ++j) {
    const float* k = t.krow[j];
    for (int64_t r = 0; r < G; ++r) {
      const float* qr = q + r * d;
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int64_t x = 0; x < d; ++x) acc += qr[x] * k[x];
      sc[r * kTile + j] = acc + t.off[j];
    }
  }
}

constexpr int64_t pow2_floor(int64_t x) { return x < 2 ? 1 : 2 * pow2_floor(x / 2); }

// Values for rows r0 .. r0 + RB - 1: o += p v and S += w (v - mu) (and, per coordinate,
// Rd += w (v - mu)^2; or, with HT, the HT trace's S_ht += w2 (v - mu)) accumulated over the tile in
// registers, then added to the partial rows. The value dimensions go in chunks of CH vectors, so that
// RB rows' accumulators of one chunk, the chunk's centre and its value row fit in the registers (all
// of them with AVX-512 at dv = 64).
template <int64_t DV, int RB, bool PER_COORD, bool HT = false>
void values_block(const Tile& t, const float* p, const float* w, const float* ref, float* part, int64_t stride,
                  const float* w2 = nullptr) {
  static_assert(!(PER_COORD && HT), "the third accumulator is either the per-coordinate or the HT one");
  constexpr bool THIRD = PER_COORD || HT;
  constexpr int64_t NV = DV / kW;
  constexpr int64_t PER = (THIRD ? 3 : 2) * RB + 3;  // registers per vector of a chunk
  constexpr int64_t CH = pow2_floor(std::max<int64_t>(1, std::min<int64_t>(NV, (kRegs - 2) / PER)));
  static_assert(NV % CH == 0, "chunks tile the value row");
  for (int64_t u0 = 0; u0 < NV; u0 += CH) {
    vf o[RB][CH], s[RB][CH], rd[THIRD ? RB : 1][CH], mu[CH];
    for (int64_t u = 0; u < CH; ++u) {
      mu[u] = vload(ref + (u0 + u) * kW);
      for (int r = 0; r < RB; ++r) o[r][u] = s[r][u] = rd[THIRD ? r : 0][u] = vf{};
    }
    for (int64_t j = 0; j < t.cnt; ++j) {
      const float* v = t.vrow[j] + u0 * kW;
      for (int64_t u = 0; u < CH; ++u) {
        const vf vv = vload(v + u * kW);
        const vf c = vv - mu[u];  // centred in the sum itself: no S - mu C cancellation
        for (int r = 0; r < RB; ++r) {
          const float pj = p[r * kTile + j], wj = w[r * kTile + j];
          o[r][u] += pj * vv;
          s[r][u] += wj * c;
          if (PER_COORD) rd[r][u] += wj * (c * c);
          if (HT) rd[THIRD ? r : 0][u] += w2[r * kTile + j] * c;
        }
      }
    }
    for (int r = 0; r < RB; ++r) {
      float* P = part + r * stride + kHead + u0 * kW;
      for (int64_t u = 0; u < CH; ++u) {
        vstore(P + u * kW, vload(P + u * kW) + o[r][u]);
        vstore(P + DV + u * kW, vload(P + DV + u * kW) + s[r][u]);
        if (THIRD) vstore(P + 2 * DV + u * kW, vload(P + 2 * DV + u * kW) + rd[THIRD ? r : 0][u]);
      }
    }
  }
}

template <int64_t DV, bool PER_COORD, bool HT = false>
void values_fixed(int64_t G, const Tile& t, const float* p, const float* w, const float* ref, float* part,
                  int64_t stride, const float* w2 = nullptr) {
  // three rows per block: their accumulators of one chunk beside the chunk's value row and centre
  constexpr int RBMAX = 3;
  for (int64_t r0 = 0; r0 < G; r0 += RBMAX) {
    const int64_t o = r0 * kTile;
    float* P = part + r0 * stride;
    const float* w2o = HT ? w2 + o : nullptr;
    switch (std::min<int64_t>(RBMAX, G - r0)) {
      case 3: values_block<DV, 3, PER_COORD, HT>(t, p + o, w + o, ref, P, stride, w2o); break;
      case 2: values_block<DV, 2, PER_COORD, HT>(t, p + o, w + o, ref, P, stride, w2o); break;
      default: values_block<DV, 1, PER_COORD, HT>(t, p + o, w + o, ref, P, stride, w2o); break;
    }
  }
}

template <bool PER_COORD, bool HT = false>
void values_generic(int64_t G, int64_t dv, const Tile& t, const float* p, const float* w, const float* ref,
                    float* part, int64_t stride, const float* w2 = nullptr) {
  for (int64_t j = 0; j < t.cnt; ++j) {
    const float* v = t.vrow[j];
    for (int64_t r = 0; r < G; ++r) {
      const float pj = p[r * kTile + j], wj = w[r * kTile + j];
      float* o = part + r * stride + kHead;
      float* s = o + dv;
#pragma omp simd
      for (int64_t x = 0; x < dv; ++x) {
        o[x] += pj * v[x];
        s[x] += wj * (v[x] - ref[x]);
      }
      if (PER_COORD) {
        float* rd = s + dv;
#pragma omp simd
        for (int64_t x = 0; x < dv; ++x) rd[x] += wj * (v[x] - ref[x]) * (v[x] - ref[x]);
      }
      if (HT) {
        const float hj = w2[r * kTile + j];
        float* sh = s + dv;
#pragma omp simd
        for (int64_t x = 0; x < dv; ++x) sh[x] += hj * (v[x] - ref[x]);
      }
    }
  }
}

// r2_j = ||v_j - mu||^2 for the tile's value rows.
template <int64_t DV>
void sqdist_fixed(const Tile& t, const float* ref, float* r2) {
  constexpr int64_t NV = DV / kW;
  for (int64_t j = 0; j < t.cnt; ++j) {
    vf a = vf{}, b = vf{};
    for (int64_t u = 0; u < NV; ++u) {
      const vf c = vload(t.vrow[j] + u * kW) - vload(ref + u * kW);
      (u & 1 ? b : a) += c * c;
    }
    r2[j] = hsum(a + b);
  }
}

struct Scratch {
  std::vector<float> q, s, w, wh, kt, vt, off, omp, pf, r2, lt, od, pt;
  std::vector<const float*> krow, vrow;
  // the quantized pass: each kept slot's logit variance per row (sg, G x kTile) and value term (vv), the current
  // key group's scales as float (gs, d) and its logit variance per row (gsig, G), the rows' ||tau q||^2 (qn2, G)
  std::vector<float> sg, vv, gs, gsig, qn2;
  Scratch(const Shape& S)
      : q(S.G * S.d), s(S.G * kTile), w(S.G * kTile), wh(S.sketch || S.quant ? S.G * kTile : 0), kt(kTile * S.d),
        vt(kTile * S.dv), off(kTile), omp(kTile), pf(kTile), r2(kTile), lt(kTile), od(kTile), pt(kTile), krow(kTile),
        vrow(kTile), sg(S.quant ? S.G * kTile : 0), vv(S.quant ? kTile : 0), gs(S.quant ? S.d : 0),
        gsig(S.quant ? S.G : 0), qn2(S.quant ? S.G : 0), zero(S.softcap > 0.0f ? kTile : 0, 0.0f) {}
  std::vector<float> zero;  // the softcapped pass: the products are taken without the offsets, then capped
};

inline const float* row_ptr(const float* base, int64_t, float*) { return base; }
inline const float* row_ptr(const c10::BFloat16* base, int64_t len, float* buf) { return as_float(base, len, buf); }
inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 v) { return bf16_to_float(v.x); }

// Where slot i of one head's K and V lives. Dense: strided rows (the compressed cache's views).
template <typename T>
struct DenseKV {
  const T* K;
  int64_t ksn;
  const T* V;
  int64_t vsn;
  const float* key(int64_t i, int64_t d, float* buf) const { return row_ptr(K + i * ksn, d, buf); }
  const float* value(int64_t i, int64_t dv, float* buf) const { return row_ptr(V + i * vsn, dv, buf); }
  static constexpr bool kDirect = false;  // scores from key rows (scores_fixed)
  static constexpr bool kQuant = false;
};

// Paged (vLLM's CPU "vec" layout, kv_cache (num_blocks, h_kv, bs, 2 d)): slot i of a row lies in physical block
// ids[i / bs] at offset i % bs; per (block, KV head) the keys transposed [d, bs], then the values [bs, d].
// Scores (head sizes 64 and 128) are taken from the block's key matrix in place (run_scores), a key gathered
// with stride bs into the tile's buffer otherwise; a value row is read in place.
template <typename T>
struct PagedKV {
  const T* cache;
  int64_t sblk, head_off, bs, d;
  const int64_t* ids;
  const float* key(int64_t i, int64_t, float* buf) const {
    const T* base = cache + ids[i / bs] * sblk + head_off + (i % bs);
    for (int64_t x = 0; x < d; ++x) buf[x] = to_float(base[x * bs]);
    return buf;
  }
  const float* value(int64_t i, int64_t dv, float* buf) const {
    return row_ptr(cache + ids[i / bs] * sblk + head_off + bs * d + (i % bs) * dv, dv, buf);
  }
  // Slots of one block form a run: their keys are the columns of the block's [d, bs] key matrix.
  static constexpr bool kDirect = true;
  static constexpr bool kQuant = false;
  bool same_run(int64_t a, int64_t b) const { return a / bs == b / bs; }
  // The scores sc[r * kTile + j] = q_r . k_{i0 + j} of one run (j < len), read from the block's key matrix in
  // place: a row of it holds one dimension of kW consecutive slots, so the products go kW slots to a vector
  // instead of gathering each key's d values with stride bs into a row first (d scalar loads and stores per key:
  // the op's step took about 6 % longer that way at SmolLM2's shapes, 1k tokens, one AVX-512 thread). Bit for
  // bit scores_block's numbers: lane l of its accumulators a / b
  // sums dimensions l + kW u over even / odd u, in that order, and hsum adds the lanes by its tree; here C[l]
  // holds those sums for kW slots at once and the same tree adds them (float addition is commutative, and each
  // sum is formed by the same operations in the same order).
  template <int64_t D>
  void run_scores(int64_t i0, int64_t len, const float* q, int64_t G, float* sc) const {
    constexpr int64_t NV = D / kW;
    const T* base = cache + ids[i0 / bs] * sblk + head_off + (i0 % bs);
    for (int64_t j0 = 0; j0 < len; j0 += kW) {
      const int64_t nj = std::min<int64_t>(kW, len - j0);
      for (int64_t r = 0; r < G; ++r) {
        const float* qr = q + r * D;
        vf C[kW];
#pragma GCC unroll 16
        for (int64_t l = 0; l < kW; ++l) {
          vf a = vf{}, b = vf{};
#pragma GCC unroll 16
          for (int64_t u = 0; u < NV; ++u) {
            const int64_t x = u * kW + l;
            (u & 1 ? b : a) += qr[x] * load_slots(base + x * bs + j0);
          }
          C[l] = a + b;
        }
#pragma GCC unroll 8
        for (int64_t h = kW / 2; h >= 1; h /= 2)  // hsum's tree
#pragma GCC unroll 8
          for (int64_t l = 0; l < h; ++l) C[l] = C[l] + C[l + h];
        float* out = sc + r * kTile + j0;
        for (int64_t j = 0; j < nj; ++j) out[j] = C[0][j];
      }
    }
  }
  // kW consecutive values of a row of the block's key matrix as floats. Past the run's end (lanes the caller
  // never stores) it reads on into the next row, or after the last row into the block's values: inside the
  // same block of the cache, so always memory of the cache.
  static vf load_slots(const T* p) {
    if constexpr (std::is_same<T, float>::value) {
      return vload(p);
    } else {
      float tmp[kW];
      for (int64_t j = 0; j < kW; ++j) tmp[j] = to_float(p[j]);
      return vload(tmp);
    }
  }
};

// Where slot i of one head lives in a quantized cache (hajek_decode_quantized): the m stored slots as int8 codes
// (int8 and int4 formats: one code per byte) with float16 scales, dequantized into the tile's buffer as they are
// read (scale times code: exact in float32, as QuantizedRows.dequantize), then the exact slots held after them
// (the tail, float32 rows). Keys by `layout`: 0 per channel and group of `group` slots (scales (groups, d)),
// 1 per token (scales (m,)), 2 exact (float32 rows); values per token. Besides the rows, each stored slot's
// rounding-variance terms (slot_terms): sigma2_r = sum_x (tau q_rx)^2 s_x^2 / 4 per query row (its key scales
// s_x) and e_v = dv s_v^2 / 4 (its value scale); 0 for exact keys and on the tail. The current key group's
// scales and sigma2 per row are converted once per group (bind, load_group: per task state in the Scratch).
struct QuantKV {
  int64_t layout, m, group, d, dv;
  const int8_t* kc;
  int64_t kcn;
  const float* kf;
  int64_t kfn;
  const c10::Half* ks;  // layout 0: this head's (groups, d), row stride d; layout 1: this head's (m,)
  const int8_t* vc;
  int64_t vcn;
  const c10::Half* vs;  // this head's (m,)
  const float* tk;
  int64_t tkn;
  const float* tv;
  int64_t tvn;
  mutable const float* qs = nullptr;  // the G scaled query rows (bind)
  mutable int64_t G = 0, grp = -1;
  mutable float *gs = nullptr, *gsig = nullptr, *qn2 = nullptr;
  static constexpr bool kDirect = false;
  static constexpr bool kQuant = true;

  void bind(const float* q, int64_t rows, Scratch& w) const {
    qs = q;
    G = rows;
    grp = -1;
    gs = w.gs.data();
    gsig = w.gsig.data();
    qn2 = w.qn2.data();
    for (int64_t r = 0; r < G; ++r) {
      const float* qr = qs + r * d;
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int64_t x = 0; x < d; ++x) acc += qr[x] * qr[x];
      qn2[r] = acc;
    }
  }
  void load_group(int64_t g) const {
    if (g == grp) return;
    const c10::Half* s = ks + g * d;
    for (int64_t x = 0; x < d; ++x) gs[x] = static_cast<float>(s[x]);
    for (int64_t r = 0; r < G; ++r) {
      const float* qr = qs + r * d;
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int64_t x = 0; x < d; ++x) acc += (qr[x] * qr[x]) * (gs[x] * gs[x]);
      gsig[r] = 0.25f * acc;
    }
    grp = g;
  }
  const float* key(int64_t i, int64_t, float* buf) const {
    if (i >= m) return tk + (i - m) * tkn;
    if (layout == 2) return kf + i * kfn;
    const int8_t* c = kc + i * kcn;
    if (layout == 0) {
      load_group(i / group);
      const float* s = gs;
#pragma omp simd
      for (int64_t x = 0; x < d; ++x) buf[x] = s[x] * static_cast<float>(c[x]);
    } else {
      const float s = static_cast<float>(ks[i]);
#pragma omp simd
      for (int64_t x = 0; x < d; ++x) buf[x] = s * static_cast<float>(c[x]);
    }
    return buf;
  }
  const float* value(int64_t i, int64_t, float* buf) const {
    if (i >= m) return tv + (i - m) * tvn;
    const int8_t* c = vc + i * vcn;
    const float s = static_cast<float>(vs[i]);
#pragma omp simd
    for (int64_t x = 0; x < dv; ++x) buf[x] = s * static_cast<float>(c[x]);
    return buf;
  }
  // slot i's sigma2 per row into sg[r * kTile] and its value term into *vv (after key(i): its group is loaded)
  void slot_terms(int64_t i, float* sg, float* vv) const {
    if (i >= m) {
      for (int64_t r = 0; r < G; ++r) sg[r * kTile] = 0.0f;
      *vv = 0.0f;
      return;
    }
    const float sv = static_cast<float>(vs[i]);
    *vv = 0.25f * static_cast<float>(dv) * (sv * sv);
    if (layout == 0) {
      load_group(i / group);
      for (int64_t r = 0; r < G; ++r) sg[r * kTile] = gsig[r];
    } else if (layout == 1) {
      const float s = static_cast<float>(ks[i]);
      for (int64_t r = 0; r < G; ++r) sg[r * kTile] = 0.25f * (s * s) * qn2[r];
    } else {
      for (int64_t r = 0; r < G; ++r) sg[r * kTile] = 0.0f;
    }
  }
};

// One row's tile of scores s -> p = e^{s - m} (in place, m = P[0]) and w = omp p^2 (omp = 1 - pi), their sums added
// to the row's partial P: l = sum p (P[1]), C = sum w (P[2]) and P2 = sum p^2 (P[4]). The sketch's kept pass
// (SKETCH, pf = pi): w = pi (1 - pi) p^2 (the c' rows), sum pi p in P[4], and the HT trace's weights
// wh = (1 - pi) p^2 and their sum C_ht (P[6]).
template <bool SKETCH>
inline void tile_weights(float* s, float* wr, const float* omp, const float* pf, int64_t cnt, float* P,
                         float* wh = nullptr) {
  const float m = P[0];  // the row's running max
  float l = 0.0f, p2 = 0.0f, c = 0.0f, ch = 0.0f;
#pragma omp simd reduction(+ : l, p2, c, ch)
  for (int64_t j = 0; j < cnt; ++j) {
    const float p = exp_nonpos(s[j] - m);
    const float hw = omp[j] * p * p;
    const float pw = SKETCH ? pf[j] * hw : hw;
    s[j] = p;
    wr[j] = pw;
    l += p;
    p2 += (SKETCH ? pf[j] : p) * p;
    c += pw;
    if (SKETCH) {
      wh[j] = hw;
      ch += hw;
    }
  }
  P[1] += l;
  P[2] += c;
  P[4] += p2;
  if (SKETCH) P[6] += ch;
}

// The quantized pass's rounding-variance weights of one row's tile (p = e^{s - m} already in s): wq = sigma2 p^2
// (its sum into P[6]) and the value term sum p^2 e_v (P[5]). Combined: wq added to the trace's weights w (in place,
// `wq` = the row's w) and its sum to C (P[2]).
inline void quant_weights(const float* p, const float* sg, const float* vv, int64_t cnt, float* P, float* wq,
                          bool combined) {
  float c = 0.0f, e = 0.0f;
  if (combined) {
#pragma omp simd reduction(+ : c, e)
    for (int64_t j = 0; j < cnt; ++j) {
      const float p2 = p[j] * p[j], x = sg[j] * p2;
      wq[j] += x;
      c += x;
      e += vv[j] * p2;
    }
    P[2] += c;
  } else {
#pragma omp simd reduction(+ : c, e)
    for (int64_t j = 0; j < cnt; ++j) {
      const float p2 = p[j] * p[j];
      wq[j] = sg[j] * p2;
      c += wq[j];
      e += vv[j] * p2;
    }
    P[6] += c;
  }
  P[5] += e;
}

// One (head, slot range) task: fills the G partial rows `part` and the range's centre `ref`.
template <typename KV, bool PER_COORD>
void range_task(const Shape& S, const KV& kv, const float* lp, int64_t lsn,
                const float* q, float scale, const float* center, int64_t n0, int64_t n1, float* part, float* ref,
                Scratch& w) {
  const int64_t G = S.G, d = S.d, dv = S.dv, stride = S.stride;
  const bool third = S.quant && !S.combined;  // the rounding variance's own sums (S_q, R_q, C_q)
  for (int64_t r = 0; r < G; ++r) {
    float* P = part + r * stride;
    std::fill(P, P + stride, 0.0f);
    P[0] = kNegInf;
  }
  int64_t first = n0;
  while (first < n1 && !(lp[first * lsn] > kNegInf)) ++first;
  if (center != nullptr) {
    std::copy(center, center + dv, ref);
  } else if (first < n1) {
    const float* v = kv.value(first, dv, w.vt.data());
    std::copy(v, v + dv, ref);
  } else {
    std::fill(ref, ref + dv, 0.0f);
  }
  if (first == n1) return;  // nothing kept in this range
  float* qs = w.q.data();
  for (int64_t x = 0; x < G * d; ++x) qs[x] = q[x] * scale;
  if constexpr (KV::kQuant) kv.bind(qs, G, w);
  float* sc = w.s.data();
  float* wt = w.w.data();
  const float* omp = w.omp.data();
  const Tile tile_view{0, w.krow.data(), w.vrow.data(), w.off.data(), w.omp.data()};
  for (int64_t t0 = first; t0 < n1; t0 += kTile) {
    const int64_t t1 = std::min(n1, t0 + kTile);
    const int64_t nt = t1 - t0;
    float* lt = w.lt.data();
    float* od = w.od.data();
    for (int64_t i = 0; i < nt; ++i) lt[i] = lp[(t0 + i) * lsn];
#pragma omp simd
    for (int64_t i = 0; i < nt; ++i) od[i] = one_minus_exp(lt[i]);  // 1 - pi
    float* pt = w.pt.data();
    if (S.sketch) {
#pragma omp simd
      for (int64_t i = 0; i < nt; ++i) pt[i] = exp_nonpos(lt[i]);  // pi (the c' rows' extra factor)
    }
    int64_t cnt = 0;
    // the paged cache's scores are computed run by run (kept slots of one block), straight from its key matrix;
    // a dense cache's key rows are read in place (scores_fixed below)
    bool direct = false;
    if constexpr (KV::kDirect) direct = d == 64 || d == 128;
    if (!direct) {
      for (int64_t i = 0; i < nt; ++i) {
        if (lt[i] > kNegInf) {  // kept: offset -log pi >= 0 (pi = 0 slots are never read)
          w.krow[cnt] = kv.key(t0 + i, d, w.kt.data() + cnt * d);
          w.vrow[cnt] = kv.value(t0 + i, dv, w.vt.data() + cnt * dv);
          w.off[cnt] = -lt[i];
          w.omp[cnt] = od[i];
          if (S.sketch) w.pf[cnt] = pt[i];
          if constexpr (KV::kQuant) kv.slot_terms(t0 + i, w.sg.data() + cnt, w.vv.data() + cnt);
          ++cnt;
        }
      }
    } else if constexpr (KV::kDirect) {  // compiled for the paged cache only
      for (int64_t i = 0; i < nt;) {
        if (!(lt[i] > kNegInf)) {
          ++i;
          continue;
        }
        int64_t e = i + 1;  // a run: consecutive kept slots of one block
        while (e < nt && lt[e] > kNegInf && kv.same_run(t0 + i, t0 + e)) ++e;
        if (d == 64) kv.template run_scores<64>(t0 + i, e - i, qs, G, sc + cnt);
        else kv.template run_scores<128>(t0 + i, e - i, qs, G, sc + cnt);
        for (; i < e; ++i) {
          w.vrow[cnt] = kv.value(t0 + i, dv, w.vt.data() + cnt * dv);
          w.off[cnt] = -lt[i];
          w.omp[cnt] = od[i];
          if (S.sketch) w.pf[cnt] = pt[i];
          ++cnt;
        }
      }
    }
    if (cnt == 0) continue;
    Tile t = tile_view;
    t.cnt = cnt;
    const bool cap = S.softcap > 0.0f;
    if (cap) t.off = w.zero.data();  // the products alone; capped and offset below
    if (direct) {
      if (!cap)  // the offsets, added after the products as scores_block adds them
        for (int64_t r = 0; r < G; ++r)
          for (int64_t j = 0; j < cnt; ++j) sc[r * kTile + j] += w.off[j];
    } else if (d == 64) scores_fixed<64>(qs, G, t, sc);
    else if (d == 128) scores_fixed<128>(qs, G, t, sc);
    else scores_generic(qs, G, d, t, sc);
    if (cap) {  // c tanh(s / c), then the offset -log pi: the softcapped estimator's logits
      const float c = S.softcap, ic = 1.0f / S.softcap;
      for (int64_t r = 0; r < G; ++r)
        for (int64_t j = 0; j < cnt; ++j) sc[r * kTile + j] = c * std::tanh(sc[r * kTile + j] * ic) + w.off[j];
    }
    for (int64_t r = 0; r < G; ++r) {  // online softmax: rescale to the new max, then p and w
      float* P = part + r * stride;
      float* s = sc + r * kTile;
      float* wr = wt + r * kTile;
      float mt = kNegInf;
      int nan = 0;
#pragma omp simd reduction(max : mt) reduction(| : nan)
      for (int64_t j = 0; j < cnt; ++j) {
        mt = s[j] > mt ? s[j] : mt;
        nan |= s[j] != s[j];
      }
      if (nan) mt = std::numeric_limits<float>::quiet_NaN();  // NaN sticks
      if (mt > P[0] || mt != mt) {  // a NaN score (NaN in q or k) makes the row NaN
        const float f = exp_nonpos(P[0] - mt), f2 = f * f;
        P[1] *= f;
        P[2] *= f2;
        P[3] *= f2;
        P[4] *= S.sketch ? f : f2;  // K = sum pi p scales as p, P2 = sum p^2 as p^2
        P[6] *= f2;                 // the HT trace's C_ht and R_ht, or the rounding variance's sums (0 outside the
        P[7] *= f2;                 // sketch's and the quantized pass)
        if (S.quant) P[5] *= f2;    // the rounding variance's value term (the sketch's pass: a max, not rescaled)
        float* o = P + kHead;
#pragma omp simd
        for (int64_t x = 0; x < dv; ++x) o[x] *= f;
        float* rest = o + dv;
        const int64_t m = (PER_COORD || S.sketch || third ? 2 : 1) * dv;  // S, and S_ht, S_q or the per-coordinate sums
#pragma omp simd
        for (int64_t x = 0; x < m; ++x) rest[x] *= f2;
        P[0] = mt;
      }
      if (S.sketch) tile_weights<true>(s, wr, omp, w.pf.data(), cnt, P, w.wh.data() + r * kTile);
      else tile_weights<false>(s, wr, omp, nullptr, cnt, P);
      if (S.quant)
        quant_weights(s, w.sg.data() + r * kTile, w.vv.data(), cnt, P, S.combined ? wr : w.wh.data() + r * kTile,
                      S.combined);
    }
    float* r2 = w.r2.data();  // ||v_j - mu||^2, shared by the rows
    if (dv == 64) sqdist_fixed<64>(t, ref, r2);
    else if (dv == 128) sqdist_fixed<128>(t, ref, r2);
    else
      for (int64_t j = 0; j < cnt; ++j) {
        const float* v = w.vrow[j];
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int64_t x = 0; x < dv; ++x) acc += (v[x] - ref[x]) * (v[x] - ref[x]);
        r2[j] = acc;
      }
    for (int64_t r = 0; r < G; ++r) {
      const float* wr = wt + r * kTile;
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int64_t j = 0; j < cnt; ++j) acc += wr[j] * r2[j];
      part[r * stride + 3] += acc;
      if (S.sketch || third) {  // R_ht = sum w_ht r, or R_q = sum wq r
        const float* hr = w.wh.data() + r * kTile;
        float ah = 0.0f;
#pragma omp simd reduction(+ : ah)
        for (int64_t j = 0; j < cnt; ++j) ah += hr[j] * r2[j];
        part[r * stride + 7] += ah;
      }
    }
    if (S.sketch) {  // the hull bound's max over S of ||v_i - mu||^2 (mu = the caller's centre), NaN sticking
      float mx = part[5];
      for (int64_t j = 0; j < cnt; ++j)
        if (!(r2[j] <= mx) && mx == mx) mx = r2[j];  // a larger one, or the first NaN
      for (int64_t r = 0; r < G; ++r) part[r * stride + 5] = mx;
    }
    if constexpr (!PER_COORD) {
      if (S.sketch || third) {  // the HT trace's S_ht (the sketch's pass) or S_q as the third accumulator
        const float* wh = w.wh.data();
        if (dv == 64) values_fixed<64, false, true>(G, t, sc, wt, ref, part, stride, wh);
        else if (dv == 128) values_fixed<128, false, true>(G, t, sc, wt, ref, part, stride, wh);
        else values_generic<false, true>(G, dv, t, sc, wt, ref, part, stride, wh);
        continue;
      }
    }
    if (dv == 64) values_fixed<64, PER_COORD>(G, t, sc, wt, ref, part, stride);
    else if (dv == 128) values_fixed<128, PER_COORD>(G, t, sc, wt, ref, part, stride);
    else values_generic<PER_COORD>(G, dv, t, sc, wt, ref, part, stride);
  }
}

// Merge the ranges of one row: output, lse, n_eff, trace (and the per-coordinate variance).
template <typename TO>
void merge_row(const Shape& S, const float* part, const float* refs, int64_t row, TO* out, float* lse, float* neff,
               float* trace, float* var, std::vector<float>& o) {
  const int64_t G = S.G, dv = S.dv, stride = S.stride, splits = S.splits;
  const int64_t bh = row / G, r = row % G;
  auto P = [&](int64_t s) { return part + ((bh * splits + s) * G + r) * stride; };
  float M = kNegInf;
  bool nan = false;
  for (int64_t s = 0; s < splits; ++s) {
    M = std::max(M, P(s)[0]);
    nan = nan || P(s)[0] != P(s)[0];
  }
  TO* orow = out + row * dv;
  float* vrow = S.per_coord ? var + row * dv : nullptr;
  if (nan) {  // NaN in q or k: every field NaN (the caller's finite check sees it)
    const float q_nan = std::numeric_limits<float>::quiet_NaN();
    for (int64_t x = 0; x < dv; ++x) orow[x] = static_cast<TO>(q_nan);
    lse[row] = neff[row] = trace[row] = q_nan;
    if (vrow) std::fill(vrow, vrow + dv, q_nan);
    return;
  }
  if (!(M > kNegInf)) {  // empty row: the reference's convention
    for (int64_t x = 0; x < dv; ++x) orow[x] = static_cast<TO>(0.0f);
    lse[row] = kNegInf;
    neff[row] = 0.0f;
    trace[row] = kInf;
    if (vrow) std::fill(vrow, vrow + dv, kInf);
    return;
  }
  float l = 0.0f, p2 = 0.0f;
  std::fill(o.begin(), o.end(), 0.0f);
  for (int64_t s = 0; s < splits; ++s) {
    const float* p = P(s);
    if (!(p[0] > kNegInf)) continue;
    const float f = exp_nonpos(p[0] - M);
    l += f * p[1];
    p2 += (S.sketch ? f : f * f) * p[4];
    for (int64_t x = 0; x < dv; ++x) o[x] += f * p[kHead + x];
  }
  for (int64_t x = 0; x < dv; ++x) o[x] /= l;
  if (vrow) std::fill(vrow, vrow + dv, 0.0f);
  double tr = 0.0;  // a handful of terms per row: summed in double
  for (int64_t s = 0; s < splits; ++s) {
    const float* p = P(s);
    if (!(p[0] > kNegInf) || p[2] == 0.0f) continue;  // no kept slot, or every kept slot certain
    const float f = exp_nonpos(p[0] - M), f2 = f * f;
    const float* ref = refs + (bh * splits + s) * dv;
    const float* Sv = p + kHead + dv;  // S = sum w (v - mu), then per coordinate sum w (v - mu)^2
    float dot = 0.0f, dd = 0.0f;
    for (int64_t x = 0; x < dv; ++x) {
      const float dm = o[x] - ref[x];
      dot += dm * Sv[x];
      dd += dm * dm;
      if (vrow) vrow[x] += f2 * (Sv[dv + x] - 2.0f * dm * Sv[x] + p[2] * dm * dm);
    }
    tr += static_cast<double>(f2) * (p[3] - 2.0f * dot + p[2] * dd);
  }
  const float inv_l2 = 1.0f / (l * l);
  if (vrow) {
    double sum = 0.0;
    for (int64_t x = 0; x < dv; ++x) {
      vrow[x] = std::max(vrow[x] * inv_l2, 0.0f);
      sum += vrow[x];
    }
    trace[row] = static_cast<float>(sum);
  } else {
    trace[row] = std::max(static_cast<float>(tr) * inv_l2, 0.0f);
  }
  for (int64_t x = 0; x < dv; ++x) orow[x] = static_cast<TO>(o[x]);
  lse[row] = M + std::log(l);
  neff[row] = S.sketch ? p2 / l : l * l / p2;  // the sketch's kappa = sum pi a, else n_eff = 1 / sum a^2
}

// ---------------------------------------------------------------------------------------------
// The cluster (sketched) design's certificate of one row, from its kept pieces (o, lse, kappa, T') and the
// sketch's decode form (kvcert.fast.sketch._DecodeForm, per KV head): kvcert.fast.sketch._log_variance and
// the end of sketch_step, in double (O(C d) per row).
//
//   r = q - q0 (q0 = 0 without a tilt);  x = bias + [r; r^2] W                    (2C: numerator, then Z~ terms)
//   x_c += log(Y_c + W_c ||mu_s - o||^2)  (c < C; log 0 = -inf: an absent cluster)
//   log num = logaddexp(log T' + 2 lse, logsumexp_c x_c),  log Z~ = logaddexp(log kappa + lse, logsumexp x_{C+c})
//   V_cl = exp(log num - 2 log Z~),  V = max(V_cl, HT trace) (ht_trace),  radius = factor sqrt(V)
//   bound = ||o - mu_s|| + max(reach, sqrt(max_S ||v_i - mu||^2) + ||mu - mu_s||),  radius = fmin(radius, bound)
//   recorded = min(V, (bound / c_kind)^2)   (kvcert.fast.recorded_trace, with `clip` = c_kind > 0)
//
// An empty row (lse = -inf) gets V_cl, radius, bound and the recorded trace +inf; a NaN bound caps nothing in the
// radius (fmin) and makes the recorded trace NaN (torch.minimum); NaN elsewhere propagates (torch.maximum,
// logsumexp), as the torch path.
struct SketchForm {
  const float* W;       // (H, 2d, 2C)
  const float* bias;    // (H, 2C)
  const float* weight;  // (H, C) W_c
  const float* wnorm;   // (H, C) Y_c
  const float* tilt;    // (H, d) q0, or nullptr
  const float* mu;      // (H, dv) the sketch's value centre mu_s
  const float* reach;   // (H) or nullptr: no hull bound
  int64_t C;
  double factor;  // the radius rule's c in c sqrt(V_cl)
  double clip;    // the certificate kind's radius per unit root trace, 0: no recorded trace
  float* variance;
  float* radius;
  float* bound;     // nullptr without reach
  float* recorded;  // nullptr without reach or clip
};

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

inline double logsumexp_d(const double* x, int64_t len) {  // torch.logsumexp: -inf if all -inf, NaN sticks
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t c = 0; c < len; ++c) {
    if (x[c] != x[c]) return kNaN;
    m = std::max(m, x[c]);
  }
  if (std::isinf(m)) return m;
  double s = 0.0;
  for (int64_t c = 0; c < len; ++c) s += std::exp(x[c] - m);
  return m + std::log(s);
}

inline double logaddexp_d(double a, double b) {  // torch.logaddexp: -inf + -inf = -inf, NaN sticks
  if (a != a || b != b) return kNaN;
  const double m = std::max(a, b);
  if (std::isinf(m)) return m;
  return m + std::log1p(std::exp(-std::abs(a - b)));
}

inline double max_nan(double a, double b) { return (a != a || b != b) ? kNaN : std::max(a, b); }  // torch.maximum

typedef double vd4 __attribute__((vector_size(32)));  // the epilogue's double lanes

inline vd4 to_vd4(const float* x) { return vd4{x[0], x[1], x[2], x[3]}; }

// The sample's HT trace of one row from the sketch pass's partial rows (its C_ht, R_ht and S_ht; every range's
// centre is `center`): merge_row's trace with the (1 - pi) a^2 rows, sum over ranges of f^2 (R_ht - 2 (o - mu).S_ht +
// C_ht ||o - mu||^2) / l^2, in double, clamped at 0. kvcert.fast.sketch_step's `trace`.
double ht_trace(const Shape& S, const float* part, const float* center, int64_t row, const float* o) {
  const int64_t G = S.G, dv = S.dv, bh = row / G, r = row % G;
  auto P = [&](int64_t s) { return part + ((bh * S.splits + s) * G + r) * S.stride; };
  double M = -std::numeric_limits<double>::infinity();
  for (int64_t s = 0; s < S.splits; ++s) M = std::max(M, static_cast<double>(P(s)[0]));
  const float* mu = center + bh * dv;
  double dd = 0.0;  // ||o - mu||^2
  for (int64_t x = 0; x < dv; ++x) dd += (static_cast<double>(o[x]) - mu[x]) * (static_cast<double>(o[x]) - mu[x]);
  double l = 0.0, tr = 0.0;
  for (int64_t s = 0; s < S.splits; ++s) {
    const float* p = P(s);
    if (!(p[0] > kNegInf)) continue;  // no kept slot in this range
    const double f = std::exp(static_cast<double>(p[0]) - M);
    l += f * p[1];
    if (p[6] == 0.0f) continue;  // every kept slot certain
    const float* Sh = p + kHead + 2 * dv;
    double dot = 0.0;
    for (int64_t x = 0; x < dv; ++x) dot += (static_cast<double>(o[x]) - mu[x]) * Sh[x];
    tr += f * f * (static_cast<double>(p[7]) - 2.0 * dot + static_cast<double>(p[6]) * dd);
  }
  return std::max(tr / (l * l), 0.0);
}

// The rounding variance V_q of one row from the quantized pass's partial rows (its P[5], P[6], P[7] and S_q; each
// range's centre in `refs`): sum over ranges of f^2 (R_q - 2 (o - mu).S_q + C_q ||o - mu||^2 + E_v) / l^2, in
// double, clamped at 0, i.e. sum_S a_i^2 (sigma2_i ||v_i - o||^2 + e_v,i) (kvcert.fast.held_rounding_terms'
// V_q). +inf for an empty row, NaN for a NaN one (merge_row's conventions). Combined: the value term alone (the
// logit term is in the trace's sums).
double quant_variance(const Shape& S, const float* part, const float* refs, int64_t row, const float* o) {
  const int64_t G = S.G, dv = S.dv, bh = row / G, r = row % G;
  auto P = [&](int64_t s) { return part + ((bh * S.splits + s) * G + r) * S.stride; };
  double M = -std::numeric_limits<double>::infinity();
  for (int64_t s = 0; s < S.splits; ++s) {
    if (P(s)[0] != P(s)[0]) return kNaN;
    M = std::max(M, static_cast<double>(P(s)[0]));
  }
  if (!(M > -std::numeric_limits<double>::infinity())) return std::numeric_limits<double>::infinity();
  double l = 0.0, acc = 0.0;
  for (int64_t s = 0; s < S.splits; ++s) {
    const float* p = P(s);
    if (!(p[0] > kNegInf)) continue;  // no kept slot in this range
    const double f = std::exp(static_cast<double>(p[0]) - M);
    l += f * p[1];
    acc += f * f * p[5];
    if (S.combined) continue;  // the logit term is in the trace's sums
    const float* ref = refs + (bh * S.splits + s) * dv;
    const float* Sq = p + kHead + 2 * dv;
    double dot = 0.0, dd = 0.0;
    for (int64_t x = 0; x < dv; ++x) {
      const double e = static_cast<double>(o[x]) - ref[x];
      dot += e * Sq[x];
      dd += e * e;
    }
    acc += f * f * (static_cast<double>(p[7]) - 2.0 * dot + static_cast<double>(p[6]) * dd);
  }
  return std::max(acc / (l * l), 0.0);
}

void sketch_row(const Shape& S, const SketchForm& F, const float* part, const float* q, const float* center,
                int64_t row, const float* o, float lse, float kappa, float tprime, std::vector<double>& x) {
  const int64_t G = S.G, d = S.d, dv = S.dv, C = F.C, C2 = 2 * C;
  const int64_t bh = row / G, r = row % G;
  if (lse == kNegInf) {  // empty row: the Estimate convention
    F.variance[row] = F.radius[row] = kInf;
    if (F.bound) F.bound[row] = kInf;
    if (F.recorded) F.recorded[row] = kInf;
    return;
  }
  const float* W = F.W + bh * 2 * d * C2;
  const float* qr = q + row * d;
  const float* q0 = F.tilt ? F.tilt + bh * d : nullptr;
  double* xs = x.data();
  // x = bias + [r; r^2] W, 8 columns at a time in two vector accumulators (registers across the d terms: summing
  // into x itself would make every term wait on the store of the one before); the columns past the last multiple
  // of 8 (none when C is a multiple of 4) one by one
  const float* bias = F.bias + bh * C2;
  int64_t c0 = 0;
  for (; c0 + 8 <= C2; c0 += 8) {
    vd4 a0 = vd4{bias[c0], bias[c0 + 1], bias[c0 + 2], bias[c0 + 3]};
    vd4 a1 = vd4{bias[c0 + 4], bias[c0 + 5], bias[c0 + 6], bias[c0 + 7]};
    for (int64_t j = 0; j < d; ++j) {
      const double rj = static_cast<double>(qr[j]) - (q0 ? static_cast<double>(q0[j]) : 0.0), rj2 = rj * rj;
      const float* w1 = W + j * C2 + c0;
      const float* w2 = W + (d + j) * C2 + c0;
      a0 += rj * to_vd4(w1) + rj2 * to_vd4(w2);
      a1 += rj * to_vd4(w1 + 4) + rj2 * to_vd4(w2 + 4);
    }
    for (int c = 0; c < 4; ++c) {
      xs[c0 + c] = a0[c];
      xs[c0 + 4 + c] = a1[c];
    }
  }
  for (int64_t c = c0; c < C2; ++c) {
    double acc = bias[c];
    for (int64_t j = 0; j < d; ++j) {
      const double rj = static_cast<double>(qr[j]) - (q0 ? static_cast<double>(q0[j]) : 0.0);
      acc += rj * W[j * C2 + c] + rj * rj * W[(d + j) * C2 + c];
    }
    xs[c] = acc;
  }
  const float* ms = F.mu + bh * dv;
  double a2 = 0.0;  // ||mu_s - o||^2
  for (int64_t y = 0; y < dv; ++y) {
    const double e = static_cast<double>(ms[y]) - o[y];
    a2 += e * e;
  }
  const float* Wc = F.weight + bh * C;
  const float* Yc = F.wnorm + bh * C;
  for (int64_t c = 0; c < C; ++c) xs[c] += std::log(static_cast<double>(Yc[c]) + static_cast<double>(Wc[c]) * a2);
  const double L = lse;
  const double log_num = logaddexp_d(std::log(static_cast<double>(tprime)) + 2.0 * L, logsumexp_d(xs, C));
  const double log_z = logaddexp_d(std::log(static_cast<double>(kappa)) + L, logsumexp_d(xs + C, C));
  const double var = max_nan(std::exp(log_num - 2.0 * log_z), ht_trace(S, part, center, row, o));
  double rad = F.factor * std::sqrt(var);
  if (F.bound) {
    double mx = 0.0;  // max_S ||v_i - mu||^2 over the row's ranges
    for (int64_t s = 0; s < S.splits; ++s) mx = max_nan(mx, part[((bh * S.splits + s) * G + r) * S.stride + 5]);
    const float* mu = center + bh * dv;
    double cm = 0.0, om = 0.0;  // ||mu - mu_s||^2, ||o - mu_s||^2
    for (int64_t y = 0; y < dv; ++y) {
      const double e = static_cast<double>(mu[y]) - ms[y], f = static_cast<double>(o[y]) - ms[y];
      cm += e * e;
      om += f * f;
    }
    const double far = max_nan(static_cast<double>(F.reach[bh]), std::sqrt(mx) + std::sqrt(cm));
    const double bnd = std::sqrt(om) + far;
    F.bound[row] = static_cast<float>(bnd);
    rad = std::fmin(rad, bnd);  // a NaN bound caps nothing
    if (F.recorded) {  // torch.minimum: NaN sticks
      const double h = bnd / F.clip, cap = h * h;
      F.recorded[row] = static_cast<float>((var != var || cap != cap) ? kNaN : std::min(var, cap));
    }
  }
  F.variance[row] = static_cast<float>(var);
  F.radius[row] = static_cast<float>(rad);
}

// Every (head, range) task, then the merge (and, with `form`, the sketch's certificate of each row); `make(bh)`
// gives head bh's K/V accessor.
template <bool PER_COORD, typename Make>
void run_with(const Shape& S, const at::Tensor& q, const at::Tensor& lp, Make make, const float* center, float scale,
              at::Tensor& out, at::Tensor& lse, at::Tensor& neff, at::Tensor& trace, at::Tensor& var,
              const SketchForm* form = nullptr) {
  const int64_t tasks = S.H * S.splits;
  std::vector<float> part(static_cast<size_t>(tasks * S.G * S.stride));
  std::vector<float> refs(static_cast<size_t>(tasks * S.dv));
  const Heads<float> L = heads<float>(lp);
  const float* qp = q.data_ptr<float>();
  const int64_t chunk = (S.n + S.splits - 1) / S.splits;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    Scratch w(S);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t bh = t / S.splits, s = t % S.splits;
      const int64_t n0 = std::min(S.n, s * chunk), n1 = std::min(S.n, n0 + chunk);
      range_task<decltype(make(bh)), PER_COORD>(S, make(bh), L.head(bh, S.h_kv), L.sn, qp + bh * S.G * S.d, scale,
                                                center ? center + bh * S.dv : nullptr, n0, n1,
                                                part.data() + t * S.G * S.stride, refs.data() + t * S.dv, w);
    }
  });
  float* var_p = S.per_coord ? var.data_ptr<float>() : nullptr;
  float* vq_p = S.quant && !S.combined ? var.data_ptr<float>() : nullptr;  // the quantized pass: `var` holds V_q
  at::parallel_for(0, S.H * S.G, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> o(S.dv);
    std::vector<double> x(form ? 2 * form->C : 0);
    for (int64_t row = begin; row < end; ++row) {
      if (out.scalar_type() == at::kBFloat16) {
        merge_row(S, part.data(), refs.data(), row, out.data_ptr<c10::BFloat16>(), lse.data_ptr<float>(),
                  neff.data_ptr<float>(), trace.data_ptr<float>(), var_p, o);
      } else {
        merge_row(S, part.data(), refs.data(), row, out.data_ptr<float>(), lse.data_ptr<float>(),
                  neff.data_ptr<float>(), trace.data_ptr<float>(), var_p, o);
      }
      if (vq_p) vq_p[row] = static_cast<float>(quant_variance(S, part.data(), refs.data(), row, o.data()));
      else if (S.quant)  // combined: the trace holds trace + V_q; its value term added here
        trace.data_ptr<float>()[row] += static_cast<float>(quant_variance(S, part.data(), refs.data(), row, o.data()));
      if (form)  // the sketch's output is float32; neff holds kappa and trace T' (merge_row)
        sketch_row(S, *form, part.data(), qp, center, row, out.data_ptr<float>() + row * S.dv, lse.data_ptr<float>()[row],
                   neff.data_ptr<float>()[row], trace.data_ptr<float>()[row], x);
    }
  });
}

template <typename T, bool PER_COORD>
void run(const Shape& S, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lp,
         const float* center, float scale, at::Tensor& out, at::Tensor& lse, at::Tensor& neff, at::Tensor& trace,
         at::Tensor& var, const SketchForm* form = nullptr) {
  const Heads<T> K = heads<T>(k), V = heads<T>(v);
  run_with<PER_COORD>(S, q, lp, [&](int64_t bh) {
    return DenseKV<T>{K.head(bh, S.h_kv), K.sn, V.head(bh, S.h_kv), V.sn};
  }, center, scale, out, lse, neff, trace, var, form);
}

template <typename T>
PagedKV<T> paged_head(const at::Tensor& kv_cache, const at::Tensor& ids, int64_t bh, int64_t h_kv, int64_t d) {
  const int64_t M = ids.size(1);
  return PagedKV<T>{kv_cache.data_ptr<T>(), kv_cache.stride(0), (bh % h_kv) * kv_cache.stride(1), kv_cache.size(2), d,
                    ids.data_ptr<int64_t>() + (bh / h_kv) * M};
}

template <typename T>
void run_paged(const Shape& S, const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& ids,
               const at::Tensor& lp, float scale, at::Tensor& out, at::Tensor& lse, at::Tensor& neff,
               at::Tensor& trace, at::Tensor& var, const float* center = nullptr, const SketchForm* form = nullptr) {
  run_with<false>(S, q, lp, [&](int64_t bh) { return paged_head<T>(kv_cache, ids, bh, S.h_kv, S.d); }, center, scale,
                  out, lse, neff, trace, var, form);
}

// The mean kept value of every paged head, mu = sum_S v_i / max(|S|, 1) (kvcert.fast.value_moments' centre), into
// mu (H, dv): one read of the kept values (not the keys), per (head, range) task in double, then per head.
template <typename T>
void paged_kept_mean(const Shape& S, const at::Tensor& kv_cache, const at::Tensor& ids, const at::Tensor& lp,
                     float* mu, const double* base = nullptr, const int64_t* start = nullptr) {
  // mu = the mean kept value of each (row, KV head). With base (H x (dv + 1): the sums and count of the slots
  // before start[row]) only the slots from start[row] on are read and added to it
  const int64_t tasks = S.H * S.splits, dv = S.dv, chunk = (S.n + S.splits - 1) / S.splits;
  std::vector<double> sums(static_cast<size_t>(tasks * (dv + 1)), 0.0);
  const Heads<float> L = heads<float>(lp);
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(dv);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t bh = t / S.splits, s = t % S.splits;
      int64_t n0 = std::min(S.n, s * chunk);
      const int64_t n1 = std::min(S.n, n0 + chunk);
      if (start != nullptr) n0 = std::max(n0, start[bh / S.h_kv]);
      const PagedKV<T> kv = paged_head<T>(kv_cache, ids, bh, S.h_kv, S.d);
      const float* l = L.head(bh, S.h_kv);
      double* acc = sums.data() + t * (dv + 1);
      for (int64_t i = n0; i < n1; ++i) {
        if (!(l[i * L.sn] > kNegInf)) continue;  // not a token: never read
        const float* v = kv.value(i, dv, buf.data());
#pragma omp simd
        for (int64_t x = 0; x < dv; ++x) acc[x] += v[x];
        acc[dv] += 1.0;
      }
    }
  });
  for (int64_t bh = 0; bh < S.H; ++bh) {
    std::vector<double> m(dv + 1, 0.0);
    if (base != nullptr)
      for (int64_t x = 0; x <= dv; ++x) m[x] = base[bh * (dv + 1) + x];
    for (int64_t s = 0; s < S.splits; ++s)
      for (int64_t x = 0; x <= dv; ++x) m[x] += sums[(bh * S.splits + s) * (dv + 1) + x];
    const double cnt = std::max(m[dv], 1.0);
    for (int64_t x = 0; x < dv; ++x) mu[bh * dv + x] = static_cast<float>(m[x] / cnt);
  }
}

int64_t auto_splits(int64_t H, int64_t n) {
  // enough (head, range) tasks for 8 per thread, each range at least kMinSplit slots
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t want = (8 * threads + H - 1) / H;
  const int64_t most = std::max<int64_t>(1, (n + kMinSplit - 1) / kMinSplit);
  return std::max<int64_t>(1, std::min(want, most));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> decode_dense(
    const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& log_pi,
    const std::optional<at::Tensor>& center, double scale, bool per_coordinate, int64_t splits, bool sketch,
    SketchForm* form = nullptr) {
  // q (b, h_kv, G, d) float32; keys (b, h_kv, n, d), values (b, h_kv, n, dv) float32 or bfloat16 with unit
  // stride in the last dimension; log_pi (b, h_kv, n) float32; center (b, h_kv, dv) float32 or None.
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.dim() == 4 && log_pi.dim() == 3,
              "hajek_decode: q, keys, values must be 4-d and log_pi 3-d");
  TORCH_CHECK(q.device().is_cpu() && keys.device().is_cpu() && values.device().is_cpu() && log_pi.device().is_cpu(),
              "hajek_decode: CPU tensors only");
  TORCH_CHECK(keys.scalar_type() == values.scalar_type() &&
                  (keys.scalar_type() == at::kFloat || keys.scalar_type() == at::kBFloat16),
              "hajek_decode: keys and values must both be float32 or both bfloat16");
  TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1, "hajek_decode: keys and values need unit last stride");
  TORCH_CHECK(log_pi.scalar_type() == at::kFloat, "hajek_decode: log_pi must be float32");
  const int64_t b = keys.size(0), h_kv = keys.size(1), n = keys.size(2), d = keys.size(3), dv = values.size(3);
  TORCH_CHECK(q.size(0) == b && q.size(1) == h_kv && q.size(3) == d, "hajek_decode: q must be (b, h_kv, G, d)");
  TORCH_CHECK(values.size(0) == b && values.size(1) == h_kv && values.size(2) == n, "hajek_decode: values shape");
  TORCH_CHECK(log_pi.size(0) == b && log_pi.size(1) == h_kv && log_pi.size(2) == n, "hajek_decode: log_pi shape");
  const at::Tensor qc = f32_contiguous(q);
  at::Tensor cc;
  if (center.has_value()) {
    cc = f32_contiguous(*center);
    TORCH_CHECK(cc.numel() == b * h_kv * dv, "hajek_decode: center must be (b, h_kv, dv)");
  }
  const int64_t G = q.size(2), H = b * h_kv;
  Shape S{H, h_kv, G, n, d, dv, 1, kHead + (per_coordinate || sketch ? 3 : 2) * dv, per_coordinate, sketch};
  S.splits = splits > 0 ? std::min(splits, std::max<int64_t>(1, n)) : auto_splits(H, n);
  auto f32 = values.options().dtype(at::kFloat);
  // the sketch's output stays float32: its epilogue (V_cl, the hull bound) reads o
  at::Tensor out = at::empty({b, h_kv, G, dv}, sketch ? f32 : values.options());
  at::Tensor lse = at::empty({b, h_kv, G}, f32), neff = at::empty({b, h_kv, G}, f32);
  at::Tensor trace = at::empty({b, h_kv, G}, f32);
  at::Tensor var = per_coordinate ? at::empty({b, h_kv, G, dv}, f32) : at::empty({0}, f32);
  const float* cp = center.has_value() ? cc.data_ptr<float>() : nullptr;
  const float sc = static_cast<float>(scale);
  TORCH_CHECK(!form || (sketch && !per_coordinate && cp), "hajek_decode: a sketch form needs the sketch pass and a centre");
  if (keys.scalar_type() == at::kBFloat16) {
    if (per_coordinate) run<c10::BFloat16, true>(S, qc, keys, values, log_pi, cp, sc, out, lse, neff, trace, var);
    else run<c10::BFloat16, false>(S, qc, keys, values, log_pi, cp, sc, out, lse, neff, trace, var, form);
  } else {
    if (per_coordinate) run<float, true>(S, qc, keys, values, log_pi, cp, sc, out, lse, neff, trace, var);
    else run<float, false>(S, qc, keys, values, log_pi, cp, sc, out, lse, neff, trace, var, form);
  }
  return {out, lse, neff, trace, var};
}

// The dense op: q in the caller's layout, (b, h_q, d) or (b, h_q, t, d) (the g t rows of a KV head share its pass);
// the outputs in q's leading shape (o and the per-coordinate variance with dv last; the variance empty without
// per_coordinate), so that the caller makes no view of its own.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> hajek_decode(
    const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& log_pi,
    const std::optional<at::Tensor>& center, double scale, bool per_coordinate, int64_t splits) {
  TORCH_CHECK((q.dim() == 3 || q.dim() == 4) && keys.dim() == 4, "hajek_decode: q must be (b, h_q[, t], d), keys 4-d");
  const int64_t b = keys.size(0), h_kv = keys.size(1), d = keys.size(3);
  TORCH_CHECK(q.size(0) == b && q.size(-1) == d && h_kv > 0 && q.size(1) % h_kv == 0,
              "hajek_decode: q must be (b, h_q[, t], d) with h_q a multiple of h_kv");
  const int64_t G = q.size(1) / h_kv * (q.dim() == 4 ? q.size(2) : 1);
  const auto lead = q.sizes().slice(0, q.dim() - 1);
  auto r = decode_dense(q.reshape({b, h_kv, G, d}), keys, values, log_pi, center, scale, per_coordinate, splits,
                        false);
  std::vector<int64_t> row_shape(lead.begin(), lead.end());
  row_shape.push_back(values.size(3));
  at::Tensor var = std::get<4>(r);
  return {std::get<0>(r).view(row_shape), std::get<1>(r).view(lead), std::get<2>(r).view(lead),
          std::get<3>(r).view(lead), per_coordinate ? var.view(row_shape) : var};
}

// The quantized decode (kvcert.kernels.cpu.quantized_hajek_attention): hajek_decode's pass over a quantized cache's
// held slots, K and V dequantized in the tile loop (QuantKV), never as a whole. q (b, h_q[, t], d) float32 in the
// caller's layout; key_codes (b, h_kv, m, d) int8 (layout 0, 1) or float32 exact keys (layout 2), unit last stride;
// key_scales float16 (b, h_kv, ceil(m / group), d) (layout 0) or (b, h_kv, m) (layout 1), contiguous, None for
// layout 2; value_codes (b, h_kv, m, dv) int8, unit last stride; value_scales float16 (b, h_kv, m), contiguous;
// tail_keys / tail_values (b, h_kv, r, d / dv) float32 with unit last stride, or both None (r = 0); log_pi
// (b, h_kv, m + r) float32 (-inf: padding, never read). Returns o (float32), lse, n_eff, the trace and V_q, in q's
// leading shape (o with dv last); `combined`: the trace is trace + V_q (one set of sums) and V_q empty.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> hajek_decode_quantized(
    const at::Tensor& q, const at::Tensor& key_codes, const std::optional<at::Tensor>& key_scales,
    const at::Tensor& value_codes, const at::Tensor& value_scales, const at::Tensor& log_pi,
    const std::optional<at::Tensor>& tail_keys, const std::optional<at::Tensor>& tail_values, double scale,
    int64_t layout, int64_t group, int64_t splits, bool combined) {
  const char* name = "hajek_decode_quantized: ";
  TORCH_CHECK(layout >= 0 && layout <= 2, name, "layout must be 0 (channel), 1 (token) or 2 (values)");
  TORCH_CHECK(group >= 1, name, "group must be >= 1");
  TORCH_CHECK((q.dim() == 3 || q.dim() == 4) && key_codes.dim() == 4 && value_codes.dim() == 4 && log_pi.dim() == 3,
              name, "q must be (b, h_q[, t], d), the codes 4-d and log_pi 3-d");
  TORCH_CHECK(q.device().is_cpu() && key_codes.device().is_cpu() && value_codes.device().is_cpu() &&
                  value_scales.device().is_cpu() && log_pi.device().is_cpu(), name, "CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kFloat, name, "q must be float32");
  const int64_t b = value_codes.size(0), h_kv = value_codes.size(1), m = value_codes.size(2);
  const int64_t d = key_codes.size(3), dv = value_codes.size(3);
  TORCH_CHECK(key_codes.size(0) == b && key_codes.size(1) == h_kv && key_codes.size(2) == m, name,
              "key_codes must be (b, h_kv, m, d) with value_codes' (b, h_kv, m)");
  TORCH_CHECK(key_codes.scalar_type() == (layout == 2 ? at::kFloat : at::kChar), name,
              layout == 2 ? "exact keys (layout 2) must be float32" : "key_codes must be int8");
  TORCH_CHECK(value_codes.scalar_type() == at::kChar, name, "value_codes must be int8");
  TORCH_CHECK(key_codes.stride(3) == 1 && value_codes.stride(3) == 1, name, "the codes need unit last stride");
  TORCH_CHECK(value_scales.scalar_type() == at::kHalf && value_scales.is_contiguous() && value_scales.dim() == 3 &&
                  value_scales.size(0) == b && value_scales.size(1) == h_kv && value_scales.size(2) == m,
              name, "value_scales must be contiguous float16 (b, h_kv, m)");
  const int64_t groups = (m + group - 1) / group;
  if (layout == 2) {
    TORCH_CHECK(!key_scales.has_value(), name, "exact keys (layout 2) take no key_scales");
  } else {
    TORCH_CHECK(key_scales.has_value() && key_scales->device().is_cpu() && key_scales->scalar_type() == at::kHalf &&
                    key_scales->is_contiguous(), name, "key_scales must be a contiguous float16 CPU tensor");
    const at::Tensor& ks = *key_scales;
    const bool fits = layout == 0 ? ks.dim() == 4 && ks.size(0) == b && ks.size(1) == h_kv && ks.size(2) == groups &&
                                        ks.size(3) == d
                                  : ks.dim() == 3 && ks.size(0) == b && ks.size(1) == h_kv && ks.size(2) == m;
    TORCH_CHECK(fits, name, "key_scales must be (b, h_kv, ceil(m / group), d) in the channel layout, (b, h_kv, m) in ",
                "the token layout");
  }
  TORCH_CHECK(tail_keys.has_value() == tail_values.has_value(), name, "tail_keys and tail_values go together");
  int64_t r = 0;
  if (tail_keys.has_value()) {
    const at::Tensor &tk = *tail_keys, &tv = *tail_values;
    TORCH_CHECK(tk.dim() == 4 && tv.dim() == 4 && tk.scalar_type() == at::kFloat && tv.scalar_type() == at::kFloat &&
                    tk.device().is_cpu() && tv.device().is_cpu() && tk.stride(3) == 1 && tv.stride(3) == 1,
                name, "tail_keys and tail_values must be float32 CPU tensors (b, h_kv, r, d / dv), unit last stride");
    r = tk.size(2);
    TORCH_CHECK(tk.size(0) == b && tk.size(1) == h_kv && tk.size(3) == d && tv.size(0) == b && tv.size(1) == h_kv &&
                    tv.size(2) == r && tv.size(3) == dv, name, "tail_keys / tail_values must be (b, h_kv, r, d / dv)");
  }
  const int64_t n = m + r;
  TORCH_CHECK(log_pi.scalar_type() == at::kFloat && log_pi.size(0) == b && log_pi.size(1) == h_kv &&
                  log_pi.size(2) == n, name, "log_pi must be float32 (b, h_kv, m + r)");
  TORCH_CHECK(q.size(0) == b && q.size(-1) == d && h_kv > 0 && q.size(1) % h_kv == 0, name,
              "q must be (b, h_q[, t], d) with h_q a multiple of h_kv");
  const int64_t G = q.size(1) / h_kv * (q.dim() == 4 ? q.size(2) : 1), H = b * h_kv;
  const auto lead = q.sizes().slice(0, q.dim() - 1);
  const at::Tensor qc = f32_contiguous(q.reshape({b, h_kv, G, d}));
  Shape S{H, h_kv, G, n, d, dv, 1, kHead + (combined ? 2 : 3) * dv, false};
  S.quant = true;
  S.combined = combined;
  S.splits = splits > 0 ? std::min(splits, std::max<int64_t>(1, n)) : auto_splits(H, n);
  auto f32 = q.options().dtype(at::kFloat);
  at::Tensor out = at::empty({b, h_kv, G, dv}, f32);
  at::Tensor lse = at::empty({b, h_kv, G}, f32), neff = at::empty({b, h_kv, G}, f32);
  at::Tensor trace = at::empty({b, h_kv, G}, f32);
  at::Tensor vq = combined ? at::empty({0}, f32) : at::empty({b, h_kv, G}, f32);
  const bool exact = layout == 2;
  const int8_t* kc = exact ? nullptr : key_codes.data_ptr<int8_t>();
  const float* kf = exact ? key_codes.data_ptr<float>() : nullptr;
  const c10::Half* ks = exact ? nullptr : key_scales->data_ptr<at::Half>();
  const int64_t ksh = exact ? 0 : (layout == 0 ? groups * d : m);  // one head's key scales
  const int8_t* vc = value_codes.data_ptr<int8_t>();
  const c10::Half* vs = value_scales.data_ptr<at::Half>();
  const float* tk = r ? tail_keys->data_ptr<float>() : nullptr;
  const float* tv = r ? tail_values->data_ptr<float>() : nullptr;
  const int64_t kcb = key_codes.stride(0), kch = key_codes.stride(1), kcn = key_codes.stride(2);
  const int64_t vcb = value_codes.stride(0), vch = value_codes.stride(1), vcn = value_codes.stride(2);
  const int64_t tkb = r ? tail_keys->stride(0) : 0, tkh = r ? tail_keys->stride(1) : 0, tkn = r ? tail_keys->stride(2) : 0;
  const int64_t tvb = r ? tail_values->stride(0) : 0, tvh = r ? tail_values->stride(1) : 0;
  const int64_t tvn = r ? tail_values->stride(2) : 0;
  run_with<false>(S, qc, log_pi, [&](int64_t bh) {
    const int64_t bi = bh / h_kv, hi = bh % h_kv;
    const int64_t ko = bi * kcb + hi * kch;
    return QuantKV{layout, m, group, d, dv, exact ? nullptr : kc + ko, kcn, exact ? kf + ko : nullptr, kcn,
                   exact ? nullptr : ks + bh * ksh, vc + bi * vcb + hi * vch, vcn, vs + bh * m,
                   r ? tk + bi * tkb + hi * tkh : nullptr, tkn, r ? tv + bi * tvb + hi * tvh : nullptr, tvn};
  }, nullptr, static_cast<float>(scale), out, lse, neff, trace, vq);
  std::vector<int64_t> row_shape(lead.begin(), lead.end());
  row_shape.push_back(dv);
  return {out.view(row_shape), lse.view(lead), neff.view(lead), trace.view(lead), combined ? vq : vq.view(lead)};
}

// A float32, contiguous copy of a form tensor (a no-op for the cached form's own) with `numel` elements.
at::Tensor form_tensor(const at::Tensor& x, int64_t numel, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), "hajek_decode_sketch: ", name, " must be a CPU tensor");
  TORCH_CHECK(x.numel() == numel, "hajek_decode_sketch: ", name, " must hold ", numel, " elements, got ", x.numel());
  return f32_contiguous(x);
}

// The sketch form's tensors (float32, contiguous) and the epilogue's outputs in the rows' leading shape `lead`.
struct FormCall {
  at::Tensor W, bias, weight, wnorm, tilt, mu, reach, variance, radius, bound, recorded;
  SketchForm form;
};

FormCall form_call(int64_t B, int64_t d, int64_t dv, at::IntArrayRef lead, const at::TensorOptions& f32,
                   const at::Tensor& W, const at::Tensor& bias, const at::Tensor& weight, const at::Tensor& wnorm,
                   const std::optional<at::Tensor>& tilt, const at::Tensor& smu, const std::optional<at::Tensor>& reach,
                   double factor, double clip) {
  TORCH_CHECK(W.dim() == 3 && W.size(0) == B && W.size(1) == 2 * d && W.size(2) % 2 == 0,
              "hajek_decode_sketch: W must be (b h_kv, 2 d, 2 C)");
  TORCH_CHECK(std::isfinite(factor) && factor > 0.0, "hajek_decode_sketch: factor must be finite and > 0");
  TORCH_CHECK(std::isfinite(clip) && clip >= 0.0, "hajek_decode_sketch: clip must be finite and >= 0");
  const int64_t C = W.size(2) / 2;
  FormCall c;
  c.W = form_tensor(W, B * 2 * d * 2 * C, "W");
  c.bias = form_tensor(bias, B * 2 * C, "bias");
  c.weight = form_tensor(weight, B * C, "weight");
  c.wnorm = form_tensor(wnorm, B * C, "wnorm");
  c.mu = form_tensor(smu, B * dv, "smu");
  if (tilt.has_value()) c.tilt = form_tensor(*tilt, B * d, "tilt");
  if (reach.has_value()) c.reach = form_tensor(*reach, B, "reach");
  c.variance = at::empty(lead, f32);
  c.radius = at::empty(lead, f32);
  c.bound = reach.has_value() ? at::empty(lead, f32) : at::empty({0}, f32);
  c.recorded = reach.has_value() && clip > 0.0 ? at::empty(lead, f32) : at::empty({0}, f32);
  c.form = SketchForm{c.W.data_ptr<float>(), c.bias.data_ptr<float>(), c.weight.data_ptr<float>(),
                      c.wnorm.data_ptr<float>(), tilt.has_value() ? c.tilt.data_ptr<float>() : nullptr,
                      c.mu.data_ptr<float>(), reach.has_value() ? c.reach.data_ptr<float>() : nullptr, C, factor, clip,
                      c.variance.data_ptr<float>(), c.radius.data_ptr<float>(),
                      reach.has_value() ? c.bound.data_ptr<float>() : nullptr,
                      c.recorded.numel() ? c.recorded.data_ptr<float>() : nullptr};
  return c;
}

// The cluster design's decode step in one call (kvcert.fast.sketch_hajek_attention with trace=False): the kept
// pass (kvcert.fast.sketch's _kept_pass with trace=False, in one read of K and V: o, lse, kappa = sum_S pi_i a_i and
// T' = sum_S pi_i (1 - pi_i) a_i^2 ||v_i - o||^2 centred around `center` = mu, with max_S ||v_i - mu||^2), then per
// row the sketch's certificate (sketch_row) from its decode form: W (B, 2d, 2C), bias (B, 2C), weight and wnorm
// (B, C), tilt (B, d) or None, smu (B, dv), reach (B) or None (B = b h_kv), `factor` the radius rule's c, `clip` a
// certificate kind's radius per unit root trace (0: none).
// q in the caller's layout, (b, h_q, d) or (b, h_q, t, d) (its g t rows per KV head share the pass); keys and values
// with any last stride (a copy where it is not 1), log_pi of any floating dtype (read as float32).
// Returns o (float32), lse, V_cl, the radius (capped at the bound), the hull bound (empty without reach) and the
// recorded trace min(V_cl, (bound / clip)^2) (empty without reach or clip), in q's leading shape (b, h_q[, t])
// (o with dv last).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> hajek_decode_sketch(
    const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& log_pi,
    const at::Tensor& center, double scale, int64_t splits, const at::Tensor& W, const at::Tensor& bias,
    const at::Tensor& weight, const at::Tensor& wnorm, const std::optional<at::Tensor>& tilt, const at::Tensor& smu,
    const std::optional<at::Tensor>& reach, double factor, double clip) {
  TORCH_CHECK((q.dim() == 3 || q.dim() == 4) && keys.dim() == 4 && values.dim() == 4,
              "hajek_decode_sketch: q must be (b, h_q[, t], d), keys and values 4-d");
  const int64_t b = keys.size(0), h_kv = keys.size(1), d = keys.size(3), dv = values.size(3);
  TORCH_CHECK(q.size(0) == b && q.size(-1) == d && h_kv > 0 && q.size(1) % h_kv == 0,
              "hajek_decode_sketch: q must be (b, h_q[, t], d) with h_q a multiple of h_kv");
  const int64_t G = q.size(1) / h_kv * (q.dim() == 4 ? q.size(2) : 1), B = b * h_kv;
  const auto lead = q.sizes().slice(0, q.dim() - 1);
  FormCall c = form_call(B, d, dv, lead, q.options().dtype(at::kFloat), W, bias, weight, wnorm, tilt, smu, reach,
                         factor, clip);
  const at::Tensor k = keys.stride(3) == 1 ? keys : keys.contiguous();
  const at::Tensor v = values.stride(3) == 1 ? values : values.contiguous();
  auto r = decode_dense(q.reshape({b, h_kv, G, d}), k, v, as_f32(log_pi), center, scale, false, splits, true,
                        &c.form);
  std::vector<int64_t> out_shape(lead.begin(), lead.end());
  out_shape.push_back(dv);
  return {std::get<0>(r).view(out_shape), std::get<1>(r).view(lead), c.variance, c.radius, c.bound, c.recorded};
}

// The checks of a paged call: q (E, h_kv, G, d); kv_cache (num_blocks, h_kv, bs, 2 d) float32 or bfloat16, contiguous
// (vLLM's CPU "vec" layout); block_ids (E, M) int64 in [0, num_blocks) (memory safety: always checked); log_pi
// (E, h_kv, M * bs) float32, -inf = not read.
void check_paged(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_ids,
                 const at::Tensor& log_pi) {
  TORCH_CHECK(q.dim() == 4 && kv_cache.dim() == 4 && block_ids.dim() == 2 && log_pi.dim() == 3,
              "hajek_decode_paged: q (E, h_kv, G, d), kv_cache (num_blocks, h_kv, bs, 2 d), block_ids (E, M), "
              "log_pi (E, h_kv, M * bs)");
  TORCH_CHECK(q.device().is_cpu() && kv_cache.device().is_cpu() && block_ids.device().is_cpu() &&
                  log_pi.device().is_cpu(), "hajek_decode_paged: CPU tensors only");
  TORCH_CHECK(kv_cache.scalar_type() == at::kFloat || kv_cache.scalar_type() == at::kBFloat16,
              "hajek_decode_paged: kv_cache must be float32 or bfloat16");
  TORCH_CHECK(kv_cache.is_contiguous(), "hajek_decode_paged: kv_cache must be contiguous");
  TORCH_CHECK(block_ids.scalar_type() == at::kLong && block_ids.is_contiguous(),
              "hajek_decode_paged: block_ids must be contiguous int64");
  TORCH_CHECK(log_pi.scalar_type() == at::kFloat && log_pi.is_contiguous(),
              "hajek_decode_paged: log_pi must be contiguous float32");
  const int64_t nb = kv_cache.size(0), h_kv = kv_cache.size(1), bs = kv_cache.size(2), d = kv_cache.size(3) / 2;
  const int64_t E = block_ids.size(0), M = block_ids.size(1), n = M * bs;
  TORCH_CHECK(kv_cache.size(3) == 2 * d, "hajek_decode_paged: kv_cache's last dimension must be 2 d");
  TORCH_CHECK(q.size(0) == E && q.size(1) == h_kv && q.size(3) == d, "hajek_decode_paged: q must be (E, h_kv, G, d)");
  TORCH_CHECK(log_pi.size(0) == E && log_pi.size(1) == h_kv && log_pi.size(2) == n,
              "hajek_decode_paged: log_pi must be (E, h_kv, M * bs)");
  if (block_ids.numel() > 0) {  // memory safety: every id a block of the cache
    const int64_t lo = block_ids.min().item<int64_t>(), hi = block_ids.max().item<int64_t>();
    TORCH_CHECK(lo >= 0 && hi < nb, "hajek_decode_paged: block_ids must lie in [0, ", nb, "), got [", lo, ", ",
                hi, "]");
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> hajek_decode_paged(
    const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_ids, const at::Tensor& log_pi,
    double scale, int64_t splits, double softcap) {
  check_paged(q, kv_cache, block_ids, log_pi);
  TORCH_CHECK(softcap >= 0.0 && std::isfinite(softcap), "hajek_decode_paged: softcap must be finite and >= 0 (0: none)");
  const int64_t h_kv = kv_cache.size(1), bs = kv_cache.size(2), d = kv_cache.size(3) / 2;
  const int64_t E = block_ids.size(0), M = block_ids.size(1), n = M * bs;
  const at::Tensor qc = f32_contiguous(q);
  const int64_t G = q.size(2), H = E * h_kv;
  Shape S{H, h_kv, G, n, d, d, 1, kHead + 2 * d, false};
  S.splits = splits > 0 ? std::min(splits, std::max<int64_t>(1, n)) : auto_splits(H, n);
  S.softcap = static_cast<float>(softcap);
  auto f32 = kv_cache.options().dtype(at::kFloat);
  at::Tensor out = at::empty({E, h_kv, G, d}, kv_cache.options());
  at::Tensor lse = at::empty({E, h_kv, G}, f32), neff = at::empty({E, h_kv, G}, f32);
  at::Tensor trace = at::empty({E, h_kv, G}, f32), var = at::empty({0}, f32);
  const float sc = static_cast<float>(scale);
  if (kv_cache.scalar_type() == at::kBFloat16)
    run_paged<c10::BFloat16>(S, qc, kv_cache, block_ids, log_pi, sc, out, lse, neff, trace, var);
  else
    run_paged<float>(S, qc, kv_cache, block_ids, log_pi, sc, out, lse, neff, trace, var);
  return {out, lse, neff, trace};
}

// The cluster design's decode step read from a paged cache (hajek_decode_paged's layout and checks; q (E, h_q, d)):
// the mean kept value mu of every head first (paged_kept_mean, a read of the kept values; with center_sums (E, h_kv,
// d + 1) float64 and tail_start (E,) int64, the kept values' sums and count of the slots before tail_start[e] are
// given and only the slots from there on are read), then hajek_decode_sketch's pass around it and its epilogue. Returns o (E, h_q, d) float32, lse, V_cl, the radius, the bound and the
// recorded trace (E, h_q) (hajek_decode_sketch's), and mu (E, h_kv, d).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
hajek_decode_sketch_paged(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_ids,
                          const at::Tensor& log_pi, double scale, int64_t splits, const at::Tensor& W,
                          const at::Tensor& bias, const at::Tensor& weight, const at::Tensor& wnorm,
                          const std::optional<at::Tensor>& tilt, const at::Tensor& smu,
                          const std::optional<at::Tensor>& reach, double factor, double clip,
                          const std::optional<at::Tensor>& center_sums, const std::optional<at::Tensor>& tail_start) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 4 && kv_cache.size(1) > 0 && q.size(1) % kv_cache.size(1) == 0,
              "hajek_decode_sketch_paged: q must be (E, h_q, d) with h_q a multiple of kv_cache's h_kv");
  TORCH_CHECK(center_sums.has_value() == tail_start.has_value(),
              "hajek_decode_sketch_paged: center_sums and tail_start go together");
  const int64_t E = q.size(0), h_q = q.size(1), h_kv = kv_cache.size(1), bs = kv_cache.size(2), d = q.size(2);
  const at::Tensor q4 = q.reshape({E, h_kv, h_q / h_kv, d});
  check_paged(q4, kv_cache, block_ids, log_pi);
  const int64_t n = block_ids.size(1) * bs, G = h_q / h_kv, H = E * h_kv;
  const auto f32 = kv_cache.options().dtype(at::kFloat);
  FormCall c = form_call(H, d, d, q.sizes().slice(0, 2), f32, W, bias, weight, wnorm, tilt, smu, reach, factor, clip);
  Shape S{H, h_kv, G, n, d, d, 1, kHead + 3 * d, false, true};
  S.splits = splits > 0 ? std::min(splits, std::max<int64_t>(1, n)) : auto_splits(H, n);
  at::Tensor mu = at::empty({E, h_kv, d}, f32);
  const double* base = nullptr;
  const int64_t* start = nullptr;
  at::Tensor base_t, start_t;
  if (center_sums.has_value()) {  // the kept values' sums and count before tail_start[e], given: read the rest only
    base_t = center_sums->contiguous();
    start_t = tail_start->contiguous();
    TORCH_CHECK(base_t.scalar_type() == at::kDouble && base_t.dim() == 3 && base_t.size(0) == E &&
                    base_t.size(1) == h_kv && base_t.size(2) == d + 1,
                "hajek_decode_sketch_paged: center_sums must be float64 (E, h_kv, d + 1)");
    TORCH_CHECK(start_t.scalar_type() == at::kLong && start_t.dim() == 1 && start_t.size(0) == E,
                "hajek_decode_sketch_paged: tail_start must be int64 (E,)");
    base = base_t.data_ptr<double>();
    start = start_t.data_ptr<int64_t>();
  }
  const at::Tensor qc = f32_contiguous(q4);
  at::Tensor out = at::empty({E, h_kv, G, d}, f32);
  at::Tensor lse = at::empty({E, h_kv, G}, f32), neff = at::empty({E, h_kv, G}, f32);
  at::Tensor trace = at::empty({E, h_kv, G}, f32), var = at::empty({0}, f32);
  const float sc = static_cast<float>(scale);
  if (kv_cache.scalar_type() == at::kBFloat16) {
    paged_kept_mean<c10::BFloat16>(S, kv_cache, block_ids, log_pi, mu.data_ptr<float>(), base, start);
    run_paged<c10::BFloat16>(S, qc, kv_cache, block_ids, log_pi, sc, out, lse, neff, trace, var, mu.data_ptr<float>(),
                             &c.form);
  } else {
    paged_kept_mean<float>(S, kv_cache, block_ids, log_pi, mu.data_ptr<float>(), base, start);
    run_paged<float>(S, qc, kv_cache, block_ids, log_pi, sc, out, lse, neff, trace, var, mu.data_ptr<float>(),
                     &c.form);
  }
  return {out.view({E, h_q, d}), lse.view({E, h_q}), c.variance, c.radius, c.bound, c.recorded, mu};
}

}  // namespace

TORCH_LIBRARY(kvcert_cpu, m) {
  m.def("hajek_decode(Tensor q, Tensor keys, Tensor values, Tensor log_pi, Tensor? center, float scale, "
        "bool per_coordinate, int splits) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("hajek_decode_sketch(Tensor q, Tensor keys, Tensor values, Tensor log_pi, Tensor center, float scale, "
        "int splits, Tensor W, Tensor bias, Tensor weight, Tensor wnorm, Tensor? tilt, Tensor smu, Tensor? reach, "
        "float factor, float clip) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("hajek_decode_paged(Tensor q, Tensor kv_cache, Tensor block_ids, Tensor log_pi, float scale, int splits, "
        "float softcap=0.0) "
        "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def("hajek_decode_sketch_paged(Tensor q, Tensor kv_cache, Tensor block_ids, Tensor log_pi, float scale, "
        "int splits, Tensor W, Tensor bias, Tensor weight, Tensor wnorm, Tensor? tilt, Tensor smu, Tensor? reach, "
        "float factor, float clip, Tensor? center_sums, Tensor? tail_start) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("hajek_decode_quantized(Tensor q, Tensor key_codes, Tensor? key_scales, Tensor value_codes, "
        "Tensor value_scales, Tensor log_pi, Tensor? tail_keys, Tensor? tail_values, float scale, int layout, "
        "int group, int splits, bool combined) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvcert_cpu, CPU, m) {
  m.impl("hajek_decode", &hajek_decode);
  m.impl("hajek_decode_sketch", &hajek_decode_sketch);
  m.impl("hajek_decode_paged", &hajek_decode_paged);
  m.impl("hajek_decode_sketch_paged", &hajek_decode_sketch_paged);
  m.impl("hajek_decode_quantized", &hajek_decode_quantized);
}
