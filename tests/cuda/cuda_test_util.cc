#include "tests/cuda/cuda_test_util.h"

namespace moonep::compute::testing {

std::string NoGpuReason() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return cudaGetErrorString(err);
  }
  if (count == 0) return "cudaGetDeviceCount found none";
  return "";
}

DeviceBuffer::DeviceBuffer(size_t bytes) : bytes_(bytes) {
  EXPECT_EQ(cudaMalloc(&ptr_, bytes > 0 ? bytes : 16), cudaSuccess) << bytes << " bytes";
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_ != nullptr) cudaFree(ptr_);
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = o.ptr_;
    bytes_ = o.bytes_;
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

void DeviceBuffer::Upload(const void* host) const {
  EXPECT_EQ(cudaMemcpy(ptr_, host, bytes_, cudaMemcpyHostToDevice), cudaSuccess);
}
void DeviceBuffer::Download(void* host) const {
  EXPECT_EQ(cudaMemcpy(host, ptr_, bytes_, cudaMemcpyDeviceToHost), cudaSuccess);
}
void DeviceBuffer::Poison() const { EXPECT_EQ(cudaMemset(ptr_, 0xff, bytes_), cudaSuccess); }

namespace {

TensorView Strided(void* data, DType dtype, int64_t rows, int64_t cols, int64_t ld) {
  TensorView t = TensorView::Contiguous(data, dtype, {rows, cols}, Device::kCuda);
  t.strides[0] = ld;
  return t;
}

// Copies a contiguous host [rows, cols] matrix into (or out of) columns of a device matrix.
void Copy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t rows,
            cudaMemcpyKind kind) {
  EXPECT_EQ(cudaMemcpy2D(dst, dpitch, src, spitch, width, rows, kind), cudaSuccess);
}

}  // namespace

DeviceProblem::DeviceProblem(Problem& p, bool fuse_gate_up) : host(&p), fused(fuse_gate_up) {
  const int64_t H = p.spec.hidden, I = p.spec.intermediate;
  const size_t G = p.view.groups.size();
  view = p.view;
  view.device = Device::kCuda;
  x = DeviceBuffer(p.x.bytes());
  dy = DeviceBuffer(p.dy.bytes());
  x.Upload(p.x.data());
  dy.Upload(p.dy.data());
  for (size_t g = 0; g < G; ++g) {
    for (int set = 0; set < 2; ++set) {
      std::vector<Buffer>& src = set == 0 ? p.weights : p.grads;
      std::vector<DeviceBuffer>& dst = set == 0 ? weights : grads;
      const DType dt = set == 0 ? p.spec.dtype : p.spec.grad_dtype;
      const size_t e = DTypeSize(dt);
      ExpertParams& params = set == 0 ? view.groups[g].weights : view.groups[g].grads;
      if (fuse_gate_up && set == 0) {
        dst.emplace_back(static_cast<size_t>(H * 2 * I) * e);
        Copy2D(dst.back().data(), 2 * I * e, src[3 * g].data(), I * e, I * e, H, cudaMemcpyHostToDevice);
        Copy2D(static_cast<char*>(dst.back().data()) + I * e, 2 * I * e, src[3 * g + 1].data(), I * e,
               I * e, H, cudaMemcpyHostToDevice);
        params.gate = Strided(dst.back().data(), dt, H, I, 2 * I);
        params.up = Strided(static_cast<char*>(dst.back().data()) + I * e, dt, H, I, 2 * I);
        dst.emplace_back(0);
      } else {
        for (int m = 0; m < 2; ++m) {
          dst.emplace_back(src[3 * g + m].bytes());
          dst.back().Upload(src[3 * g + m].data());
        }
        params.gate = dst[3 * g].View(H, I, dt);
        params.up = dst[3 * g + 1].View(H, I, dt);
      }
      dst.emplace_back(src[3 * g + 2].bytes());
      dst.back().Upload(src[3 * g + 2].data());
      params.down = dst.back().View(I, H, dt);
    }
  }
}

void DeviceProblem::UploadGrads(Problem& p) {
  for (size_t k = 0; k < grads.size(); ++k) grads[k].Upload(p.grads[k].data());
}

void DeviceProblem::DownloadGrads(Problem& p) {
  for (size_t k = 0; k < grads.size(); ++k) grads[k].Download(p.grads[k].data());
}

}  // namespace moonep::compute::testing
