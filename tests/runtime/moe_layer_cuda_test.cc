// The MoE layer on device memory (device cuda: CUDA executor + NCCL transport) against the fp64
// reference: forward y, backward dx, d topk_weights and weight gradients, with tensors in GPU
// memory and the caller's stream. One rank per GPU; every test skips visibly where the node has
// fewer GPUs than ranks (CI). On one GPU the test policy routes tokens through replica slots of the
// rank itself, so prefetch, replica compute and the gradient reduction all run.
#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "moonep/core/status.h"
#include "moonep/runtime/communicator.h"
#include "moonep/runtime/cost_probe.h"
#include "moonep/runtime/ep_buffer.h"
#include "moonep/runtime/moe_layer.h"
#include "tests/harness/mpi_test.h"
#include "tests/runtime/layer_problem.h"
#include "transport/nccl/nccl_transport.h"

namespace moonep::testing {
namespace {

using runtime::Communicator;
using runtime::LayerConfig;
using runtime::MoeLayer;

constexpr int32_t kTopK = 3;
constexpr int64_t kHidden = 64, kInter = 40, kBaseTokens = 48;

// A device copy of a host vector, freed at scope exit.
class DeviceVec {
 public:
  DeviceVec() = default;
  explicit DeviceVec(size_t bytes) : bytes_(bytes) {
    if (bytes_ > 0 && cudaMalloc(&p_, bytes_) != cudaSuccess) p_ = nullptr;
    if (p_ != nullptr) cudaMemset(p_, 0, bytes_);
  }
  template <typename T>
  explicit DeviceVec(const std::vector<T>& host) : DeviceVec(host.size() * sizeof(T)) {
    if (p_ != nullptr) cudaMemcpy(p_, host.data(), bytes_, cudaMemcpyHostToDevice);
  }
  ~DeviceVec() {
    if (p_ != nullptr) cudaFree(p_);
  }
  DeviceVec(DeviceVec&& o) noexcept : p_(o.p_), bytes_(o.bytes_) { o.p_ = nullptr; }
  DeviceVec(const DeviceVec&) = delete;
  template <typename T = char>
  T* get() const {
    return static_cast<T*>(p_);
  }
  template <typename T>
  void CopyTo(std::vector<T>* host) const {
    host->resize(bytes_ / sizeof(T));
    cudaMemcpy(host->data(), p_, bytes_, cudaMemcpyDeviceToHost);
  }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

// One rank's tensors of RankTensors, in GPU memory.
struct DeviceTensors {
  DeviceVec x, y, dy, dx, ids, weights, dtopk, wg, wu, wd, gg, gu, gd;
  std::vector<compute::ExpertParams> params, grads;
};

DeviceTensors Upload(const RankTensors& t, DType dtype, int64_t epn) {
  DeviceTensors d{DeviceVec(t.x),
                  DeviceVec(t.y),
                  DeviceVec(t.dy),
                  DeviceVec(t.dx),
                  DeviceVec(t.ids),
                  DeviceVec(t.weights),
                  DeviceVec(t.dtopk),
                  DeviceVec(t.wg),
                  DeviceVec(t.wu),
                  DeviceVec(t.wd),
                  DeviceVec(t.gg),
                  DeviceVec(t.gu),
                  DeviceVec(t.gd),
                  {},
                  {}};
  const size_t block = kHidden * kInter, ds = DTypeSize(dtype);
  const Device dev = Device::kCuda;
  for (int64_t e = 0; e < epn; ++e) {
    compute::ExpertParams w, g;
    w.gate = TensorView::Contiguous(d.wg.get() + e * block * ds, dtype, {kHidden, kInter}, dev);
    w.up = TensorView::Contiguous(d.wu.get() + e * block * ds, dtype, {kHidden, kInter}, dev);
    w.down = TensorView::Contiguous(d.wd.get() + e * block * ds, dtype, {kInter, kHidden}, dev);
    g.gate = TensorView::Contiguous(d.gg.get<float>() + e * block, DType::kFloat32,
                                    {kHidden, kInter}, dev);
    g.up = TensorView::Contiguous(d.gu.get<float>() + e * block, DType::kFloat32, {kHidden, kInter},
                                  dev);
    g.down = TensorView::Contiguous(d.gd.get<float>() + e * block, DType::kFloat32,
                                    {kInter, kHidden}, dev);
    d.params.push_back(w);
    d.grads.push_back(g);
  }
  return d;
}

class MoeLayerCudaTest : public MpiTest {
 protected:
  void SetUp() override {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess) {
      cudaGetLastError();
      devices = 0;
    }
    if (devices < size()) {
      GTEST_SKIP() << "the device path needs one GPU per rank: " << size() << " rank(s), "
                   << devices << " GPU(s) visible";
    }
    device_ = rank() % devices;
    ASSERT_EQ(cudaSetDevice(device_), cudaSuccess);
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
    auto comm = Communicator::FromMpi(MPI_COMM_WORLD);
    ASSERT_TRUE(comm.ok()) << comm.status();
    comm_ = std::move(*comm);
  }
  void TearDown() override {
    comm_.reset();
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    MpiTest::TearDown();
  }

