// The int8 GEMM's streaming regime on avx512_vnni (few rows: bound by reading the weights): register tiles of
// up to 4 rows x 64 columns from the signed codes, each row's 4 codes flipped to unsigned as they are broadcast.
#include <omp.h>

#include <cstring>

#include "cpu/int8/int8_linear_impl.h"

namespace bertfast {
namespace cpu {
namespace int8_detail {

#if BF_X86
namespace {

// The 4 codes of `row` at group g as unsigned bytes, zero padded past K (code 0 -> 128, times a zero weight).
BF_INLINE uint32_t codes4(const int8_t* row, int64_t g, int64_t K) {
  uint32_t v = 0x80808080u;
  if (g * 4 + 4 <= K) {
    std::memcpy(&v, row + g * 4, 4);
    return v ^ 0x80808080u;
  }
  uint8_t b[4] = {0x80, 0x80, 0x80, 0x80};
  for (int64_t e = 0; g * 4 + e < K; ++e) b[e] = uint8_t(row[g * 4 + e]) ^ 0x80u;
  std::memcpy(&v, b, 4);
  return v;
}

// Row r's 4 codes of group g, signed in `rows`, flipped to unsigned as they are broadcast; PADDED: the last
// group when K % 4 != 0.
template <int MR, bool PADDED>
struct FlippedCodes {
  const int8_t* const (&rows)[MR];
  int64_t g, K;
  BF_TARGET_VNNI BF_INLINE __m512i operator()(int r) const {
    if constexpr (PADDED) return _mm512_set1_epi32(int32_t(codes4(rows[r], g, K)));
    int32_t c;
    std::memcpy(&c, rows[r] + g * 4, 4);
    return _mm512_xor_si512(_mm512_set1_epi32(c), _mm512_set1_epi32(int32_t(0x80808080u)));
  }
};

// Streaming tile: MR rows x NP panels from the signed codes, each row's 4 codes flipped as they are broadcast.
template <int MR, int NP>
BF_TARGET_VNNI BF_INLINE void stream_tile_vnni(const Int8Args& a, int64_t m0, int64_t p0) {
  const int64_t k4 = (a.K + 3) / 4, k4_full = a.K / 4;
  __m512i acc[MR][NP];
  zero_vnni<MR, NP>(acc);
  const int8_t* rows[MR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) rows[r] = a.x + (m0 + r) * a.ldx;
  const int8_t* wp = a.packed + p0 * k4 * 64;
  // The padded last group (K % 4 != 0) outside the loop: with the branch inside, GCC spilled an accumulator.
  for (int64_t g = 0; g < k4_full; ++g) vnni_group<MR, NP>(acc, wp, k4, g, FlippedCodes<MR, false>{rows, g, a.K});
  if (k4_full < k4) vnni_group<MR, NP>(acc, wp, k4, k4_full, FlippedCodes<MR, true>{rows, k4_full, a.K});
  store_vnni<MR, NP>(acc, m0, p0, a);
}

template <int NP>
BF_TARGET_VNNI void stream_rows_vnni(const Int8Args& a, int64_t p0) {
  int64_t m = 0;
  for (; m + 4 <= a.M; m += 4) stream_tile_vnni<4, NP>(a, m, p0);
  switch (a.M - m) {
    case 3: stream_tile_vnni<3, NP>(a, m, p0); break;
    case 2: stream_tile_vnni<2, NP>(a, m, p0); break;
    case 1: stream_tile_vnni<1, NP>(a, m, p0); break;
    default: break;
  }
}

}  // namespace

BF_TARGET_VNNI void stream_panels_vnni(const Int8Args& args, int64_t p0, int64_t p1) {
  DenormalGuard ftz;
  ItemTerms<kStreamRows> terms;  // every row's, not each 4-row tile's
  const Int8Args a = terms.with(args, 0, args.M, p0, p1);
  switch (p1 - p0) {
    case 4: stream_rows_vnni<4>(a, p0); break;
    case 3: stream_rows_vnni<3>(a, p0); break;
    case 2: stream_rows_vnni<2>(a, p0); break;
    case 1: stream_rows_vnni<1>(a, p0); break;
    default: break;
  }
}
#endif

}  // namespace int8_detail
}  // namespace cpu
}  // namespace bertfast
