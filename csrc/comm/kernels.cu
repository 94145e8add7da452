// The launch file: one extern "C" entry point per (kernel family, dtype), so the host can look kernels up
// by plain names (fc_<family>_<dtype>) without C++ name mangling.
#include "common.cuh"
#include "one_shot.cuh"
#include "two_shot.cuh"
#include "two_shot_ll.cuh"
#include "two_shot_islands.cuh"
#include "fused_rmsnorm.cuh"
#include "pull.cuh"
#include "fused_two_shot.cuh"
#include "fused_cluster.cuh"
#include "p2p_check.cuh"

// The fused kernel comes in K = 1, 2, 4, 8 (fc_fused_rmsnorm<K>_<dtype>), and for islands in one launch
// (fc_fused_rmsnorm_islands<K>_<dtype>: the island's table, then the partners').
#define FC_DEFINE_FUSED(NAME, D, K)                                                                            \
  extern "C" __global__ void __launch_bounds__(1024)                                                           \
      fc_fused_rmsnorm##K##_##NAME(const FcTable* t, const char* in, const char* residual, const char* weight,  \
                                   char* out, char* residual_out, u32 tokens, u32 hidden, u32 splits,         \
                                   float eps) {                                                                \
    fc_fused_rmsnorm<D, K, false>(t, t, in, residual, weight, out, residual_out, tokens, hidden, splits, eps);  \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(1024)                                                           \
      fc_fused_rmsnorm_islands##K##_##NAME(const FcTable* ti, const FcTable* tp, const char* in,                \
                                           const char* residual, const char* weight, char* out,               \
                                           char* residual_out, u32 tokens, u32 hidden, u32 splits,            \
                                           float eps) {                                                        \
    fc_fused_rmsnorm<D, K, true>(ti, tp, in, residual, weight, out, residual_out, tokens, hidden, splits, eps); \
  }

#define FC_DEFINE(NAME, D)                                                                                     \
  extern "C" __global__ void __launch_bounds__(256) fc_one_shot_##NAME(const FcTable* t, const char* in,       \
                                                                      char* out, u64 nbytes) {                \
    fc_one_shot<D>(t, in, out, nbytes);                                                                        \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(256)                                                            \
      fc_one_shot_islands_##NAME(const FcTable* ti, const FcTable* tp, const char* in, char* out, u64 nbytes) {  \
    fc_one_shot_islands<D>(ti, tp, in, out, nbytes);                                                           \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(512) fc_two_shot_##NAME(const FcTable* t, const char* in,       \
                                                                      char* out, u64 n, u64 seg, u64 chunk) {  \
    fc_two_shot<D>(t, in, out, n, seg, chunk);                                                                 \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(512)                                                            \
      fc_two_shot_islands_##NAME(const FcTable* ti, const FcTable* tp, const char* in, char* out, u64 n,         \
                                 u64 seg, u64 chunk) {                                                         \
    fc_two_shot_islands<D>(ti, tp, in, out, n, seg, chunk);                                                    \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(256) fc_two_shot_ll_##NAME(const FcTable* t, const char* in,    \
                                                                         char* out, u64 nbytes) {             \
    fc_two_shot_ll<D>(t, in, out, nbytes);                                                                     \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(512) fc_pull_##NAME(const FcTable* t, const char* in, char* out, \
                                                                  u64 nbytes, u64 chunk) {                    \
    fc_pull<D>(t, in, out, nbytes, chunk);                                                                     \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(512)                                                            \
      fc_pull2_##NAME(const FcTable* t, const char* in, char* out, u64 nbytes, u64 seg, u64 chunk) {           \
    fc_pull2<D>(t, in, out, nbytes, seg, chunk);                                                               \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(1024)                                                           \
      fc_fused_two_shot_##NAME(const FcTable* t, const char* in, const char* residual, const char* weight,     \
                               char* out, char* residual_out, u32 tokens, u32 hidden, u32 cols, u32 splits,  \
                               float eps) {                                                                    \
    fc_fused_two_shot<D>(t, in, residual, weight, out, residual_out, tokens, hidden, cols, splits, eps);       \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(1024)                                                           \
      fc_fused_cluster_##NAME(const FcTable* t, const char* in, const char* residual, const char* weight,      \
                              char* out, char* residual_out, u32 tokens, u32 hidden, u32 splits, float eps) {  \
    fc_fused_cluster<D>(t, in, residual, weight, out, residual_out, tokens, hidden, splits, eps);             \
  }                                                                                                            \
  FC_DEFINE_FUSED(NAME, D, 1)                                                                                  \
  FC_DEFINE_FUSED(NAME, D, 2)                                                                                  \
  FC_DEFINE_FUSED(NAME, D, 4)                                                                                  \
  FC_DEFINE_FUSED(NAME, D, 8)

FC_DEFINE(bf16, FcBF16)
FC_DEFINE(f16, FcF16)
FC_DEFINE(f32, FcF32)

// Untyped: one entry point, no dtype suffix.
extern "C" __global__ void __launch_bounds__(256) fc_p2p_check(char* dst, u64 pattern, u32 count) {
  fc_p2p_check_body(dst, pattern, count);
}
