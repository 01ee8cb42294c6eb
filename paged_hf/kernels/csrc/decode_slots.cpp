// paged_hf_cpu::decode_slots(Tensor table [R, C] int32, Tensor rows [S] int64, Tensor positions [S] int64,
//                            int block_size, int width) -> (Tensor [S, width] int32, Tensor [S] int64)
//     a decode-only step's block tables and K/V slots from a layer group's table of rows
//     (paged_hf/block_table_rows.py): row s of the first result is table[rows[s], :width], and the second holds the
//     slot of sequence s's one new token, at position positions[s]: its block table[rows[s], positions[s] /
//     block_size] times block_size plus positions[s] % block_size. What metadata.py's torch path computes with
//     eight ops (index_select, a gather, divisions, a multiply and add), in one call: each op's dispatch, run right
//     after a forward that evicted the CPU's caches, cost 10 us of a steady step's host work.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <tuple>

namespace {

std::tuple<at::Tensor, at::Tensor> decode_slots(const at::Tensor& table, const at::Tensor& rows,
                                                const at::Tensor& positions, int64_t block_size, int64_t width) {
  TORCH_CHECK(table.device().is_cpu() && table.dim() == 2 && table.scalar_type() == at::kInt && table.stride(1) == 1,
              "decode_slots: table must be a [R, C] int32 CPU tensor with contiguous rows");
  TORCH_CHECK(rows.device().is_cpu() && rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous(),
              "decode_slots: rows must be a contiguous [S] int64 CPU tensor");
  TORCH_CHECK(positions.device().is_cpu() && positions.dim() == 1 && positions.scalar_type() == at::kLong &&
                  positions.is_contiguous() && positions.size(0) == rows.size(0),
              "decode_slots: positions must be a contiguous int64 CPU tensor of rows' size");
  TORCH_CHECK(block_size >= 1, "decode_slots: block_size must be >= 1, got ", block_size);
  TORCH_CHECK(width >= 1 && width <= table.size(1), "decode_slots: width must be in [1, ", table.size(1), "], got ",
              width);
  const int64_t num_seqs = rows.size(0), num_rows = table.size(0), stride = table.stride(0);
  at::Tensor tables = at::empty({num_seqs, width}, table.options());
  at::Tensor slots = at::empty({num_seqs}, positions.options());
  const int32_t* source = table.data_ptr<int32_t>();
  const int64_t* row = rows.data_ptr<int64_t>();
  const int64_t* position = positions.data_ptr<int64_t>();
  int32_t* out = tables.data_ptr<int32_t>();
  int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(row[s] >= 0 && row[s] < num_rows, "decode_slots: rows[", s, "] = ", row[s], " is not in [0, ",
                num_rows, ")");
    TORCH_CHECK(position[s] >= 0 && position[s] / block_size < width, "decode_slots: positions[", s, "] = ",
                position[s], " is past the ", width, " blocks of the tables");
    const int32_t* entries = source + row[s] * stride;
    std::memcpy(out + s * width, entries, sizeof(int32_t) * width);
    slot[s] = static_cast<int64_t>(entries[position[s] / block_size]) * block_size + position[s] % block_size;
  }
  return {tables, slots};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(paged_hf_cpu, m) {
  m.def("decode_slots(Tensor table, Tensor rows, Tensor positions, int block_size, int width) -> (Tensor, Tensor)");
  m.impl("decode_slots", c10::DispatchKey::CPU, TORCH_FN(decode_slots));
}
