// Host twin of the K-quant decode kernels' chunk math (csrc/kquant.cuh), for tests/gguf/test_kquant_host.py.
// stdin: int32 type, rows, cols, n; uint8 weights[rows * row_bytes]; float x[n * cols].
// stdout: float out[n * rows], each row summed as a warp does: lane l holds chunks l, l + 32, ..., and the
// 32 lane partials meet in the xor tree of kq_warp_sum.
#include <cstdio>
#include <vector>
#include "kquant.cuh"

int main() {
  int hdr[4];
  if (fread(hdr, 4, 4, stdin) != 4) return 2;
  const int type = hdr[0], rows = hdr[1], cols = hdr[2], n = hdr[3];
  const long row_bytes = (long)cols / kq_block_values(type) * kq_block_bytes(type);
  std::vector<kq_u8> w((size_t)rows * row_bytes + 16);
  std::vector<float> x((size_t)n * cols);
  if (fread(w.data(), 1, (size_t)rows * row_bytes, stdin) != (size_t)rows * row_bytes) return 3;
  if (fread(x.data(), 4, x.size(), stdin) != x.size()) return 4;
  const int chunks = cols / FC_KQ_CHUNK;
  std::vector<kq_u32> xq((size_t)n * chunks * 8);
  std::vector<float> xd((size_t)n * chunks), xs((size_t)n * chunks);
  for (int v = 0; v < n; ++v)
    for (int c = 0; c < chunks; ++c)
      kq_quantize_chunk(&x[(size_t)v * cols + c * FC_KQ_CHUNK], &xq[((size_t)v * chunks + c) * 8],
                        &xd[(size_t)v * chunks + c], &xs[(size_t)v * chunks + c]);
  std::vector<float> out((size_t)n * rows);
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
