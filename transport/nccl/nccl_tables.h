// The NCCL transport's per-dispatch index tables: pure functions of the send and receive layouts
// (transport/layout.h), built on the host and uploaded to the device once per dispatch. Kept free
// of CUDA so that tests check them (and the data movement they drive) on any machine.
#pragma once

#include <cstdint>
#include <vector>

#include "transport/layout.h"

namespace moonep::transport::nccl {

// Sent per dispatched row, sender -> receiver: the index of its token among the sender's unique
// rows to that receiver (dedup), and its top-k weight.
struct RowMeta {
  int32_t unique;
  float weight;
};
static_assert(sizeof(RowMeta) == 8, "RowMeta is sent as bytes");

// Where a row of the compute layout comes from: src >= 0: the unique row meta[pos].unique of source
// rank src's rows in the receive staging (which starts at staging_begin[src]); src == -2: the
// local top-k entry `pos` (= t * K + k, row t of x); src == -1: padding (zero row, zero weight).
struct RowSource {
  int32_t pos;
  int32_t src;
};

struct DispatchTables {
  // Send staging: this rank's unique rows to each remote destination, in destination order.
  std::vector<int64_t> pack_begin;  // [R + 1]
  std::vector<int32_t> pack_index;  // [pack_begin[R]] token of each staging row
  // Per entry with a destination, in send order (entry_begin): its unique index and its entry.
  std::vector<int32_t> meta_unique, meta_entries;
  std::vector<int64_t> unique_send;    // [R] unique rows sent to each rank (0 to itself)
  std::vector<RowSource> row_source;   // [rank_rows]
  std::vector<int32_t> pos_row;        // [rows received, own included] row of each receive position
  std::vector<int32_t> combine_index;  // [T * K] send-order position of each entry, -1 if none
};

// The lengths of rank `me`'s tables (DispatchTables' vectors, in that order).
struct DispatchTableSizes {
  int64_t pack_index = 0, meta = 0, row_source = 0, pos_row = 0, combine_index = 0;
};
DispatchTableSizes TableSizes(const SendLayout& send, const ReceiveLayout& recv, int32_t me);

// Where WriteDispatchTables puts each table: host memory of at least the TableSizes lengths
// (pack_begin R + 1, unique_send R), e.g. parts of the pinned block that is uploaded.
struct DispatchTableViews {
  int64_t* pack_begin;
  int64_t* unique_send;
  int32_t* pack_index;
  int32_t* meta_unique;
  int32_t* meta_entries;
  RowSource* row_source;
  int32_t* pos_row;
  int32_t* combine_index;
};

// Writes rank `me`'s tables. With a pool, its six independent parts (one or two tables each) run
// on its threads; the tables are the same either way.
void WriteDispatchTables(const SendLayout& send, const ReceiveLayout& recv, int32_t me,
                         const DispatchTableViews& out, WorkerPool* pool = nullptr);

// The same into vectors (sized here; they keep their capacity across calls).
void BuildDispatchTables(const SendLayout& send, const ReceiveLayout& recv, int32_t me,
                         DispatchTables* tables, WorkerPool* pool = nullptr);

}  // namespace moonep::transport::nccl
