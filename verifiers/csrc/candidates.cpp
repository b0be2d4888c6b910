// Fused verification over deterministic candidates on the CPU (verifiers/candidates.py is the
// contract; verifiers/README.md has the math): node n examines c_1..c_m in order, accepting c_i
// with alpha_i = node_alpha(s(c_i), p(c_i)), where s(c_i) is p(c_i) over the mass not yet
// rejected; if none is accepted the token comes from the fallback (p without the candidates;
// p itself where MARS relaxes). One task per node; a node's reductions run on one thread.
//
// The rule-specific steps come from rules.h, the shared row work from common.h.

#include <ATen/Parallel.h>

#include <utility>

#include "rules.h"

namespace {

struct NodeKernel {
  const float* target;  // [N, V]
  const int64_t* cands;  // [N, M], -1 padded after the valid ones
  int64_t M, V;
  float temperature;
  Params prm;

  // Returns 0, 1 (bad logit row) or 3 (every candidate rejected and the fallback is empty).
  int node(int64_t n, float u_fin, const float* u_acc, int64_t& y, int64_t& index, float& blp, float& tlp,
           bool& rel, std::vector<double>& sums) const {
    const RowView rv{target + n * V, V, temperature};
    const int64_t* c = cands + n * M;
    const bool top2 = wants_top2(prm), typical = wants_entropy(prm);
    RowStats st;
    float raw_max, raw_second;
    if (!row_top(rv, top2, st, raw_max, raw_second)) return 1;
    if (top2) top2_tokens(rv, raw_max, raw_second, st);
    const float zmax = st.zmax;
    int64_t m = 0;  // valid candidates
    while (m < M && c[m] >= 0) ++m;
    std::vector<int64_t> sorted(c, c + m);
    for (int64_t i = 1; i < m; ++i)
      for (int64_t j = i; j > 0 && sorted[j - 1] > sorted[j]; --j) std::swap(sorted[j - 1], sorted[j]);
    // sum exp(z - zmax) over the non-candidates, segment by segment (no cancellation later)
    double rest_e = 0, h = 0;  // float64 sums (see common.h's row_stats)
    const float t = temperature;
    int64_t lo = 0;
    for (int64_t k = 0; k <= m; ++k) {
      const int64_t hi = k < m ? sorted[k] : V;
      double s = 0, hh = 0;
#pragma omp simd reduction(+ : s, hh)
      for (int64_t i = lo; i < hi; ++i) {
        const float d = (t == 1.0f ? rv.data[i] : rv.data[i] / t) - zmax;
        const float e = exp_nonpos(d);
        s += e;
        hh += typical && e > 0 ? e * d : 0.0f;
      }
      rest_e += s;
      h += hh;
      lo = hi + 1;
    }
    std::vector<float> e_c(m);
    double cand_e = 0;
    for (int64_t i = 0; i < m; ++i) {
      const float d = rv.z(c[i]) - zmax;
      e_c[i] = exp_nonpos(d);
      cand_e += e_c[i];
      if (typical && e_c[i] > 0) h += e_c[i] * d;
    }
    st.inv_sum = static_cast<float>(1.0 / (rest_e + cand_e));
    st.zsum_term = static_cast<float>(h);
    const float inv = st.inv_sum, rest = static_cast<float>(rest_e) * inv;
    bool relax;
    float thr;
    rule_context(prm, st, relax, thr);
    // the walk: remaining mass when c_i is examined = non-candidates + c_i..c_m
    std::vector<float> p_c(m), s_c(m), al(m);
    for (int64_t i = 0; i < m; ++i) p_c[i] = e_c[i] * inv;
    float tail = 0;
    for (int64_t i = m - 1; i >= 0; --i) {
      tail += p_c[i];
      const float remaining = rest + tail;
      const float sc = remaining > 0 ? p_c[i] / remaining : 0.0f;
      s_c[i] = sc > 1.0f ? 1.0f : sc;
    }
    index = -1;
    double log_reach = 0;  // log prob of reaching the current candidate
    std::vector<double> lr(m + 1);
    for (int64_t i = 0; i < m; ++i) {
      al[i] = node_alpha(prm, s_c[i], p_c[i], c[i], relax, thr, st);
      lr[i] = log_reach;
      if (index < 0 && u_acc[i] < al[i]) index = i;
      log_reach += std::log1p(-static_cast<double>(al[i]));
    }
    lr[m] = log_reach;
    const bool fb_is_p = node_fallback_is_p(prm, relax);
    const double fb_mass = fb_is_p ? 1.0 : static_cast<double>(rest);
    auto fb_weight = [&](int64_t i) -> float {
      const float p = prob(rv, st, i);
      if (fb_is_p) return p;
      for (int64_t k = 0; k < m; ++k)
        if (c[k] == i) return 0.0f;
      return p;
    };
    if (index >= 0) {
      y = c[index];
      rel = al[index] > s_c[index];
    } else {
      if (!(fb_mass > 0)) return 3;
      const int64_t nblocks = (V + kBlock - 1) / kBlock;
      sums.assign(nblocks, 0.0);
      p_block_sums(rv, st, c, fb_is_p ? 0 : m, sums.data());
      double r_y = 0;
      y = sample_blocks(sums.data(), nblocks, V, fb_weight, u_fin, r_y);
      if (y < 0) return 3;
      rel = false;
    }
    const float p_y = prob(rv, st, y);
    tlp = std::log(p_y);
    // log P(y) = log(reach_i alpha_i [y = c_i] + reach_{m+1} fallback(y) / |fallback|)
    double P = 0;
    for (int64_t i = 0; i < m; ++i)
      if (c[i] == y) P += std::exp(lr[i]) * al[i];
    if (fb_mass > 0) P += std::exp(lr[m]) * static_cast<double>(fb_weight(y)) / fb_mass;
    blp = static_cast<float>(std::log(P));
    return 0;
  }
};

}  // namespace

