// Host twin of the K-quant decode kernels' chunk math (csrc/kquant/kquant.cuh), for tests/gguf/test_kquant_host.py.
// stdin: int32 type, rows, cols, n, warps; uint8 weights[rows * row_bytes]; float x[n * cols].
// stdout: float out[n * rows].
// warps = 0: the dp4a forms: each row summed as a warp does, lane l holding chunks l, l + 32, ..., the 32
//   lane partials meeting in the xor tree of kq_warp_sum.
// warps = W > 0: the mma forms (kquant_mma.cuh) with W warps a tile: the activations in their order
//   (kq_mma_x_put), every lane's operands from kq_unit_load / kq_unit_chunk and, through a stage filled as
//   kq_mma_xcopy fills it, kq_xstage_ops / kq_xstage_scales, the int8 mma done as PTX defines its fragments (m16n8k32: A regs 0-3 = (row g, k-int t), (g + 8, t), (g, 4 + t),
//   (g + 8, 4 + t); B regs 0-1 = (k-int t, column g), (4 + t, g); C regs 0-3 = (g, 2t), (g, 2t + 1), (g + 8, 2t),
//   (g + 8, 2t + 1)), Q6_K's two half-masked mma, the kernel's per-chunk and per-unit scaling
//   (kq_mma_chunk / kq_mma_unit_end) and its warp-order reduction.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <vector>
#include "kquant.cuh"

static int byte_of(kq_u32 w, int i) { return (int)(kq_i8)((w >> (8 * i)) & 0xFF); }

// C[16][8] of one m16n8k32 mma from the lanes' registers.
static void mma(const kq_u32 a[32][4], const kq_u32 b[32][2], int c[32][4]) {
  int A[16][32] = {}, B[32][8] = {};
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    for (int r = 0; r < 4; ++r)
      for (int i = 0; i < 4; ++i) A[g + 8 * (r & 1)][4 * (t + 4 * (r >> 1)) + i] = byte_of(a[lane][r], i);
    for (int r = 0; r < 2; ++r)
      for (int i = 0; i < 4; ++i) B[4 * (t + 4 * r) + i][g] = byte_of(b[lane][r], i);
  }
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    for (int j = 0; j < 4; ++j) {
      const int row = g + 8 * (j >> 1), col = 2 * t + (j & 1);
      int s = 0;
      for (int k = 0; k < 32; ++k) s += A[row][k] * B[k][col];
      c[lane][j] = s;
    }
  }
}

static void mma_forms(int type, const kq_u8* w, long row_bytes, int rows, int cols, int n, int warps,
                      const std::vector<kq_u32>& xq, const std::vector<float>& xs, std::vector<float>& out) {
  const int units = cols / FC_KQ_UNIT;
  const bool mins = type == FC_KQ_Q4_K || type == FC_KQ_Q5_K;
  for (int r0 = 0; r0 < rows; r0 += 16) {
    std::vector<float> acc((size_t)warps * 32 * 4, 0.f);
    for (int wp = 0; wp < warps; ++wp) {
      for (int u = wp; u < units; u += warps) {
        static KqUnit ua[32], ub[32];
        static KqXUnit x[32];
        float uacc[32][4] = {}, umin[32][4] = {};
        // The unit's activations into a stage as kq_mma_xcopy places them (slot j: vector min(j, n - 1)), every
        // 16-byte piece from the same source bytes; Q6_K / Q8_0 copy no sums.
        alignas(16) static kq_u8 xst[FC_KQ_MMA_XSTAGE];
        std::fill(xst, xst + FC_KQ_MMA_XSTAGE, 0xA5);
        const kq_u8* xqb = reinterpret_cast<const kq_u8*>(xq.data());
        const kq_u8* xsb = reinterpret_cast<const kq_u8*>(xs.data());
        for (int j = 0; j < 8; ++j) {
          const long v = std::min(j, n - 1);
          for (int p = 0; p < 16; ++p) memcpy(xst + kq_xstage_op(j, p), xqb + v * cols + u * 256L + 16 * p, 16);
          for (int q = 0; q < (mins ? 4 : 2); ++q)
            memcpy(xst + kq_xstage_float(j, q), xsb + v * (cols / 4) + u * 64L + 16 * q, 16);
        }
        for (int lane = 0; lane < 32; ++lane) {
          const int g = lane / 4, t = lane % 4;
          kq_unit_load(type, w + (long)std::min(r0 + g, rows - 1) * row_bytes, u, t, &ua[lane]);
          kq_unit_load(type, w + (long)std::min(r0 + g + 8, rows - 1) * row_bytes, u, t, &ub[lane]);
          for (int h = 0; h < 2; ++h) {  // as kq_mma_tile, from the stage
            if (mins) {
              kq_xstage_scales<true>(xst, t, h, &x[lane]);
            } else {
              kq_xstage_scales<false>(xst, t, h, &x[lane]);
            }
          }
          for (int i = 0; i < 4; ++i) kq_xstage_ops(xst, g, t, i, &x[lane]);
        }
        for (int m = 0; m < 8; ++m) {
          KqFrag fa[32], fb[32];
          kq_u32 A[32][4], B[32][2], Bh[32][2];
          for (int lane = 0; lane < 32; ++lane) {
            const int t = lane % 4;
            kq_unit_chunk(type, ua[lane], m, &fa[lane]);
            kq_unit_chunk(type, ub[lane], m, &fb[lane]);
            A[lane][0] = fa[lane].q[0], A[lane][1] = fb[lane].q[0];
            A[lane][2] = fa[lane].q[1], A[lane][3] = fb[lane].q[1];
            const kq_u32 first = type == FC_KQ_Q6_K ? (t < 2 ? 0xFFFFFFFFu : 0u) : 0xFFFFFFFFu;
            for (int j = 0; j < 2; ++j) {
              B[lane][j] = x[lane].b[2 * m + j] & first;
              Bh[lane][j] = x[lane].b[2 * m + j] & ~first;
            }
          }
          int r[32][4], r2[32][4] = {};
          mma(A, B, r);
          if (type == FC_KQ_Q6_K) mma(A, Bh, r2);
          for (int lane = 0; lane < 32; ++lane)
            kq_mma_chunk(type, fa[lane], fb[lane], r[lane], r2[lane], x[lane], m, uacc[lane], umin[lane]);
        }
        for (int lane = 0; lane < 32; ++lane)
          kq_mma_unit_end(type, ua[lane], ub[lane], uacc[lane], umin[lane], &acc[(size_t)wp * 128 + lane * 4]);
      }
    }
    for (int lane = 0; lane < 32; ++lane) {
      const int g = lane / 4, t = lane % 4;
      for (int j = 0; j < 4; ++j) {
        float sum = acc[lane * 4 + j];
        for (int wp = 1; wp < warps; ++wp) sum += acc[(size_t)wp * 128 + lane * 4 + j];
        const int r = r0 + g + 8 * (j >> 1), v = 2 * t + (j & 1);
        if (r < rows && v < n) out[(size_t)v * rows + r] = sum;
      }
    }
  }
}

