// Injectable clock so timeout logic (heartbeats, last call) is tested without
// sleeping (as Ray's gcs_health_check_manager does). Thread-safe.
#pragma once

#include <atomic>
#include <chrono>

namespace ballast {

class ClockInterface {
 public:
  virtual ~ClockInterface() = default;
  // Monotonic time in seconds since an arbitrary epoch.
  virtual double Now() const = 0;
};

class SteadyClock : public ClockInterface {
 public:
  double Now() const override {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  static SteadyClock* Get() {
    static SteadyClock clock;
    return &clock;
  }
};

// A clock tests advance by hand.
class FakeClock : public ClockInterface {
 public:
  explicit FakeClock(double start = 1000.0) : now_(start) {}
  double Now() const override { return now_.load(); }
  void Advance(double seconds) { now_.store(now_.load() + seconds); }
  void Set(double t) { now_.store(t); }

 private:
  std::atomic<double> now_;
};

}  // namespace ballast