extern "C" {

// Returns 0, 1 when a logit row is bad (bad_rows[N] flags which), 3 when a node rejected
// every candidate and its fallback has no mass (an internal error), or 4 when the candidates
// are not distinct ids in [0, V) with -1 padding after them.
int64_t hr_verify_candidates(const float* target, const int64_t* cands, const float* u_accept,
                             const float* u_final, int64_t N, int64_t M, int64_t V, double temperature,
                             const Params* prm, int64_t* tokens, int64_t* index, float* behaviour,
                             float* target_lp, bool* relaxed, uint8_t* bad_rows) {
  for (int64_t n = 0; n < N; ++n) {  // ids in [-1, V), padding last, valid ones distinct
    const int64_t* c = cands + n * M;
    for (int64_t i = 0; i < M; ++i) {
      if (c[i] < -1 || c[i] >= V || (i > 0 && c[i] >= 0 && c[i - 1] < 0)) return 4;
      for (int64_t j = 0; j < i && c[i] >= 0; ++j)
        if (c[j] == c[i]) return 4;
    }
  }
  NodeKernel kn{target, cands, M, V, static_cast<float>(temperature), *prm};
  std::vector<int> status(N, 0);
  at::parallel_for(0, N, 1, [&](int64_t lo, int64_t hi) {
    std::vector<double> sums;
    for (int64_t n = lo; n < hi; ++n)
      status[n] = kn.node(n, u_final[n], u_accept + n * M, tokens[n], index[n], behaviour[n], target_lp[n],
                          relaxed[n], sums);
  });
  int64_t worst = 0;
  for (int64_t n = 0; n < N; ++n) {
    bad_rows[n] = status[n] == 1;
    if (status[n] == 1) worst = 1;
    else if (status[n] == 3 && worst == 0) worst = 3;
  }
  return worst;
}

}  // extern "C"
