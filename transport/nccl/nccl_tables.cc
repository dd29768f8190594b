#include "transport/nccl/nccl_tables.h"

#include <algorithm>

namespace moonep::transport::nccl {

void BuildDispatchTables(const SendLayout& send, const ReceiveLayout& recv, int32_t me,
                         DispatchTables* t) {
  const int32_t R = send.num_ranks;
  const int64_t n_entries = send.num_tokens * send.top_k;
  const int64_t sent_entries = send.entry_begin[R];
  t->pack_begin.assign(R + 1, 0);
  t->unique_send.assign(R, 0);
  for (int32_t d = 0; d < R; ++d) {
    t->unique_send[d] = d == me ? 0 : send.unique_to(d);
    t->pack_begin[d + 1] = t->pack_begin[d] + t->unique_send[d];
  }
  t->pack_index.clear();
  for (int32_t d = 0; d < R; ++d) {
    if (d == me) continue;
    t->pack_index.insert(t->pack_index.end(), send.unique_tokens.begin() + send.unique_begin[d],
                         send.unique_tokens.begin() + send.unique_begin[d + 1]);
  }
  t->meta_unique.assign(send.entry_unique.begin(), send.entry_unique.begin() + sent_entries);
  t->meta_entries.assign(send.entries.begin(), send.entries.begin() + sent_entries);
  t->row_source.assign(static_cast<size_t>(recv.rank_rows), RowSource{-1, -1});
  t->pos_row.assign(static_cast<size_t>(recv.rows_begin[R]), -1);
  for (int32_t s = 0; s < R; ++s) {
    int64_t i = 0;
    for (int64_t run = recv.run_begin[s]; run < recv.run_begin[s + 1]; ++run) {
      for (int64_t j = 0; j < recv.run_count[run]; ++j, ++i) {
        const int64_t row = recv.run_row[run] + j;
        const int64_t pos = recv.rows_begin[s] + i;
        t->pos_row[pos] = static_cast<int32_t>(row);
        if (s != me) t->row_source[row] = RowSource{static_cast<int32_t>(pos), s};
      }
    }
  }
  for (int64_t i = send.entry_begin[me]; i < send.entry_begin[me + 1]; ++i) {
    const int32_t entry = send.entries[i];
    t->row_source[send.dest_row[entry]] = RowSource{entry, -2};
  }
  t->combine_index.assign(static_cast<size_t>(n_entries), -1);
  for (int64_t i = 0; i < sent_entries; ++i) {
    t->combine_index[send.entries[i]] = static_cast<int32_t>(i);
  }
}

}  // namespace moonep::transport::nccl
