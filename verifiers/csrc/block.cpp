// Fused block verification of sampled chains on the CPU (the procedure and its contract are
// verifiers/block.py's docstring; the PyTorch code there is the other backend).
//
// Phases, with no temporaries of vocabulary size:
//   1. one pass per target / draft row (all rows in parallel): max, NaN check, sum exp(z - max);
//   2. per batch row, serially: p(x_j), q(x_j) and the running weights w_j;
//   3. in parallel: the residual masses r_j = sum (w_j p_j - q_j)+ at the positions 1..K-1 a row
//      may stop at (none where the whole block stands, u_K < w_K; 0 without a pass where w_j = 0);
//   4. per batch row: the stop n (the longest prefix whose test passes), the block sums of the
//      final token's weights, its inverse-CDF search, and the outputs (log p of every token).
// A row's reduction runs on one thread, so results do not depend on the thread count.

#include <ATen/Parallel.h>

#include "common.h"

namespace {

struct Block {
  const float* target;  // [B, K+1, V]
  const float* draft;   // [B, K, V]
  int64_t K, V;
  float temperature;

  RowView trow(int64_t b, int64_t j) const { return {target + (b * (K + 1) + j) * V, V, temperature}; }
  RowView drow(int64_t b, int64_t j) const { return {draft + (b * K + j) * V, V, temperature}; }

  // (w p_j(i) - q_j(i))+ at token i of row b, position j < K.
  auto residual(int64_t b, int64_t j, float w, const RowStats& ts, const RowStats& qs) const {
    const float tm = ts.zmax, ti = ts.inv_sum, qm = qs.zmax, qi = qs.inv_sum, t = temperature;
    const float *td = trow(b, j).data, *dd = drow(b, j).data;
    return [=](int64_t i) {
      const float zt = t == 1.0f ? td[i] : td[i] / t;
      const float zq = t == 1.0f ? dd[i] : dd[i] / t;
      const float r = w * (exp_nonpos(zt - tm) * ti) - exp_nonpos(zq - qm) * qi;
      return r > 0 ? r : 0.0f;
    };
  }

  auto target_p(int64_t b, int64_t j, const RowStats& ts) const {
    const float tm = ts.zmax, ti = ts.inv_sum, t = temperature;
    const float* td = trow(b, j).data;
    return [=](int64_t i) { return exp_nonpos((t == 1.0f ? td[i] : td[i] / t) - tm) * ti; };
  }
};

}  // namespace

extern "C" {

// Returns 0, or 1 when a logit row is bad (bad_rows[B*(K+1) + B*K] flags which: target rows
// first, then draft rows), 2 when a draft token has q = 0 (bad_token = [b, j]), 3 when a final
// token's weights have no mass (an internal error), or 4 when a draft token is outside [0, V).
// u_block [B, K+1] float64, u_final [B] float32; logp [B, K+1] is log p at each emitted token.
int64_t hr_verify_block(const float* target, const float* draft, const int64_t* x, const double* u_block,
                        const float* u_final, int64_t B, int64_t K, int64_t V, double temperature,
                        int64_t* tokens, int64_t* num_emitted, float* logp, int8_t* kinds, uint8_t* bad_rows,
                        int64_t* bad_token) {
  for (int64_t i = 0; i < B * K; ++i)
    if (x[i] < 0 || x[i] >= V) return 4;  // the caller names the token
  const Block bk{target, draft, K, V, static_cast<float>(temperature)};
  const int64_t nt = B * (K + 1), nd = B * K;
  std::vector<RowStats> ts(nt), qs(nd);

  // phase 1: every target and draft row
  at::parallel_for(0, nt + nd, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      if (r < nt) {
        ts[r] = row_stats(bk.trow(r / (K + 1), r % (K + 1)), false, false);
      } else {
        const int64_t d = r - nt;
        qs[d] = row_stats(bk.drow(d / K, d % K), false, false);
      }
    }
  });
  bool any_bad = false;
  for (int64_t r = 0; r < nt; ++r) any_bad |= (bad_rows[r] = ts[r].bad);
  for (int64_t d = 0; d < nd; ++d) any_bad |= (bad_rows[nt + d] = qs[d].bad);
  if (any_bad) return 1;

  // phase 2: p(x_j), q(x_j) and the weights w_0..w_K (float64, as the PyTorch path)
  std::vector<float> p_x(nd);
  std::vector<double> w(B * (K + 1));
  for (int64_t b = 0; b < B; ++b) {
    double* wb = &w[b * (K + 1)];
    wb[0] = 1.0;
    for (int64_t j = 0; j < K; ++j) {
      const int64_t xj = x[b * K + j];
      p_x[b * K + j] = prob(bk.trow(b, j), ts[b * (K + 1) + j], xj);
      const float q_x = prob(bk.drow(b, j), qs[b * K + j], xj);
      if (!(q_x > 0)) {
        bad_token[0] = b;
        bad_token[1] = j;
        return 2;
      }
      const double next = wb[j] * (static_cast<double>(p_x[b * K + j]) / static_cast<double>(q_x));
      wb[j + 1] = next < 1.0 ? next : 1.0;
    }
  }

  // phase 3: the residual masses a row may need (it stops below K only if u_K >= w_K)
  struct Task { int64_t b, j; };
  std::vector<Task> tasks;
  std::vector<double> r(nd, 0.0);
  for (int64_t b = 0; b < B; ++b)
    if (!(u_block[b * (K + 1) + K] < w[b * (K + 1) + K]))
      for (int64_t j = 1; j < K; ++j)
        if (w[b * (K + 1) + j] > 0) tasks.push_back({b, j});
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t b = tasks[i].b, j = tasks[i].j;
      const auto weight = bk.residual(b, j, static_cast<float>(w[b * (K + 1) + j]), ts[b * (K + 1) + j],
                                      qs[b * K + j]);
      double s = 0;
