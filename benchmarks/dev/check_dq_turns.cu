// Host brute force for deterministic mode's dQ turns (sm90/dq_turns.h): for every key block n of the Hopper
// backward's tile shapes, every query block m it visits must have the key blocks visiting it consecutive,
// with bwd_first_key_block(m, n) the first. A wrong answer would hang the kernel, so this runs before a GPU
// does. Build and run here (no GPU needed):
//   nvcc -std=c++17 --expt-relaxed-constexpr -Icsrc/include -Icsrc/kernels \
//     -I$SP/cutlass_library/source/include benchmarks/dev/check_dq_turns.cu -o /tmp/check_dq_turns && /tmp/check_dq_turns
#include <cstdio>
#include <vector>

#include "common/block_range.h"

using namespace flash_attn2;

template <int kBlockM, int kBlockN>
long check(int len_q, int len_k, bool causal, int left, int right, long* failures) {
  FwdParams p{};
  p.causal = causal;
  p.window_left = left;
  p.window_right = causal ? 0 : right;
  const Window w(len_q, len_k, p);
  const int num_n = (len_k + kBlockN - 1) / kBlockN, num_m = (len_q + kBlockM - 1) / kBlockM;
  std::vector<int> first(num_m, -1), last(num_m, -1), count(num_m, 0);
  for (int n = 0; n < num_n; ++n) {
    const BwdBlockRange r = bwd_block_range<kBlockM, kBlockN>(w, n);
    for (int m = r.m_min; m < r.m_max; ++m) {
      if (first[m] < 0) first[m] = n;
      last[m] = n;
      ++count[m];
    }
  }
  long visits = 0;
  for (int n = 0; n < num_n; ++n) {
    const BwdBlockRange r = bwd_block_range<kBlockM, kBlockN>(w, n);
    for (int m = r.m_min; m < r.m_max; ++m) {
      ++visits;
      const int got = bwd_first_key_block<kBlockM, kBlockN>(w, m, n);
      if (got != first[m] || count[m] != last[m] - first[m] + 1) {
        if (++*failures <= 10) {
          std::printf("FAIL M %d N %d len_q %d len_k %d causal %d window (%d, %d): m %d n %d first %d got %d, "
                      "%d blocks over [%d, %d]\n", kBlockM, kBlockN, len_q, len_k, int(causal), left, right, m, n,
                      first[m], got, count[m], first[m], last[m]);
        }
      }
    }
  }
  return visits;
}

template <int kBlockM, int kBlockN>
long sweep(long* failures) {
  const int lens[] = {1, 17, 63, 64, 65, 80, 96, 113, 127, 128, 129, 255, 256, 300, 1000, 1023, 2048, 4099};
  const int windows[] = {-1, 0, 1, 31, 64, 100, 128, 257, 1024};
  long visits = 0;
  for (int len_q : lens) {
    for (int len_k : lens) {
      for (int causal = 0; causal < 2; ++causal) {
        for (int left : windows) {
          for (int right : windows) {
            if (causal && right != -1) continue;
            visits += check<kBlockM, kBlockN>(len_q, len_k, causal, left, right, failures);
          }
        }
      }
    }
  }
  return visits;
}

int main() {
  long failures = 0, visits = 0;
  visits += sweep<128, 128>(&failures);  // d 64
  visits += sweep<64, 128>(&failures);   // d 32-128, d 64 extended
  visits += sweep<64, 96>(&failures);    // d 192
  visits += sweep<64, 80>(&failures);    // d 256
  std::printf("%ld (key block, query block) visits checked, %ld failures\n", visits, failures);
  return failures != 0;
}
