"""kq_row_line (csrc/kquant/kquant.cuh), the addresses the staged kernels' L2 prefetch names (kq_prefetch_row):
built on the CPU with g++ from the same header. Every line of a row is named once and every address lies in
the row, whatever its alignment: a prefetch must name no byte outside the weight."""
import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[2] / "csrc" / "kquant"
PROGRAM = r"""
#include <cstdio>
#include "kquant.cuh"
int main() {
  unsigned long long p, n;
  while (scanf("%llu %llu", &p, &n) == 2) {
    for (int m = 0;; ++m) {
      const kq_u64 a = kq_row_line(p, n, m);
      if (!a) break;
      printf("%llu ", (unsigned long long)a);
    }
    printf("\n");
  }
  printf("%llu %llu %llu\n", (unsigned long long)kq_row_bytes(FC_KQ_Q4_K, 6144),
         (unsigned long long)kq_row_bytes(FC_KQ_Q8_0, 2048), (unsigned long long)kq_row_bytes(FC_KQ_Q6_K, 256));
}
"""


@pytest.fixture(scope="module")
def lines(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    d = tmp_path_factory.mktemp("lines")
    (d / "lines.cpp").write_text(PROGRAM)
    subprocess.run([cxx, "-O1", "-std=c++17", f"-I{CSRC}", "-o", str(d / "lines"), str(d / "lines.cpp")],
                   check=True, capture_output=True)

    def run(cases):
        text = "".join(f"{p} {n}\n" for p, n in cases)
        out = subprocess.run([str(d / "lines")], input=text, capture_output=True, text=True, check=True).stdout
        rows = out.splitlines()
        return [[int(a) for a in r.split()] for r in rows[:-1]], [int(v) for v in rows[-1].split()]

    return run


def test_every_line_of_a_row_once_and_nothing_outside_it(lines):
    base = 1 << 20
    cases = [(base + off, n) for off in (0, 1, 16, 64, 100, 127, 128, 200)
             for n in (1, 2, 34, 127, 128, 129, 210, 1152, 3456, 4224, 5040)]
    got, _ = lines(cases)
    for (p, n), addrs in zip(cases, got):
        assert addrs[0] == p and all(p <= a < p + n for a in addrs), (p, n, addrs)
        covered = [a // 128 for a in addrs]
        assert covered == list(range(p // 128, (p + n - 1) // 128 + 1)), (p, n)  # each line once, in order
    empty, _ = lines([(base, 0)])
    assert empty == [[]]


def test_row_bytes_are_the_blocks_of_a_row(lines):
    _, sizes = lines([])
    assert sizes == [24 * 144, 64 * 34, 210]  # Q4_K 6144 values, Q8_0 2048, Q6_K 256
