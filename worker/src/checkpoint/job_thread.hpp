#pragma once
// One job at a time on a thread of its own (the snapshot's background half).

#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

namespace fsdp::worker::detail {

// Runs one job at a time on a thread that lives as long as its owner, started with the first
// job. (A thread per snapshot cost a clone, a fresh stack's page faults and, at its exit, an
// unmap that interrupts the training thread's core, every step.)
class JobThread {
 public:
  JobThread() = default;
  JobThread(const JobThread&) = delete;
  JobThread& operator=(const JobThread&) = delete;
  ~JobThread() {
    if (!thread_.joinable()) return;
    {
      std::scoped_lock lock(mutex_);
      stopping_ = true;
    }
    changed_.notify_all();
    thread_.join();
  }
  // Runs `job` once the previous one is done; the caller waits for it with wait().
  void run(std::function<void()> job) {
    wait();
    {
      std::scoped_lock lock(mutex_);
      job_ = std::move(job);
    }
    if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
    changed_.notify_all();
  }
  void wait() {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return !job_; });
  }

 private:
  void loop() {
    std::unique_lock lock(mutex_);
    for (;;) {
      changed_.wait(lock, [&] { return job_ || stopping_; });
      if (!job_) return;  // stopping, nothing left to do
      lock.unlock();
      job_();  // the job catches what it throws
      lock.lock();
      job_ = nullptr;
      changed_.notify_all();
    }
  }
  std::mutex mutex_;
  std::condition_variable changed_;
  std::function<void()> job_;  // set while a job waits or runs
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace fsdp::worker::detail
