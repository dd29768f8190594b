// Buffers for operations that may be in flight together (reduce staging): each operation holds
// its own buffer, and a later operation reuses one that was given back, so a steady state does not
// allocate. Acquire takes the first buffer not held, so one operation in flight at a time always
// gets the same buffer (and keeps a backend's registration of it valid from step to step).
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

namespace moonep::transport::common {

template <typename Buffer>
class BufferPool {
 public:
  // A buffer no operation holds; a new (default-constructed) one when every buffer is held.
  Buffer* Acquire() {
    for (size_t i = 0; i < buffers_.size(); ++i) {
      if (!held_[i]) {
        held_[i] = true;
        return buffers_[i].get();
      }
    }
    buffers_.push_back(std::make_unique<Buffer>());
    held_.push_back(true);
    return buffers_.back().get();
  }
  // Gives a buffer back (nullptr: nothing). Buffers live as long as the pool.
  void Release(const Buffer* buffer) {
    for (size_t i = 0; i < buffers_.size(); ++i) {
      if (buffers_[i].get() == buffer) held_[i] = false;
    }
  }
  // Leaves a buffer allocated for good (an MPI receive that could not be cancelled may still write
  // into it after the pool is gone).
  void Abandon(const Buffer* buffer) {
    for (size_t i = 0; i < buffers_.size(); ++i) {
      if (buffers_[i].get() != buffer) continue;
      (void)buffers_[i].release();  // leaked on purpose
      buffers_.erase(buffers_.begin() + static_cast<std::ptrdiff_t>(i));
      held_.erase(held_.begin() + static_cast<std::ptrdiff_t>(i));
      return;
    }
  }
  size_t size() const { return buffers_.size(); }
  // Calls fn(Buffer*) for every buffer, held or not.
  template <typename Fn>
  void ForEach(Fn&& fn) {
    for (auto& b : buffers_) fn(b.get());
  }

 private:
  std::vector<std::unique_ptr<Buffer>> buffers_;
  std::vector<bool> held_;
};

}  // namespace moonep::transport::common