int main() {
  int hdr[5];
  if (fread(hdr, 4, 5, stdin) != 5) return 2;
  const int type = hdr[0], rows = hdr[1], cols = hdr[2], n = hdr[3], warps = hdr[4];
  const long row_bytes = (long)cols / kq_block_values(type) * kq_block_bytes(type);
  std::vector<kq_u8> w((size_t)rows * row_bytes + 16);
  std::vector<float> x((size_t)n * cols);
  if (fread(w.data(), 1, (size_t)rows * row_bytes, stdin) != (size_t)rows * row_bytes) return 3;
  if (fread(x.data(), 4, x.size(), stdin) != x.size()) return 4;
  if (warps < 0) {  // the weights dequantized, as fc_kq_dequant writes them (before the dtype's rounding)
    std::vector<float> wv((size_t)rows * cols);
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < cols / FC_KQ_CHUNK; ++c)
        kq_dequant_chunk(type, w.data() + (size_t)r * row_bytes, c, &wv[(size_t)r * cols + c * FC_KQ_CHUNK]);
    fwrite(wv.data(), 4, wv.size(), stdout);
    return 0;
  }
  const int chunks = cols / FC_KQ_CHUNK;
  std::vector<kq_u32> xq((size_t)n * chunks * 8);
  std::vector<float> xd((size_t)n * chunks), xs((size_t)n * chunks);
  for (int v = 0; v < n; ++v)
    for (int c = 0; c < chunks; ++c)
      kq_quantize_chunk(&x[(size_t)v * cols + c * FC_KQ_CHUNK], &xq[((size_t)v * chunks + c) * 8],
                        &xd[(size_t)v * chunks + c], &xs[(size_t)v * chunks + c]);
  std::vector<float> out((size_t)n * rows);
  if (warps > 0) {  // the activations as fc_kq_quantize writes them for the mma forms
    std::vector<kq_u32> mq((size_t)n * cols / 4);
    std::vector<float> ms((size_t)n * cols / 16);
    for (int v = 0; v < n; ++v)
      for (int c = 0; c < chunks; ++c) {
        const size_t i = (size_t)v * chunks + c;
        kq_mma_x_put(c, &xq[i * 8], xd[i], xs[i], &mq[(size_t)v * cols / 4], &ms[(size_t)v * cols / 16]);
      }
    mma_forms(type, w.data(), row_bytes, rows, cols, n, warps, mq, ms, out);
    fwrite(out.data(), 4, out.size(), stdout);
    return 0;
  }
  for (int r = 0; r < rows; ++r) {
    for (int v = 0; v < n; ++v) {
      float lane[32] = {0};
      for (int c = 0; c < chunks; ++c) {
        KqChunk k;
        kq_decode_chunk(type, w.data() + (size_t)r * row_bytes, c, &k);
        const size_t i = (size_t)v * chunks + c;
        lane[c % 32] += kq_chunk_dot(k, &xq[i * 8], xd[i], xs[i]);
      }
      for (int o = 16; o > 0; o >>= 1) {
        float next[32];
        for (int l = 0; l < 32; ++l) next[l] = lane[l] + lane[l ^ o];
        for (int l = 0; l < 32; ++l) lane[l] = next[l];
      }
      out[(size_t)v * rows + r] = lane[0];
    }
  }
  fwrite(out.data(), 4, out.size(), stdout);
  return 0;
}
