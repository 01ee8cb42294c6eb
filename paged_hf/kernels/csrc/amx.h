// What the AMX kernels share: whether this build and process may run tile instructions, and the tile configuration.
// PAGED_HF_AMX is defined where the compiler targets AMX-TILE and AMX-BF16 on Linux (the kernels' other paths serve
// the rest).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define PAGED_HF_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace paged_hf_amx {

// Whether this process may run AMX tile instructions: it asks Linux for the tile state once (ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA; oneDNN asks the same for its own AMX products).
inline bool ready() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

// The operand of _tile_loadconfig (palette 1): rows and bytes per row of each of the 16 tile registers.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0..count-1 as 16 rows of 64 bytes (16 float32 or 32 bfloat16), loaded into this thread's tile registers.
// An asm statement with the configuration as its memory operand, not _tile_loadconfig: GCC 12 does not see the
// builtin read its operand, and once this function was inlined it dropped the stores of the rows and widths before
// it (ldtilecfg then read stack garbage and faulted).
inline void configure_full_tiles(int count) {
  TileConfig config;
  for (int t = 0; t < count; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  asm volatile("ldtilecfg %0" : : "m"(config));
}

}  // namespace paged_hf_amx
#endif
