#include "transport/nccl/nccl_tables.h"

#include <algorithm>

namespace moonep::transport::nccl {

DispatchTableSizes TableSizes(const SendLayout& send, const ReceiveLayout& recv, int32_t me) {
  const int32_t R = send.num_ranks;
  DispatchTableSizes z;
  z.pack_index = send.unique_begin[R] - send.unique_to(me);
  z.meta = send.entry_begin[R];
  z.row_source = recv.rank_rows;
  z.pos_row = recv.rows_begin[R];
  z.combine_index = send.num_tokens * send.top_k;
  return z;
}

void WriteDispatchTables(const SendLayout& send, const ReceiveLayout& recv, int32_t me,
                         const DispatchTableViews& t, WorkerPool* pool) {
  const int32_t R = send.num_ranks;
  const DispatchTableSizes z = TableSizes(send, recv, me);
  // Six independent parts, the largest first (on a pool thread w takes part w first).
  auto part = [&](int64_t k) {
    switch (k) {
      case 0:  // where each row of the compute layout comes from
        std::fill(t.row_source, t.row_source + z.row_source, RowSource{-1, -1});
        for (int32_t s = 0; s < R; ++s) {
          if (s == me) continue;
          int64_t pos = recv.rows_begin[s];
          for (int64_t run = recv.run_begin[s]; run < recv.run_begin[s + 1]; ++run) {
            for (int64_t j = 0; j < recv.run_count[run]; ++j, ++pos) {
              t.row_source[recv.run_row[run] + j] = RowSource{static_cast<int32_t>(pos), s};
            }
          }
        }
        for (int64_t i = send.entry_begin[me]; i < send.entry_begin[me + 1]; ++i) {
          const int32_t entry = send.entries[i];
          t.row_source[send.dest_row[entry]] = RowSource{entry, -2};
        }
        break;
      case 1:  // the send-order position of each entry, -1 where it has no destination
        std::fill(t.combine_index, t.combine_index + z.combine_index, -1);
        for (int64_t i = 0; i < z.meta; ++i) {
          t.combine_index[send.entries[i]] = static_cast<int32_t>(i);
        }
        break;
      case 2:  // the row of each receive position
        for (int32_t s = 0; s < R; ++s) {
          int64_t pos = recv.rows_begin[s];
          for (int64_t run = recv.run_begin[s]; run < recv.run_begin[s + 1]; ++run) {
            for (int64_t j = 0; j < recv.run_count[run]; ++j, ++pos) {
              t.pos_row[pos] = static_cast<int32_t>(recv.run_row[run] + j);
            }
          }
        }
        break;
      case 3:  // per sent entry, its unique index ...
        std::copy(send.entry_unique.begin(), send.entry_unique.begin() + z.meta, t.meta_unique);
        break;
      case 4:  // ... and its entry
        std::copy(send.entries.begin(), send.entries.begin() + z.meta, t.meta_entries);
        break;
      default:  // this rank's unique rows to each remote destination, in destination order
        t.pack_begin[0] = 0;
        for (int32_t d = 0; d < R; ++d) {
          t.unique_send[d] = d == me ? 0 : send.unique_to(d);
          t.pack_begin[d + 1] = t.pack_begin[d] + t.unique_send[d];
          if (d != me) {
            std::copy(send.unique_tokens.begin() + send.unique_begin[d],
                      send.unique_tokens.begin() + send.unique_begin[d + 1],
                      t.pack_index + t.pack_begin[d]);
          }
        }
        break;
    }
  };
  constexpr int64_t kParts = 6;
  if (pool == nullptr || pool->size() == 1) {
    for (int64_t k = 0; k < kParts; ++k) part(k);
    return;
  }
  pool->Run(kParts, [&part](int64_t k, int) { part(k); });
}

void BuildDispatchTables(const SendLayout& send, const ReceiveLayout& recv, int32_t me,
                         DispatchTables* t, WorkerPool* pool) {
  const int32_t R = send.num_ranks;
  const DispatchTableSizes z = TableSizes(send, recv, me);
  t->pack_begin.resize(static_cast<size_t>(R) + 1);
  t->unique_send.resize(static_cast<size_t>(R));
  t->pack_index.resize(static_cast<size_t>(z.pack_index));
  t->meta_unique.resize(static_cast<size_t>(z.meta));
  t->meta_entries.resize(static_cast<size_t>(z.meta));
  t->row_source.resize(static_cast<size_t>(z.row_source));
  t->pos_row.resize(static_cast<size_t>(z.pos_row));
  t->combine_index.resize(static_cast<size_t>(z.combine_index));
  WriteDispatchTables(send, recv, me,
                      DispatchTableViews{t->pack_begin.data(), t->unique_send.data(),
                                         t->pack_index.data(), t->meta_unique.data(),
                                         t->meta_entries.data(), t->row_source.data(),
                                         t->pos_row.data(), t->combine_index.data()},
                      pool);
}

}  // namespace moonep::transport::nccl