#pragma omp simd reduction(+ : s)
      for (int64_t v = 0; v < V; ++v) s += static_cast<double>(weight(v));
      r[b * K + j] = s;
    }
  });

  // phase 4: the stop, the final token and the outputs
  const int64_t nblocks = (V + kBlock - 1) / kBlock;
  std::vector<uint8_t> empty(B, 0);
  at::parallel_for(0, B, 1, [&](int64_t lo, int64_t hi) {
    std::vector<double> sums(nblocks);
    for (int64_t b = lo; b < hi; ++b) {
      const double* wb = &w[b * (K + 1)];
      const double* ub = &u_block[b * (K + 1)];
      int64_t n = 0;
      if (ub[K] < wb[K]) {
        n = K;
      } else {
        for (int64_t j = K - 1; j >= 1; --j) {
          const double rj = r[b * K + j], den = rj + 1.0 - wb[j];
          const double h = den > 0 ? rj / den : 1.0;
          if (ub[j] < h) {
            n = j;
            break;
          }
        }
      }
      const RowStats& tf = ts[b * (K + 1) + n];
      double r_y = 0;
      int64_t y = -1;
      bool residual = n < K;
      if (residual) {
        const auto weight = bk.residual(b, n, static_cast<float>(wb[n]), tf, qs[b * K + n]);
        weight_block_sums(V, weight, sums.data());
        double total = 0;
        for (int64_t k = 0; k < nblocks; ++k) total += sums[k];
        if (total > 0)
          y = sample_blocks(sums.data(), nblocks, V, weight, u_final[b], r_y);
        else
          residual = false;  // p_n <= q_n everywhere with w_n = 1: the residual is p_n
      }
      if (!residual) {
        const auto weight = bk.target_p(b, n, tf);
        weight_block_sums(V, weight, sums.data());
        y = sample_blocks(sums.data(), nblocks, V, weight, u_final[b], r_y);
      }
      if (y < 0) {
        empty[b] = 1;
        continue;
      }
      int64_t* tok = tokens + b * (K + 1);
      float* lp = logp + b * (K + 1);
      int8_t* kd = kinds + b * (K + 1);
      for (int64_t j = 0; j < n; ++j) {
        tok[j] = x[b * K + j];
        lp[j] = std::log(p_x[b * K + j]);
        kd[j] = 0;
      }
      tok[n] = y;
      lp[n] = std::log(prob(bk.trow(b, n), tf, y));
      kd[n] = n == K ? 2 : 1;
      for (int64_t j = n + 1; j <= K; ++j) {
        tok[j] = -1;
        lp[j] = 0;
        kd[j] = -1;
      }
      num_emitted[b] = n + 1;
    }
  });
  for (int64_t b = 0; b < B; ++b)
    if (empty[b]) return 3;
  return 0;
}

}  // extern "C"