  int32_t epn() const { return size() == 1 ? 4 : 2; }

  LayerConfig Config(DType dtype, planner::Policy policy) const {
    LayerConfig c;
    c.num_experts = epn() * size();
    c.top_k = kTopK;
    c.hidden = kHidden;
    c.intermediate = kInter;
    c.dtype = dtype;
    c.policy = policy;
    c.max_tokens = kBaseTokens + 8;
    c.device = Device::kCuda;
    c.device_index = device_;
    return c;
  }

  // Two forward+backward steps of `layer` on problem `g`, checked against the fp64 reference.
  void RunAndCheck(MoeLayer* layer, const GlobalProblem& g, DType dtype, planner::Policy policy) {
    const double tol = dtype == DType::kFloat32 ? 1e-5 : 1e-2;
    RankTensors t = MakeRankTensors(g, rank(), dtype);
    DeviceTensors d = Upload(t, dtype, epn());
    ASSERT_NE(d.x.get(), nullptr);
    ASSERT_TRUE(layer->BindParameters(d.params, d.grads).ok());
    const int64_t T = t.tokens;
    const size_t entries = static_cast<size_t>(T * kTopK);
    auto view = [&](const DeviceVec& v) {
      return TensorView::Contiguous(v.get(), dtype, {T, kHidden}, Device::kCuda);
    };
    // The NCCL staging is the transport's per handle, allocated by the first operations: the
    // layer's memory report counts it as it grows.
    const size_t memory_before = layer->MemoryBytes(), staging_before = layer->StagingBytes();
    // Two steps: the second checks that nothing stale from the first leaks into it (the
    // gradients are zeroed between them on the caller's stream, ordered before the layer).
    for (int step = 0; step < 2; ++step) {
      for (const DeviceVec* gv : {&d.gg, &d.gu, &d.gd}) {
        ASSERT_EQ(cudaMemsetAsync(gv->get(), 0, t.gg.size() * 4, stream_), cudaSuccess);
      }
      auto h =
          layer->Forward(T, view(d.x), absl::Span<const int32_t>(d.ids.get<int32_t>(), entries),
                      absl::Span<const float>(d.weights.get<float>(), entries), view(d.y), stream_);
      ASSERT_TRUE(h.ok()) << h.status();
      ASSERT_TRUE(layer->Backward(*h, view(d.dy), view(d.dx),
                               absl::Span<float>(d.dtopk.get<float>(), entries), stream_)
                      .ok());
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const size_t staging = layer->StagingBytes();
    if (staging_before == 0) {  // a new layer: its first steps allocated the staging
      EXPECT_GE(staging, static_cast<size_t>(kHidden) * DTypeSize(dtype))
          << "the handles' device staging (a row at least) is not in the memory report";
    }
    // Everything else the layer holds was allocated at creation.
    EXPECT_EQ(static_cast<int64_t>(layer->MemoryBytes() - memory_before),
              static_cast<int64_t>(staging) - static_cast<int64_t>(staging_before));
    d.y.CopyTo(&t.y);
    d.dx.CopyTo(&t.dx);
    d.dtopk.CopyTo(&t.dtopk);
    d.gg.CopyTo(&t.gg);
    d.gu.CopyTo(&t.gu);
    d.gd.CopyTo(&t.gd);

    reference::ForwardResult f;
    reference::BackwardResult b;
    ASSERT_TRUE(ReferenceLayer(g, &f, &b).ok());
    const int64_t o = g.offset[rank()];
    const double ey = RelError(Decode(t.y, dtype), f.y.data() + o * kHidden, T * kHidden);
    const double edx = RelError(Decode(t.dx, dtype), b.dx.data() + o * kHidden, T * kHidden);
    std::vector<double> dtopk(t.dtopk.begin(), t.dtopk.end());
    const double etk = RelError(dtopk, b.dtopk_weights.data() + o * kTopK, T * kTopK);
    double edw = 0;
    const size_t block = kHidden * kInter, first = rank() * epn() * block;
    for (auto pair : {std::make_pair(&t.gg, &b.dwg), std::make_pair(&t.gu, &b.dwu),
                      std::make_pair(&t.gd, &b.dwd)}) {
      std::vector<double> got(pair.first->begin(), pair.first->end());
      edw = std::max(edw, RelError(got, pair.second->data() + first, epn() * block));
    }
    const auto& stats = layer->stats();
    if (rank() == 0) {
      std::printf("cuda %-20s %s y %.2e dx %.2e dtopk %.2e dw %.2e replicas %d\n",
                  planner::PolicyName(policy), DTypeName(dtype), ey, edx, etk, edw,
                  stats.plan.replicas);
    }
    EXPECT_LT(ey, tol);
    EXPECT_LT(edx, tol);
    EXPECT_LT(etk, tol);
    EXPECT_LT(edw, tol);
    if (policy == planner::Policy::kTestForceReplicas) {
      EXPECT_GT(stats.plan.replicas, 0) << "the test policy made no replica: prefetch, "
                                           "replica compute and reduce were not exercised";
    }
  }

  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<Communicator> comm_;
};

TEST_F(MoeLayerCudaTest, ForwardBackwardMatchReference) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    for (planner::Policy policy :
         {planner::Policy::kNone, planner::Policy::kMoonEP, planner::Policy::kTestForceReplicas}) {
      SCOPED_TRACE(std::string(planner::PolicyName(policy)) + " " + DTypeName(dtype));
      GlobalProblem g = MakeGlobalProblem(size(), epn(), kTopK, kHidden, kInter, kBaseTokens, dtype,
                                          300 + static_cast<int>(policy));
      LayerConfig config = Config(dtype, policy);
      if (policy == planner::Policy::kTestForceReplicas) config.pad_multiple = 8;
      auto layer = MoeLayer::Create(comm_.get(), config);
      ASSERT_TRUE(layer.ok()) << layer.status();
      RunAndCheck(layer->get(), g, dtype, policy);
    }
  }
}

ncclComm_t RowsComm(const MoeLayer& layer) {
  auto* t = dynamic_cast<const transport::nccl::NcclTransport*>(layer.transport());
  return t == nullptr ? nullptr : t->comm();
}

// Every device layer of a communicator runs on one pair of NCCL communicators (not two per
// layer), and layers used one after another in any order stay correct.
TEST_F(MoeLayerCudaTest, LayersShareOneNcclPair) {
  const DType dtype = DType::kFloat32;
  EXPECT_FALSE(comm_->has_nccl_comms());
  LayerConfig ca = Config(dtype, planner::Policy::kMoonEP);
  LayerConfig cb = Config(dtype, planner::Policy::kTestForceReplicas);
  cb.pad_multiple = 8;
  auto a = MoeLayer::Create(comm_.get(), ca);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_TRUE(comm_->has_nccl_comms());
  auto b = MoeLayer::Create(comm_.get(), cb);
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_NE(RowsComm(**a), nullptr);
  EXPECT_EQ(RowsComm(**a), RowsComm(**b));
  GlobalProblem ga =
      MakeGlobalProblem(size(), epn(), kTopK, kHidden, kInter, kBaseTokens, dtype, 401);
  GlobalProblem gb =
      MakeGlobalProblem(size(), epn(), kTopK, kHidden, kInter, kBaseTokens, dtype, 402);
  RunAndCheck(a->get(), ga, dtype, planner::Policy::kMoonEP);
  RunAndCheck(b->get(), gb, dtype, planner::Policy::kTestForceReplicas);
  RunAndCheck(a->get(), ga, dtype, planner::Policy::kMoonEP);
}

// The trainer's own NCCL communicator carries the rows (SetNcclComm); MoeLayer never destroys it,
// and it stays usable after the layers and the communicator are gone.
TEST_F(MoeLayerCudaTest, CallersNcclCommunicator) {
  ncclUniqueId id{};
  if (rank() == 0) {
    ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  }
  MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD);
  ncclComm_t mine = nullptr;
  ASSERT_EQ(ncclCommInitRank(&mine, size(), id, rank()), ncclSuccess);
  {
    auto made = Communicator::FromMpi(MPI_COMM_WORLD);
    ASSERT_TRUE(made.ok()) << made.status();
    std::unique_ptr<Communicator> comm = std::move(*made);
    EXPECT_EQ(ToResult(comm->SetNcclComm(nullptr)), moonepInvalidArgument);
    ASSERT_TRUE(comm->SetNcclComm(mine).ok());
    const DType dtype = DType::kBFloat16;
    LayerConfig c = Config(dtype, planner::Policy::kTestForceReplicas);
    c.pad_multiple = 8;
    auto layer = MoeLayer::Create(comm.get(), c);
    ASSERT_TRUE(layer.ok()) << layer.status();
    EXPECT_EQ(RowsComm(**layer), mine);
    absl::Status again = comm->SetNcclComm(mine);
    EXPECT_EQ(ToResult(again), moonepInvalidUsage) << again;
    RunAndCheck(layer->get(),
                MakeGlobalProblem(size(), epn(), kTopK, kHidden, kInter, kBaseTokens, dtype, 403),
                dtype, planner::Policy::kTestForceReplicas);
  }
  // Still the caller's, and working: an all-reduce of the ranks.
  int* v = nullptr;
  ASSERT_EQ(cudaMalloc(&v, sizeof(int)), cudaSuccess);
  const int me = rank() + 1;
  ASSERT_EQ(cudaMemcpy(v, &me, sizeof(int), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(ncclAllReduce(v, v, 1, ncclInt32, ncclSum, mine, stream_), ncclSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  int sum = 0;
  ASSERT_EQ(cudaMemcpy(&sum, v, sizeof(int), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(sum, size() * (size() + 1) / 2);
  cudaFree(v);
  EXPECT_EQ(ncclCommDestroy(mine), ncclSuccess);
}

// The EP buffer (C API level 2) on device memory: rows dispatched from GPU memory into the
// buffer's layout, experts computed by the "caller" (here the fp64 reference on a host copy),
// combine, the backward forms, prefetch into caller-owned device slots and reduce, checked against
// the fp64 reference and exact invariants. The test policy routes through replica slots.
TEST_F(MoeLayerCudaTest, EpBufferOnDeviceMemory) {
  const DType dt = DType::kFloat32;
  GlobalProblem g =
      MakeGlobalProblem(size(), epn(), kTopK, kHidden, kInter, kBaseTokens, dt, 501);
  RankTensors t = MakeRankTensors(g, rank(), dt);
  DeviceTensors d = Upload(t, dt, epn());
  LayerConfig c = Config(dt, planner::Policy::kTestForceReplicas);
  auto made = runtime::EpBuffer::Create(comm_.get(), c);
  ASSERT_TRUE(made.ok()) << made.status();
  runtime::EpBuffer& buf = **made;
  const int64_t T = t.tokens;
  const size_t entries = static_cast<size_t>(T * kTopK);
  auto rows_view = [&](void* p, int64_t n) {
    return TensorView::Contiguous(p, dt, {n, kHidden}, Device::kCuda);
  };
  auto h = buf.Dispatch(T, rows_view(d.x.get(), T),
                        absl::Span<const int32_t>(d.ids.get<int32_t>(), entries),
                        absl::Span<const float>(d.weights.get<float>(), entries));
  ASSERT_TRUE(h.ok()) << h.status();
  runtime::EpLayout layout;
  ASSERT_TRUE(buf.Layout(*h, &layout).ok());
  ASSERT_EQ(layout.num_groups, epn() + buf.slots());
  cudaPointerAttributes attr{};
  ASSERT_EQ(cudaPointerGetAttributes(&attr, layout.rows), cudaSuccess);
  EXPECT_EQ(attr.type, cudaMemoryTypeDevice) << "the layout's rows are not in GPU memory";

  // Prefetch into caller-owned device slots: every used slot bitwise equals its expert.
  const size_t block = kHidden * kInter;
  const int32_t S = buf.slots();
  DeviceVec sg(S * block * 4), su(S * block * 4), sd(S * block * 4);
  auto params = [&](const DeviceVec& a, const DeviceVec& b, const DeviceVec& c2, int32_t n) {
    std::vector<compute::ExpertParams> v(static_cast<size_t>(n));
    for (int32_t i = 0; i < n; ++i) {
      v[i].gate = TensorView::Contiguous(a.get() + i * block * 4, dt, {kHidden, kInter},
                                         Device::kCuda);
      v[i].up = TensorView::Contiguous(b.get() + i * block * 4, dt, {kHidden, kInter},
                                       Device::kCuda);
      v[i].down = TensorView::Contiguous(c2.get() + i * block * 4, dt, {kInter, kHidden},
                                         Device::kCuda);
    }
    return v;
  };
  const std::vector<compute::ExpertParams> slots = params(sg, su, sd, S);
  ASSERT_TRUE(buf.Prefetch(*h, d.params, slots).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<float> hg, hd;
  sg.CopyTo(&hg);
  sd.CopyTo(&hd);
  std::vector<int32_t> group_expert(layout.group_expert, layout.group_expert + layout.num_groups);
  int used = 0;
  for (int32_t s = 0; s < S; ++s) {
    const int e = group_expert[epn() + s];
    if (e < 0) continue;
    ++used;
    for (size_t i = 0; i < block; ++i) {
      ASSERT_EQ(hg[s * block + i], static_cast<float>(g.p.weights.wg[e * block + i])) << s;
      ASSERT_EQ(hd[s * block + i], static_cast<float>(g.p.weights.wd[e * block + i])) << s;
    }
  }
  EXPECT_GT(used, 0) << "no replica slot used: prefetch and reduce were not exercised";

  // The caller's experts: the fp64 reference FFN on a host copy of the rows, uploaded back.
  const int64_t R = layout.num_rows;
  std::vector<float> rows(static_cast<size_t>(R * kHidden));
  ASSERT_EQ(cudaMemcpy(rows.data(), layout.rows, rows.size() * 4, cudaMemcpyDeviceToHost),
            cudaSuccess);
  const std::vector<float> out =
      ReferenceExpertRows(g, rows.data(), R, layout.num_groups, group_expert.data(),
                          layout.group_offset, layout.group_count);
  DeviceVec d_out(out);
  ASSERT_TRUE(buf.Combine(*h, rows_view(d_out.get(), R), rows_view(d.y.get(), T)).ok());
  reference::ForwardResult f;
  reference::BackwardResult b;
  ASSERT_TRUE(ReferenceLayer(g, &f, &b).ok());
  const int64_t o = g.offset[rank()];
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  d.y.CopyTo(&t.y);
  EXPECT_LT(RelError(Decode(t.y, dt), f.y.data() + o * kHidden, T * kHidden), 1e-5);

  // Backward forms: dy rows, d topk_weights, and an identity "expert" for dx.
  DeviceVec dy_rows(out.size() * 4);
  ASSERT_TRUE(buf.CombineBackward(*h, rows_view(d.dy.get(), T), rows_view(dy_rows.get(), R)).ok());
  ASSERT_TRUE(buf.TopkWeightGrad(*h, rows_view(dy_rows.get(), R), rows_view(d_out.get(), R),
                                 absl::Span<float>(d.dtopk.get<float>(), entries))
                  .ok());
  ASSERT_TRUE(buf.DispatchBackward(*h, rows_view(dy_rows.get(), R), rows_view(d.dx.get(), T)).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  d.dtopk.CopyTo(&t.dtopk);
  d.dx.CopyTo(&t.dx);
  std::vector<double> dtopk(t.dtopk.begin(), t.dtopk.end());
  EXPECT_LT(RelError(dtopk, b.dtopk_weights.data() + o * kTopK, T * kTopK), 1e-5);
  std::vector<double> dx = Decode(t.dx, dt);
  for (int64_t tok = 0; tok < T; ++tok) {
    int valid = 0;
    for (int k = 0; k < kTopK; ++k) valid += t.ids[tok * kTopK + k] >= 0;
    for (int64_t j = 0; j < kHidden; ++j) {
      ASSERT_NEAR(dx[tok * kHidden + j], valid * g.p.dy[(o + tok) * kHidden + j], 1e-5);
    }
  }
  // Reduce: gradient slots of 1 add (replicas of the expert) to its zeroed home gradients.
  std::vector<float> ones(S * block, 1.0f), zeros(epn() * block, 0.0f);
  DeviceVec gg1(ones), gu1(ones), gd1(ones), hg0(zeros), hu0(zeros), hd0(zeros);
  const std::vector<compute::ExpertParams> slot_grads = params(gg1, gu1, gd1, S);
  const std::vector<compute::ExpertParams> home_grads = params(hg0, hu0, hd0, epn());
  ASSERT_TRUE(buf.Reduce(*h, home_grads, slot_grads).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<int32_t> all_slots(static_cast<size_t>(size()) * S);
  MPI_Allgather(group_expert.data() + epn(), S, MPI_INT32_T, all_slots.data(), S, MPI_INT32_T,
                MPI_COMM_WORLD);
  std::vector<float> got_g, got_d;
  hg0.CopyTo(&got_g);
  hd0.CopyTo(&got_d);
  for (int ge = 0; ge < epn(); ++ge) {
    const int e = rank() * epn() + ge;
    const float replicas = static_cast<float>(std::count(all_slots.begin(), all_slots.end(), e));
    EXPECT_EQ(got_g[ge * block], replicas) << "expert " << e;
    EXPECT_EQ(got_d[ge * block + block - 1], replicas) << "expert " << e;
  }
  ASSERT_TRUE(buf.Release(*h).ok());
}

// The cost probe on the device: the CUDA executor timed on one expert (bf16), rows over NCCL
// where there is more than one rank; the same figures on every rank, and a layer made with them.
TEST_F(MoeLayerCudaTest, CostProbeTimesTheDevice) {
  LayerConfig config = Config(DType::kBFloat16, planner::Policy::kMoonEP);
  runtime::CostProbeOptions o;
  o.compute_rows = 256;
  o.link_rows = 64;
  o.repetitions = 3;
  auto m = runtime::MeasureCosts(comm_.get(), config, o);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_GT(m->token_seconds, 0);
  EXPECT_EQ(m->inter_measured, size() > 1);
  double mine[] = {m->token_seconds, m->row_seconds_inter,
                   static_cast<double>(m->replica_cost_inter), static_cast<double>(m->row_cost_inter)};
  std::vector<double> all(4 * size());
  MPI_Allgather(mine, 4, MPI_DOUBLE, all.data(), 4, MPI_DOUBLE, MPI_COMM_WORLD);
  for (int r = 0; r < size(); ++r) {
    for (int i = 0; i < 4; ++i) EXPECT_EQ(all[4 * r + i], mine[i]) << "rank " << r;
  }
  if (size() == 1) {
    EXPECT_EQ(m->replica_cost_inter + m->row_cost_inter, 0);
  }
  runtime::ApplyCosts(*m, &config);
  auto layer = MoeLayer::Create(comm_.get(), config);
  ASSERT_TRUE(layer.ok()) << layer.status();
  ASSERT_TRUE((*layer)->Close().ok());
}

TEST_F(MoeLayerCudaTest, HostPointersAreRefused) {
  const DType dtype = DType::kFloat32;
  GlobalProblem g = MakeGlobalProblem(size(), epn(), kTopK, kHidden, kInter, kBaseTokens, dtype, 5);
  RankTensors t = MakeRankTensors(g, rank(), dtype);
  auto layer = MoeLayer::Create(comm_.get(), Config(dtype, planner::Policy::kMoonEP));
  ASSERT_TRUE(layer.ok()) << layer.status();
  // Host tensors described as host memory: refused by the layer's own checks, on every rank.
  const absl::Status bind = (*layer)->BindParameters(t.params, t.grads);
  EXPECT_EQ(ToResult(bind), moonepInvalidArgument) << bind;
  // Host memory claimed to be device memory: the transport refuses the spans (checked with
  // cudaPointerGetAttributes), with a message naming the argument; nothing crashes.
  DeviceTensors d = Upload(t, dtype, epn());
  ASSERT_TRUE((*layer)->BindParameters(d.params, d.grads).ok());
  const int64_t T = t.tokens;
  auto h = (*layer)->Forward(
      T, TensorView::Contiguous(d.x.get(), dtype, {T, kHidden}, Device::kCuda), t.ids, t.weights,
      TensorView::Contiguous(d.y.get(), dtype, {T, kHidden}, Device::kCuda), stream_);
  ASSERT_FALSE(h.ok());
  EXPECT_NE(std::string(h.status().message()).find("topk_ids"), std::string::npos) << h.status();
}

// A forward and a dispatch that the last rank refuses (what moonepLayerRefuseForward and
// moonepEpRefuseDispatch pass down) while its peers make them: the NCCL count exchange fails them
// on every rank (the refusing rank with its reason, the peers with RemoteError naming it), nothing
// is planned, and the layer and buffer stay usable. On one GPU the one rank refuses.
TEST_F(MoeLayerCudaTest, CallersRefusalFailsTheStepAndKeepsTheLayer) {
  const DType dtype = DType::kFloat32;
  GlobalProblem g = MakeGlobalProblem(size(), epn(), kTopK, kHidden, kInter, kBaseTokens, dtype, 6);
  RankTensors t = MakeRankTensors(g, rank(), dtype);
  const LayerConfig c = Config(dtype, planner::Policy::kMoonEP);
  auto layer = MoeLayer::Create(comm_.get(), c);
  ASSERT_TRUE(layer.ok()) << layer.status();
  DeviceTensors d = Upload(t, dtype, epn());
  ASSERT_TRUE((*layer)->BindParameters(d.params, d.grads).ok());
  const bool refusing = rank() == size() - 1;
  const absl::Status why = InvalidArgument("refused by the caller: x has the wrong shape");
  const TensorView none = TensorView::Contiguous(nullptr, dtype, {0, kHidden}, Device::kCuda);
  const int64_t T = t.tokens;
  const size_t entries = static_cast<size_t>(T * kTopK);
  const absl::Span<const int32_t> ids(d.ids.get<int32_t>(), entries);
  const absl::Span<const float> weights(d.weights.get<float>(), entries);
  const TensorView x = TensorView::Contiguous(d.x.get(), dtype, {T, kHidden}, Device::kCuda);
  const TensorView y = TensorView::Contiguous(d.y.get(), dtype, {T, kHidden}, Device::kCuda);
  // The refusing rank's own reason, or the peers' RemoteError naming it.
  auto expect_refused = [&](const absl::Status& s) {
    EXPECT_EQ(ToResult(s), refusing ? moonepInvalidArgument : moonepRemoteError) << s;
    const std::string expected = refusing ? "x has the wrong shape"
                                          : "rank(s) " + std::to_string(size() - 1) + " refused";
    EXPECT_NE(std::string(s.message()).find(expected), std::string::npos) << s;
  };
  auto refused = refusing ? (*layer)->Forward(-1, none, {}, {}, none, stream_, why)
                          : (*layer)->Forward(T, x, ids, weights, y, stream_);
  ASSERT_FALSE(refused.ok());
  expect_refused(refused.status());
  auto h = (*layer)->Forward(T, x, ids, weights, y, stream_);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_TRUE((*layer)->Release(*h).ok());

  auto buf = runtime::EpBuffer::Create(comm_.get(), c);
  ASSERT_TRUE(buf.ok()) << buf.status();
  auto no_dispatch = refusing ? (*buf)->Dispatch(-1, none, {}, {}, why)
                              : (*buf)->Dispatch(T, x, ids, weights);
  ASSERT_FALSE(no_dispatch.ok());
  expect_refused(no_dispatch.status());
  auto eh = (*buf)->Dispatch(T, x, ids, weights);
  ASSERT_TRUE(eh.ok()) << eh.status();
  EXPECT_TRUE((*buf)->Release(*eh).ok());
}

TEST_F(MoeLayerCudaTest, CpuTransportIsRefusedForDeviceCuda) {
  LayerConfig c = Config(DType::kFloat32, planner::Policy::kMoonEP);
  c.transport = "mpi";
  auto layer = MoeLayer::Create(comm_.get(), c);
  ASSERT_FALSE(layer.ok());
  EXPECT_NE(std::string(layer.status().message()).find("nccl"), std::string::npos)
      << layer.status();
}

}  // namespace
}  // namespace moonep::testing
