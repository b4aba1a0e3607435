// ballast._ballast: the thin pybind11 layer over the flash-checkpoint core
// (src/ckpt). Byte-oriented on purpose: Python hands in (key, dtype name,
// shape, data pointer, nbytes) records and gets back snapshots it copies out of;
// the state-dict tree encoding lives in python/ballast/_tree.py.
//
// Every copy and every blocking call runs with the GIL released. Statuses turn
// into Python exceptions only here (see ThrowStatus): kDataLoss ->
// CheckpointCorruptError(RuntimeError), kNotFound -> FileNotFoundError,
// kInvalidArgument -> ValueError, kDeadlineExceeded -> TimeoutError, ...
//
// Lifetimes: a Store holds its SlotStore through a shared_ptr; snapshots and
// persisters taken from it share that ownership, so the shared memory (and the
// owner's unlink) lasts as long as anything uses it.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <bit>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "ckpt/checkpoint.h"
#include "ckpt/copy_pool.h"
#include "ckpt/format.h"
#include "ckpt/persister.h"
#include "ckpt/reader.h"
#include "ckpt/shm_segment.h"
#include "ckpt/slot_store.h"
#include "ckpt/snapshot.h"
#include "common/progress_cell.h"

namespace py = pybind11;

namespace ballast::python {
namespace {

using ckpt::CopyPool;
using ckpt::DType;

PyObject* g_corrupt_error = nullptr;  // ballast.CheckpointCorruptError

// Raises the Python exception that tells the caller what to do about `s`.
// Needs the GIL.
[[noreturn]] void ThrowStatus(const absl::Status& s) {
  PyObject* type = PyExc_RuntimeError;
  switch (s.code()) {
    case absl::StatusCode::kDataLoss:
      type = g_corrupt_error;
      break;
    case absl::StatusCode::kNotFound:
      type = PyExc_FileNotFoundError;
      break;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
      type = PyExc_ValueError;
      break;
    case absl::StatusCode::kDeadlineExceeded:
      type = PyExc_TimeoutError;
      break;
    case absl::StatusCode::kPermissionDenied:
      type = PyExc_PermissionError;
      break;
    case absl::StatusCode::kAlreadyExists:
      type = PyExc_FileExistsError;
      break;
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kResourceExhausted:
      type = PyExc_OSError;
      break;
    case absl::StatusCode::kUnimplemented:
      type = PyExc_NotImplementedError;
      break;
    default:
      break;
  }
  PyErr_SetString(type, std::string(s.message()).c_str());
  throw py::error_already_set();
}

void Check(const absl::Status& s) {
  if (!s.ok()) ThrowStatus(s);
}

// Threads for loads (copies out of snapshots). Leaked on purpose: joining
// threads from a static destructor at interpreter exit is fragile.
CopyPool* LoadPool() {
  static CopyPool* pool = new CopyPool(ckpt::DefaultCopyThreads());
  return pool;
}

struct CopyJob {
  const uint8_t* src;
  uint8_t* dst;
  uint64_t n;
};

// Asks for transparent huge pages on the 2 MiB-aligned interior of a fresh
// destination buffer: first-touch faults of 4 KiB pages otherwise cost more
// than the copy itself (a load writes into newly allocated tensors).
void AdviseHugePages(uint8_t* dst, uint64_t n) {
  constexpr uintptr_t kHuge = 2u << 20;
  const uintptr_t lo = (reinterpret_cast<uintptr_t>(dst) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(dst) + n) & ~(kHuge - 1);
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);  // best effort
}

// Runs the copies over `pool`, large ones split into chunks. No GIL needed.
void RunCopies(const std::vector<CopyJob>& jobs, CopyPool* pool, bool fresh = true) {
  constexpr uint64_t kChunk = 4u << 20;
  for (const CopyJob& j : jobs) {
    if (fresh && j.n >= (4u << 20)) AdviseHugePages(j.dst, j.n);
  }
  uint64_t total = 0;
  for (const CopyJob& j : jobs) total += j.n;
  if (total < ckpt::kDefaultParallelCopyThreshold || pool->threads() == 1) {
    for (const CopyJob& j : jobs) {
      if (j.n > 0) std::memcpy(j.dst, j.src, j.n);
    }
    return;
  }
  std::vector<CopyJob> chunks;
  for (const CopyJob& j : jobs) {
    for (uint64_t off = 0; off < j.n; off += kChunk) {
      chunks.push_back({j.src + off, j.dst + off, std::min(kChunk, j.n - off)});
    }
  }
  pool->Run(chunks.size(), [&](size_t i) { std::memcpy(chunks[i].dst, chunks[i].src, chunks[i].n); });
}

std::vector<int64_t> ToShape(const py::handle& obj) {
  std::vector<int64_t> shape;
  for (py::handle d : obj) shape.push_back(py::cast<int64_t>(d));
  return shape;
}

py::tuple ShapeTuple(const std::vector<int64_t>& shape) {
  py::tuple t(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) t[i] = py::int_(shape[i]);
  return t;
}

// A private, copy-on-write mapping of a pinned shared-memory slot's data
// region, for tensors that view a loaded checkpoint without copying it
// (Checkpointer.load's default). Reads share the slot's pages; a write (an
// optimizer updating a loaded state in place) copies the page it touches, so
// the checkpoint itself never changes. It holds the slot's pin (a copy of the
// snapshot) for its whole life: the writer never picks a pinned slot, so no
// later save rewrites the pages under it either. Exposed with the buffer
// protocol (torch.frombuffer).
class PyPrivateData {
 public:
  PyPrivateData(ckpt::Snapshot snap, std::shared_ptr<ckpt::SlotStore> store, void* map, uint64_t map_bytes,
                uint64_t data_offset)
      : store_(std::move(store)), snap_(std::move(snap)), map_(map), map_bytes_(map_bytes),
        data_offset_(data_offset) {}
  ~PyPrivateData() {
    if (map_ != nullptr) munmap(map_, map_bytes_);
  }
  PyPrivateData(const PyPrivateData&) = delete;
  PyPrivateData& operator=(const PyPrivateData&) = delete;

  uint8_t* data() const { return static_cast<uint8_t*>(map_) + data_offset_; }
  uint64_t data_bytes() const { return snap_.data_bytes(); }

 private:
  std::shared_ptr<ckpt::SlotStore> store_;  // outlives the pin snap_ holds
  ckpt::Snapshot snap_;                      // the pin
  void* map_;
  uint64_t map_bytes_;
  uint64_t data_offset_;
};

// A validated checkpoint image (pinned slot or mapped file), read-only.
class PySnapshot {
 public:
  PySnapshot(ckpt::Snapshot snap, std::shared_ptr<ckpt::SlotStore> store)
      : store_(std::move(store)), snap_(std::move(snap)) {}

  uint64_t step() const { return snap_.step(); }
  const std::string& source() const { return snap_.source(); }
  bool verified() const { return snap_.verified() || checked_; }

  // The whole image as a read-only memoryview (no copy), to send it as it is
  // (Checkpointer.load's exchange between ranks). Valid while this snapshot
  // lives.
  py::memoryview ImageView() const {
    if (snap_.image() == nullptr) Check(absl::FailedPreconditionError("this snapshot has no whole image"));
    return py::memoryview::from_memory(snap_.image(), static_cast<py::ssize_t>(snap_.image_bytes()));
  }
  uint64_t image_bytes() const { return snap_.image_bytes(); }

  // The data region as a private copy-on-write mapping (PyPrivateData), or
  // None when this snapshot is not a shared-memory slot's whole image.
  py::object PrivateData() const {
    const std::string& src = snap_.source();
    if (src.rfind("shm:", 0) != 0 || snap_.image() == nullptr || snap_.data() < snap_.image()) return py::none();
    const std::string name = src.substr(4);
    const uint64_t data_offset = static_cast<uint64_t>(snap_.data() - snap_.image());
    const uint64_t bytes = data_offset + snap_.data_bytes();
    if (bytes == 0) return py::none();
    int fd = shm_open(name.c_str(), O_RDONLY, 0);
    if (fd < 0) return py::none();  // gone (the agent died): the caller copies instead
    void* map = nullptr;
    {
      py::gil_scoped_release release;
      // Populated read-only (the page tables at once, pointing at the slot's
      // pages), then made writable: populating a writable private mapping
      // would copy every page (the kernel breaks copy-on-write while it
      // populates), while after mprotect a page is copied only when written.
      map = mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE | MAP_POPULATE, fd, 0);
      if (map != MAP_FAILED && mprotect(map, bytes, PROT_READ | PROT_WRITE) != 0) {
        munmap(map, bytes);
        map = MAP_FAILED;
      }
    }
    close(fd);
    if (map == MAP_FAILED) return py::none();
    return py::cast(std::make_unique<PyPrivateData>(snap_, store_, map, bytes, data_offset));
  }

  // One checksum pass over the data (parallel, GIL released);
  // CheckpointCorruptError on a mismatch. Later copies skip their check.
  void Verify() {
    if (verified()) return;
    uint64_t digest = 0;
    {
      py::gil_scoped_release release;
      digest = ckpt::ParallelChecksum(snap_.data(), snap_.data_bytes(), LoadPool());
    }
    if (digest != snap_.data_checksum()) {
      Check(absl::DataLossError(absl::StrCat("checkpoint ", snap_.source(),
                                             " is corrupt: data checksum mismatch; restore from disk instead")));
    }
    checked_ = true;
  }

  // Each entry's offset in the data region, in storage order.
  std::vector<uint64_t> EntryOffsets() const {
    std::vector<uint64_t> out;
    for (const ckpt::Entry& e : snap_.entries()) out.push_back(e.offset);
    return out;
  }

  // [(key, dtype name, shape tuple, nbytes)] in storage order.
  py::list Entries() const {
    py::list out;
    for (const ckpt::Entry& e : snap_.entries()) {
      out.append(py::make_tuple(e.key, std::string(ckpt::DTypeName(e.dtype)), ShapeTuple(e.shape),
                                e.nbytes));
    }
    return out;
  }

  py::bytes ReadBytes(size_t index) const {
    const ckpt::Entry& e = At(index);
    return py::bytes(reinterpret_cast<const char*>(snap_.Data(e)), e.nbytes);
  }

  // Copies entry i's bytes to dst for each (i, dst) of `targets` (dst: an
  // address with room for the entry's nbytes, e.g. a fresh tensor's
  // data_ptr()).
  //
  // With verify, a snapshot restored without verification is checked as it
  // is copied (one pass: ckpt::CopyOutAndChecksum); a mismatch raises
  // CheckpointCorruptError and the targets hold garbage. fresh: the targets
  // are newly allocated (ask for huge pages before the first touch).
  void CopyTo(const std::vector<std::pair<size_t, uintptr_t>>& targets, bool verify, bool fresh) const {
    if (verify && !verified()) {
      std::vector<ckpt::Extract> extracts;
      extracts.reserve(targets.size());
      for (const auto& [index, dst] : targets) {
        const ckpt::Entry& e = At(index);
        extracts.push_back({e.offset, e.nbytes, reinterpret_cast<uint8_t*>(dst)});
      }
      std::sort(extracts.begin(), extracts.end(),
                [](const ckpt::Extract& a, const ckpt::Extract& b) { return a.offset < b.offset; });
      uint64_t digest = 0;
      {
        py::gil_scoped_release release;
        if (fresh) {
          for (const ckpt::Extract& x : extracts) {
            if (x.nbytes >= (4u << 20)) AdviseHugePages(x.dst, x.nbytes);
          }
        }
        digest = ckpt::CopyOutAndChecksum(snap_.data(), snap_.data_bytes(), extracts, LoadPool());
      }
      if (digest != snap_.data_checksum()) {
        Check(absl::DataLossError(absl::StrCat("checkpoint ", snap_.source(),
                                               " is corrupt: data checksum mismatch; restore from disk instead")));
      }
      return;
    }
    std::vector<CopyJob> jobs;
    jobs.reserve(targets.size());
    for (const auto& [index, dst] : targets) {
      const ckpt::Entry& e = At(index);
      jobs.push_back({snap_.Data(e), reinterpret_cast<uint8_t*>(dst), e.nbytes});
    }
    py::gil_scoped_release release;
    RunCopies(jobs, LoadPool(), fresh);
  }

  // Copies the box [src_start, src_start + box) of entry `index` (a row-major
  // array of src_shape with elements of elem_size bytes) to
  // [dst_start, dst_start + box) of the row-major array of dst_shape at dst.
  void CopyBox(size_t index, uint64_t elem_size, const std::vector<int64_t>& src_shape,
               const std::vector<int64_t>& src_start, uintptr_t dst,
               const std::vector<int64_t>& dst_shape, const std::vector<int64_t>& dst_start,
               const std::vector<int64_t>& box) const {
    const ckpt::Entry& e = At(index);
    const size_t nd = box.size();
    if (src_shape.size() != nd || src_start.size() != nd || dst_shape.size() != nd ||
        dst_start.size() != nd || elem_size == 0) {
      Check(absl::InvalidArgumentError("copy_box: rank mismatch"));
    }
    uint64_t src_elems = 1;
    for (size_t d = 0; d < nd; ++d) {
      if (box[d] < 0 || src_start[d] < 0 || dst_start[d] < 0 ||
          src_start[d] + box[d] > src_shape[d] || dst_start[d] + box[d] > dst_shape[d]) {
        Check(absl::InvalidArgumentError(absl::StrCat("copy_box: box out of bounds in dim ", d)));
      }
      src_elems *= static_cast<uint64_t>(src_shape[d]);
    }
    if (src_elems * elem_size != e.nbytes) {
      Check(absl::InvalidArgumentError(absl::StrCat("copy_box: entry '", e.key, "' has ", e.nbytes,
                                                    " bytes, not ", src_elems * elem_size)));
    }
    for (int64_t b : box) {
      if (b == 0) return;
    }
    const uint8_t* src = snap_.Data(e);
    uint8_t* out = reinterpret_cast<uint8_t*>(dst);
    py::gil_scoped_release release;
    if (nd == 0) {
      std::memcpy(out, src, elem_size);
      return;
    }
    // Row-major strides in bytes.
    std::vector<uint64_t> ss(nd), ds(nd);
    ss[nd - 1] = ds[nd - 1] = elem_size;
    for (size_t d = nd - 1; d > 0; --d) {
      ss[d - 1] = ss[d] * static_cast<uint64_t>(src_shape[d]);
      ds[d - 1] = ds[d] * static_cast<uint64_t>(dst_shape[d]);
    }
    const uint64_t row = static_cast<uint64_t>(box[nd - 1]) * elem_size;
    std::vector<int64_t> idx(nd, 0);  // position inside the box, last dim fixed at 0
    while (true) {
      uint64_t so = 0, dof = 0;
      for (size_t d = 0; d < nd; ++d) {
        so += static_cast<uint64_t>(src_start[d] + idx[d]) * ss[d];
        dof += static_cast<uint64_t>(dst_start[d] + idx[d]) * ds[d];
      }
      std::memcpy(out + dof, src + so, row);
      // Advance the odometer over dims [0, nd - 1).
      size_t d = nd - 1;
      while (d > 0) {
        --d;
        if (++idx[d] < box[d]) break;
        idx[d] = 0;
        if (d == 0) return;
      }
      if (nd == 1) return;
    }
  }

 private:
  const ckpt::Entry& At(size_t index) const {
    if (index >= snap_.entries().size()) {
      PyErr_SetString(PyExc_IndexError, "snapshot entry index out of range");
      throw py::error_already_set();
    }
    return snap_.entries()[index];
  }

  // Declared before snap_: the store outlives the pin snap_ holds on it.
  std::shared_ptr<ckpt::SlotStore> store_;  // keeps a pinned slot's store alive
  ckpt::Snapshot snap_;
  bool checked_ = false;  // Verify() passed
};

// One rank's SlotStore (created by the agent, or by a Checkpointer without one)
// and this process's writer into it.
class PyStore {
 public:
  explicit PyStore(std::shared_ptr<ckpt::SlotStore> store) : store_(std::move(store)) {}

  static std::unique_ptr<PyStore> Create(const std::string& name, int num_slots,
                                         uint64_t initial_slot_bytes, bool prefault) {
    ckpt::SlotStoreOptions options;
    options.num_slots = num_slots;
    options.initial_slot_bytes = initial_slot_bytes;
    options.prefault = prefault;
    absl::StatusOr<std::unique_ptr<ckpt::SlotStore>> s;
    {
      py::gil_scoped_release release;
      s = ckpt::SlotStore::Create(name, options);
    }
    Check(s.status());
    return std::make_unique<PyStore>(std::shared_ptr<ckpt::SlotStore>(std::move(*s)));
  }

  static std::unique_ptr<PyStore> Open(const std::string& name, bool prefault) {
    absl::StatusOr<std::unique_ptr<ckpt::SlotStore>> s;
    {
      py::gil_scoped_release release;
      s = ckpt::SlotStore::Open(name, prefault);
    }
    if (absl::IsNotFound(s.status())) {
      Check(absl::NotFoundError(absl::StrCat(
          "no flash-checkpoint shared memory named ", name, " (", s.status().message(),
          "): BALLAST_CKPT_SHM names a store the `ballast run` agent creates; unset it to run "
          "without an agent")));
    }
    Check(s.status());
    return std::make_unique<PyStore>(std::shared_ptr<ckpt::SlotStore>(std::move(*s)));
  }

  const std::shared_ptr<ckpt::SlotStore>& store() const {
    if (!store_) {
      PyErr_SetString(PyExc_RuntimeError, "the checkpoint store is closed");
      throw py::error_already_set();
    }
    return store_;
  }

  // Store.save's (key, dtype name, shape, data address or bytes, nbytes) entries.
  static std::vector<ckpt::EntryView> ToViews(const py::list& entries, const char* what) {
    std::vector<ckpt::EntryView> views;
    views.reserve(entries.size());
    for (py::handle item : entries) {
      auto t = py::reinterpret_borrow<py::tuple>(item);
      if (t.size() != 5) Check(absl::InvalidArgumentError(absl::StrCat(what, ": entries are 5-tuples")));
      ckpt::EntryView v;
      v.key = py::cast<std::string>(t[0]);
      absl::StatusOr<DType> dtype = ckpt::DTypeFromName(py::cast<std::string>(t[1]));
      Check(dtype.status());
      v.dtype = *dtype;
      v.shape = ToShape(t[2]);
      py::handle data = t[3];
      if (PyBytes_Check(data.ptr())) {
        // The caller's list keeps the bytes object alive during the save.
        v.data = PyBytes_AS_STRING(data.ptr());
      } else {
        v.data = reinterpret_cast<const void*>(py::cast<uintptr_t>(data));
      }
      v.nbytes = py::cast<uint64_t>(t[4]);
      views.push_back(std::move(v));
    }
    return views;
  }

  // The writer for blocking (or overlapped) saves, made on first use.
  ckpt::CheckpointWriter* Writer(bool background) {
    std::unique_ptr<ckpt::CheckpointWriter>& writer = background ? bg_writer_ : writer_;
    if (!writer) {
      ckpt::WriterOptions wo = writer_options_;
      wo.background = background;
      writer = std::make_unique<ckpt::CheckpointWriter>(this->store().get(), wo);
    }
    return writer.get();
  }

  // A blocking save on the calling thread (the GIL released) and every copy
  // thread. entries: [(key, dtype name, shape, data, nbytes)] where data is an
  // address (int) or a bytes object. Returns {"seconds", "image_bytes",
  // "slot"}. Overlapped saves go through SaveAsync.
  py::dict Save(uint64_t step, const py::list& entries) {
    std::vector<ckpt::EntryView> views = ToViews(entries, "save");
    ckpt::CheckpointWriter* writer = Writer(/*background=*/false);
    absl::StatusOr<ckpt::SaveStats> stats;
    {
      py::gil_scoped_release release;
      stats = SaveRetrying(writer, step, views, /*parallel=*/true);
    }
    return SaveResult(step, stats);
  }

  // save(blocking=False): copies `entries` on this store's own copy thread
  // (started at the first call, at idle priority, never holding the GIL) and
  // returns at once. The caller keeps `entries` and the tensors they point
  // into alive until wait_async() returns. parallel: the writer's copy
  // threads join in (else that one thread copies alone: see
  // CheckpointWriter::Save). One save at a time: wait_async() first.
  void SaveAsync(uint64_t step, const py::list& entries, bool parallel) {
    std::vector<ckpt::EntryView> views = ToViews(entries, "save");
    ckpt::CheckpointWriter* writer = Writer(/*background=*/true);
    AsyncState* a = OwnAsync();
    if (a == nullptr) {
      async_ = std::make_unique<AsyncState>();
      a = async_.get();
      a->pid = getpid();
      a->thread = std::thread([a] { AsyncLoop(a); });
    }
    {
      std::lock_guard<std::mutex> lock(a->mu);
      if (a->job || a->result) {
        Check(absl::FailedPreconditionError("an overlapped save is still pending: wait_async() first"));
      }
      a->job = AsyncJob{writer, step, std::move(views), parallel};
    }
    a->cv.notify_all();
  }

  // Whether the pending overlapped save (if any) has finished copying.
  bool AsyncDone() {
    AsyncState* a = OwnAsync();
    if (a == nullptr) return true;
    std::lock_guard<std::mutex> lock(a->mu);
    return !a->job;
  }

  // Waits for the pending overlapped save: its stats (as save()'s), None when
  // nothing is pending; raises its error.
  py::object WaitAsync() {
    AsyncState* a = OwnAsync();
    if (a == nullptr) return py::none();
    uint64_t step = 0;
    std::optional<absl::StatusOr<ckpt::SaveStats>> result;
    {
      py::gil_scoped_release release;
      std::unique_lock<std::mutex> lock(a->mu);
      a->cv.wait(lock, [&] { return !a->job; });
      step = a->step;
      result.swap(a->result);
    }
    if (!result) return py::none();
    return SaveResult(step, *result);
  }

  // Sizes and faults the slots for saves of `entries` in the background (the
  // data items are not read: 0 will do); returns the planned image bytes.
  uint64_t Reserve(const py::list& entries, bool background) {
    std::vector<ckpt::EntryView> views = ToViews(entries, "reserve");
    ckpt::CheckpointWriter* writer = Writer(background);
    absl::StatusOr<uint64_t> bytes = writer->Reserve(views);
    Check(bytes.status());
    return *bytes;
  }

  // The newest committed step (or `step`), validated; None when there is none.
  std::optional<PySnapshot> Restore(std::optional<uint64_t> step, bool verify) {
    std::shared_ptr<ckpt::SlotStore> store = this->store();
    ckpt::RestoreOptions options;
    options.verify_data = verify;
    options.step = step;
    options.pool = LoadPool();
    absl::StatusOr<ckpt::Snapshot> snap;
    {
      py::gil_scoped_release release;
      snap = ckpt::RestoreFromShm(store.get(), options);
    }
    if (absl::IsNotFound(snap.status())) return std::nullopt;
    Check(snap.status());
    return PySnapshot(std::move(*snap), store);
  }

  // The committed steps, newest first (a racy view: a step may be replaced
  // before it is restored).
  std::vector<uint64_t> Steps() const {
    std::vector<std::pair<uint64_t, uint64_t>> order_step;
    for (const ckpt::SlotInfo& info : store()->Inspect()) {
      if (info.state == ckpt::SlotState::kCommitted) order_step.emplace_back(info.commit_order, info.step);
    }
    std::sort(order_step.rbegin(), order_step.rend());
    std::vector<uint64_t> out;
    for (const auto& [order, step] : order_step) out.push_back(step);
    return out;
  }

  // Waits while the agent copies a peer's replica into this store; false on timeout.
  bool WaitIncoming(double timeout_s) {
    std::shared_ptr<ckpt::SlotStore> store = this->store();
    py::gil_scoped_release release;
    return store->WaitIncoming(timeout_s);
  }

  std::optional<uint64_t> MemoryStep() {
    absl::StatusOr<ckpt::PinnedSlot> pin = store()->PinLatest();
    if (absl::IsNotFound(pin.status())) return std::nullopt;
    Check(pin.status());
    return pin->step();
  }

  void SetPersistConfig(const std::string& dir, int rank, int world_size, int keep) {
    ckpt::PersistConfig c;
    c.dir = dir;
    c.rank = rank;
    c.world_size = world_size;
    c.keep_last = keep;
    Check(store()->SetPersistConfig(c));
  }

  py::object GetPersistConfig() {
    std::optional<ckpt::PersistConfig> c = store()->GetPersistConfig();
    if (!c) return py::none();
    py::dict d;
    d["dir"] = c->dir;
    d["rank"] = c->rank;
    d["world_size"] = c->world_size;
    d["keep"] = c->keep_last;
    return d;
  }

  // Polls durable_step() until it reaches `step` or timeout_s passes.
  bool WaitDurable(uint64_t step, double timeout_s) {
    std::shared_ptr<ckpt::SlotStore> store = this->store();
    py::gil_scoped_release release;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    auto sleep = std::chrono::microseconds(200);
    while (store->durable_step() < step) {
      if (std::chrono::steady_clock::now() >= deadline) return false;
      // The persister said this step cannot be made durable: stop waiting.
      if (auto err = store->GetPersistError(); err.has_value() && err->step >= step) return false;
      std::this_thread::sleep_for(sleep);
      sleep = std::min<std::chrono::microseconds>(sleep * 2, std::chrono::milliseconds(20));
    }
    return true;
  }

  // Test hook: the next saves write `path` once their data is copied, then
  // stop forever before committing (the test SIGKILLs the process there).
  void SetTestPauseBeforeCommit(const std::string& path) {
    writer_options_.before_commit_for_test = [path] {
      { std::ofstream(path) << getpid() << "\n"; }
      while (true) pause();
    };
    writer_.reset();
    bg_writer_.reset();
  }

  void Close() {
    StopAsync();
    writer_.reset();
    bg_writer_.reset();
    store_.reset();
  }

  ~PyStore() { StopAsync(); }

 private:
  std::shared_ptr<ckpt::SlotStore> store_;
  ckpt::WriterOptions writer_options_;
  std::unique_ptr<ckpt::CheckpointWriter> writer_;  // borrows *store_
  std::unique_ptr<ckpt::CheckpointWriter> bg_writer_;  // background saves; borrows *store_

  // Every slot pinned: readers that copy a step out (the persister, the
  // replica sender) let go within milliseconds, so wait for one a little
  // before giving up (a worker's pinned rollback target and a load's views
  // leave fewer slots free to them).
  static absl::StatusOr<ckpt::SaveStats> SaveRetrying(ckpt::CheckpointWriter* writer, uint64_t step,
                                                      const std::vector<ckpt::EntryView>& views, bool parallel) {
    absl::StatusOr<ckpt::SaveStats> stats = writer->Save(step, views, parallel);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    for (int pause_us = 200; absl::IsUnavailable(stats.status()) && std::chrono::steady_clock::now() < deadline;
         pause_us = std::min(pause_us * 2, 20000)) {
      std::this_thread::sleep_for(std::chrono::microseconds(pause_us));
      stats = writer->Save(step, views, parallel);
    }
    return stats;
  }

  // A save's stats as a dict, or its error raised.
  static py::dict SaveResult(uint64_t step, const absl::StatusOr<ckpt::SaveStats>& stats) {
    if (absl::IsUnavailable(stats.status())) {
      Check(absl::UnavailableError(absl::StrCat(
          "checkpoint step ", step, " not saved: every shared-memory slot is being read (",
          stats.status().message(), "); save again later")));
    }
    Check(stats.status());
    py::dict out;
    out["seconds"] = stats->seconds;
    out["image_bytes"] = stats->image_bytes;
    out["slot"] = stats->slot;
    return out;
  }

  struct AsyncJob {
    ckpt::CheckpointWriter* writer;
    uint64_t step;
    std::vector<ckpt::EntryView> views;
    bool parallel;
  };

  // SaveAsync's copy thread and what it shares with its callers.
  struct AsyncState {
    std::mutex mu;
    std::condition_variable cv;
    std::optional<AsyncJob> job;  // the save being copied
    std::optional<absl::StatusOr<ckpt::SaveStats>> result;  // its outcome, until WaitAsync
    uint64_t step = 0;  // the step of `result`
    bool stop = false;
    pid_t pid = 0;  // the process the thread runs in
    std::thread thread;
  };

  // The copy thread: one job at a time, at idle priority (it runs on CPU time
  // training leaves).
  static void AsyncLoop(AsyncState* a) {
    ckpt::MakeThisThreadBackground();
    std::unique_lock<std::mutex> lock(a->mu);
    while (true) {
      a->cv.wait(lock, [&] { return a->stop || a->job; });
      if (!a->job) return;  // stopped with nothing pending
      AsyncJob& job = *a->job;
      lock.unlock();
      absl::StatusOr<ckpt::SaveStats> stats = SaveRetrying(job.writer, job.step, job.views, job.parallel);
      lock.lock();
      a->step = job.step;
      a->result = std::move(stats);
      a->job.reset();
      a->cv.notify_all();
      if (a->stop) return;
    }
  }

  // This process's copy thread state, or null. A process forked after the
  // thread started has no such thread, and the state's mutex and condition
  // variable may be held or waited on by threads that do not exist here:
  // they are left alone (leaked, never destroyed) and the process starts
  // its own at its next overlapped save.
  AsyncState* OwnAsync() {
    if (async_ && async_->pid != getpid()) {
      async_->thread.detach();
      (void)async_.release();
    }
    return async_.get();
  }

  // Finishes a pending overlapped save and ends the copy thread.
  void StopAsync() {
    AsyncState* a = OwnAsync();
    if (a == nullptr) return;
    {
      // Not holding the GIL while the copy finishes (a destructor may run without it).
      std::optional<py::gil_scoped_release> release;
      if (PyGILState_Check()) release.emplace();
      {
        std::lock_guard<std::mutex> lock(a->mu);
        a->stop = true;
      }
      a->cv.notify_all();
      a->thread.join();
    }
    async_.reset();
  }

  std::unique_ptr<AsyncState> async_;
};

// Without an agent: persists the store's committed steps on a thread of this
// process and commits steps with LocalCommitCoordinator.
class PyLocalPersister {
 public:
  PyLocalPersister(const PyStore& store, const std::string& dir, int rank, int world_size, int keep)
      : store_(store.store()),
        coordinator_(dir, world_size, keep),
        persister_(store_.get(), &coordinator_, ckpt::PersisterOptions{dir, rank, {}}),
        async_(std::make_unique<ckpt::AsyncPersister>(&persister_)) {}

  ~PyLocalPersister() {
    py::gil_scoped_release release;
    async_.reset();
  }

  void Request(uint64_t step) { Live()->Request(step); }

  void Wait(uint64_t step, double timeout_s) {
    ckpt::AsyncPersister* async = Live();
    absl::Status s;
    {
      py::gil_scoped_release release;
      s = async->WaitDurable(step, timeout_s);
    }
    if (s.ok()) {
      store_->MarkDurable(step);
      return;
    }
    if (absl::IsDeadlineExceeded(s)) {
      Check(absl::DeadlineExceededError(absl::StrCat(
          "checkpoint step ", step, " is not durable yet (", s.message(),
          "); the disk may be slow: call wait() again with a larger timeout")));
    }
    Check(s);
  }

  // Finishes the pending request, then stops the thread.
  void Close() {
    py::gil_scoped_release release;
    async_.reset();
  }

 private:
  ckpt::AsyncPersister* Live() {
    if (!async_) {
      PyErr_SetString(PyExc_RuntimeError, "the checkpoint persister is closed");
      throw py::error_already_set();
    }
    return async_.get();
  }

  std::shared_ptr<ckpt::SlotStore> store_;
  ckpt::LocalCommitCoordinator coordinator_;
  ckpt::Persister persister_;
  std::unique_ptr<ckpt::AsyncPersister> async_;
};

PySnapshot ReadFile(const std::string& path, bool verify) {
  ckpt::ReadOptions options;
  options.verify_data = verify;
  absl::StatusOr<ckpt::Snapshot> snap;
  {
    py::gil_scoped_release release;
    snap = ckpt::ReadCheckpointFile(path, options);
  }
  Check(snap.status());
  return PySnapshot(std::move(*snap), nullptr);
}

// A snapshot of the image at [address, address + nbytes) (memory the caller
// owns and keeps alive and unchanged while the snapshot is used: a tensor an
// image was received into). Header and index are validated here; the data
// checksum by Verify() or a verified copy.
PySnapshot SnapshotAt(uintptr_t address, uint64_t nbytes, const std::string& source) {
  const auto* data = reinterpret_cast<const uint8_t*>(address);
  ckpt::ParseOptions parse;
  parse.verify_data = false;
  parse.exact_size = true;
  absl::StatusOr<ckpt::ParsedImage> image = ckpt::ParseImage(data, nbytes, source, parse);
  Check(image.status());
  return PySnapshot(ckpt::Snapshot::Of(*std::move(image), data, nbytes, source, nullptr, /*verified=*/false),
                    nullptr);
}

std::optional<uint64_t> ReadLatestStep(const std::string& dir) {
  absl::StatusOr<uint64_t> step = ckpt::ReadLatestStep(dir);
  if (absl::IsNotFound(step.status())) return std::nullopt;
  Check(step.status());
  return *step;
}

// Benchmark floor: seconds of the best of `repeats` plain parallel memcpys of
// the (address, nbytes) buffers, back to back, into pre-faulted shared memory.
double BenchMemcpy(const std::vector<std::pair<uintptr_t, uint64_t>>& buffers, int threads,
                   int repeats) {
  uint64_t total = 0;
  for (const auto& b : buffers) total += b.second;
  const std::string name = absl::StrCat("/ballast-bench-", getpid());
  absl::StatusOr<std::unique_ptr<ckpt::ShmSegment>> seg;
  {
    py::gil_scoped_release release;
    seg = ckpt::ShmSegment::Create(name, std::max<uint64_t>(total, 4096), true);
  }
  Check(seg.status());
  std::unique_ptr<ckpt::ShmSegment> segment = std::move(*seg);
  (void)ckpt::ShmSegment::Unlink(name);  // the mapping stays valid
  double best = 1e30;
  {
    py::gil_scoped_release release;
    (void)segment->Prefault(0, segment->size());  // best effort, like the slots
    CopyPool pool(threads > 0 ? threads : ckpt::DefaultCopyThreads());
    for (int r = 0; r < std::max(repeats, 1); ++r) {
      const auto start = std::chrono::steady_clock::now();
      uint64_t off = 0;
      for (const auto& [addr, n] : buffers) {
        ckpt::ParallelMemcpy(segment->data() + off, reinterpret_cast<const void*>(addr), n, &pool);
        off += n;
      }
      best = std::min(
          best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
  }
  return best;
}

// --- Progress (ballast.step) ------------------------------------------------
// The worker's progress cell (src/common/progress_cell.h), mapped on the first
// call: cell LOCAL_RANK of the agent's BALLAST_PROGRESS_SHM object, or a
// process-local cell without an agent (then step() only records locally). The
// mapping lives as long as the process; the agent unlinks the object.
ballast::ProgressCell g_local_cell;
ballast::ProgressCell* g_cell = nullptr;
std::string g_cell_source = "local";

ballast::ProgressCell* ResolveCell() {
  const char* name = std::getenv(ballast::kProgressShmEnv);
  const char* lr = std::getenv("LOCAL_RANK");
  if (name == nullptr || *name == '\0') return &g_local_cell;
  const long local_rank = lr != nullptr ? std::strtol(lr, nullptr, 10) : 0;
  int fd = shm_open(name, O_RDWR, 0);
  if (fd < 0) return &g_local_cell;
  struct stat st;
  void* base = MAP_FAILED;
  if (fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) >= ballast::ProgressShmSize(1))
    base = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) return &g_local_cell;
  const auto* header = static_cast<const ballast::ProgressHeader*>(base);
  if (header->magic != ballast::kProgressMagic || local_rank < 0 ||
      static_cast<uint64_t>(local_rank) >= header->num_cells ||
      ballast::ProgressShmSize(header->num_cells) > static_cast<size_t>(st.st_size)) {
    munmap(base, static_cast<size_t>(st.st_size));
    return &g_local_cell;
  }
  g_cell_source = absl::StrCat(name, "#", local_rank);
  return ballast::ProgressCellAt(base, static_cast<size_t>(local_rank));
}

inline ballast::ProgressCell* Cell() {
  if (g_cell == nullptr) g_cell = ResolveCell();
  return g_cell;
}

// A raw METH_O function rather than a pybind11 one: the call is on every
// training step, and this skips pybind11's argument dispatch.
PyObject* PyStep(PyObject*, PyObject* arg) {
  const long long n = PyLong_AsLongLong(arg);
  if (n == -1 && PyErr_Occurred() != nullptr) return nullptr;
  if (n < 0) {
    PyErr_Format(PyExc_ValueError, "ballast.step: the step must be >= 0, got %lld", n);
    return nullptr;
  }
  ballast::RecordStep(Cell(), static_cast<uint64_t>(n), ballast::MonotonicNowNs());
  Py_RETURN_NONE;
}

PyMethodDef kProgressMethods[] = {
    {"step", PyStep, METH_O,
     "step(n): tells the ballast agent that this worker reached training step n.\n\n"
     "Two stores into shared memory: cheap enough for every step. Under `ballast run "
     "--hang-timeout S` a worker whose step stops changing for S seconds is hung; the "
     "step times also feed the master's straggler detection. Without an agent it only "
     "records locally.\n\n"
     "Example::\n\n"
     "    for step in range(start, steps):\n"
     "        train_one_batch()\n"
     "        ballast.step(step)"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace
}  // namespace ballast::python

PYBIND11_MODULE(_ballast, m) {
  using namespace ballast::python;  // NOLINT: module definition only
  namespace ckpt = ballast::ckpt;
  m.doc() = "Ballast flash-checkpoint core (internal; use the `ballast` package).";
  m.attr("__version__") = BALLAST_VERSION;

  g_corrupt_error = PyErr_NewExceptionWithDoc(
      "ballast.CheckpointCorruptError",
      "A checkpoint file or shared-memory image failed validation (bad magic, size or "
      "checksum). Restore from another step or delete the named file.\n\n"
      "Example::\n\n"
      "    try:\n"
      "        step, state = ckpt.load()\n"
      "    except ballast.CheckpointCorruptError as e:\n"
      "        print(e)  # names the file; `ballast ckpt verify DIR` checks them all\n"
      "        step, state = ckpt.load(step=older_step)",
      PyExc_RuntimeError, nullptr);
  m.add_object("CheckpointCorruptError", py::handle(g_corrupt_error));

  py::class_<PyPrivateData>(m, "_PrivateData", py::buffer_protocol())
      .def("__len__", [](const PyPrivateData& d) { return d.data_bytes(); })
      .def_buffer([](PyPrivateData& d) {
        return py::buffer_info(d.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(d.data_bytes())}, {1});
      });

  py::class_<PySnapshot>(m, "Snapshot")
      .def_property_readonly("step", &PySnapshot::step)
      .def_property_readonly("source", &PySnapshot::source)
      .def("entries", &PySnapshot::Entries)
      .def("read_bytes", &PySnapshot::ReadBytes, py::arg("index"))
      .def("copy_to", &PySnapshot::CopyTo, py::arg("targets"), py::arg("verify") = false, py::arg("fresh") = true)
      .def_property_readonly("verified", [](const PySnapshot& s) { return s.verified(); })
      .def_property_readonly("image_bytes", &PySnapshot::image_bytes)
      .def("image_view", &PySnapshot::ImageView)
      .def("private_data", &PySnapshot::PrivateData)
      .def("entry_offsets", [](const PySnapshot& s) { return s.EntryOffsets(); })
      .def("verify", &PySnapshot::Verify)
      .def("copy_box", &PySnapshot::CopyBox, py::arg("index"), py::arg("elem_size"),
           py::arg("src_shape"), py::arg("src_start"), py::arg("dst"), py::arg("dst_shape"),
           py::arg("dst_start"), py::arg("box"));

  py::class_<PyStore>(m, "Store")
      .def_static("create", &PyStore::Create, py::arg("name"), py::arg("num_slots") = 3,
                  py::arg("initial_slot_bytes") = 0, py::arg("prefault") = true)
      .def_static("open", &PyStore::Open, py::arg("name"), py::arg("prefault") = true)
      .def_property_readonly("name", [](const PyStore& s) { return s.store()->name(); })
      .def_property_readonly("owner", [](const PyStore& s) { return s.store()->owner(); })
      .def("save", &PyStore::Save, py::arg("step"), py::arg("entries"))
      .def("save_async", &PyStore::SaveAsync, py::arg("step"), py::arg("entries"), py::arg("parallel") = false)
      .def("async_done", &PyStore::AsyncDone)
      .def("wait_async", &PyStore::WaitAsync)
      .def("reserve", &PyStore::Reserve, py::arg("entries"), py::arg("background") = false)
      // A save's slot sized and faulted in the background for an image of
      // about `image_bytes` (a shard just read from disk): false when nothing
      // was started (big enough already, or a growth under way).
      .def("reserve_bytes",
           [](const PyStore& s, uint64_t image_bytes) { return ckpt::ReserveForImage(s.store().get(), image_bytes); },
           py::arg("image_bytes"))
      .def("growing", [](const PyStore& s) { return s.store()->growing(); })
      // Each slot's sized bytes (for tests and logs).
      .def("capacities",
           [](const PyStore& s) {
             std::vector<uint64_t> out;
             for (const ckpt::SlotInfo& info : s.store()->Inspect()) out.push_back(info.capacity);
             return out;
           })
      .def("restore", &PyStore::Restore, py::arg("step") = py::none(), py::arg("verify") = true)
      .def("memory_step", &PyStore::MemoryStep)
      .def("steps", &PyStore::Steps)
      .def("wait_incoming", &PyStore::WaitIncoming, py::arg("timeout_s"))
      .def("set_persist_config", &PyStore::SetPersistConfig, py::arg("dir"), py::arg("rank"),
           py::arg("world_size"), py::arg("keep"))
      .def("get_persist_config", &PyStore::GetPersistConfig)
      .def("request_persist",
           [](const PyStore& s, uint64_t step) { s.store()->RequestPersist(step); })
      .def("requested_persist_step",
           [](const PyStore& s) { return s.store()->requested_persist_step(); })
      .def("mark_durable", [](const PyStore& s, uint64_t step) { s.store()->MarkDurable(step); })
      .def("durable_step", [](const PyStore& s) { return s.store()->durable_step(); })
      .def("durable_write_s", [](const PyStore& s) { return s.store()->durable_write_s(); })
      .def("request_replica",
           [](const PyStore& s, uint64_t step) { s.store()->RequestReplica(step); })
      .def("requested_replica_step",
           [](const PyStore& s) { return s.store()->requested_replica_step(); })
      .def("replicated_step", [](const PyStore& s) { return s.store()->replicated_step(); })
      .def("replica_put_s", [](const PyStore& s) { return s.store()->replica_put_s(); })
      .def("mark_committed",
           [](const PyStore& s, uint64_t step) { s.store()->MarkCommitted(step); })
      .def("committed_step", [](const PyStore& s) { return s.store()->committed_step(); })
      .def("wait_durable", &PyStore::WaitDurable, py::arg("step"), py::arg("timeout_s"))
      .def("persist_error",
           [](const PyStore& s) -> py::object {
             auto err = s.store()->GetPersistError();
             if (!err.has_value()) return py::none();
             return py::make_tuple(err->step, err->message);
           })
      .def("_report_persist_error",
           [](const PyStore& s, uint64_t step, const std::string& message) {
             s.store()->ReportPersistError(step, message);
           },
           py::arg("step"), py::arg("message"))
      .def("_set_test_pause_before_commit", &PyStore::SetTestPauseBeforeCommit, py::arg("path"))
      .def("close", &PyStore::Close);

  py::class_<PyLocalPersister>(m, "LocalPersister")
      .def(py::init<const PyStore&, const std::string&, int, int, int>(), py::arg("store"),
           py::arg("dir"), py::arg("rank"), py::arg("world_size"), py::arg("keep"))
      .def("request", &PyLocalPersister::Request, py::arg("step"))
      .def("wait", &PyLocalPersister::Wait, py::arg("step"), py::arg("timeout_s"))
      .def("close", &PyLocalPersister::Close);

  m.def("create_store", &PyStore::Create, py::arg("name"), py::arg("num_slots") = 3,
        py::arg("initial_slot_bytes") = 0, py::arg("prefault") = true,
        "Creates (and owns) a SlotStore, as the agent does; for tests and tools.");
  m.def("open_store", &PyStore::Open, py::arg("name"), py::arg("prefault") = true);
  m.def("read_file", &ReadFile, py::arg("path"), py::arg("verify") = true);
  m.def("read_latest_step", &ReadLatestStep, py::arg("dir"));
  m.def("_snapshot_at", &SnapshotAt, py::arg("address"), py::arg("nbytes"), py::arg("source"));
  m.def("_advise_fresh", [](uintptr_t address, uint64_t nbytes) {
    AdviseHugePages(reinterpret_cast<uint8_t*>(address), nbytes);
  }, py::arg("address"), py::arg("nbytes"), "Asks for huge pages on a fresh buffer before its first touch.");
  m.def("list_steps", &ckpt::ListSteps, py::arg("dir"));
  m.def("list_complete_steps", &ckpt::ListCompleteSteps, py::arg("dir"));
  m.def("shard_path", &ckpt::ShardPath, py::arg("dir"), py::arg("step"), py::arg("rank"));
  m.def("step_dir", &ckpt::StepDir, py::arg("dir"), py::arg("step"));
  m.def("default_copy_threads", &ckpt::DefaultCopyThreads);
  m.def("word_sum", [](uintptr_t address, uint64_t nbytes) {
    // The sum of the bytes as little-endian 64-bit words (a last partial word
    // zero-padded), mod 2^64: a parameter fingerprint (ballast.health). A
    // flipped bit always changes it. Memory-bandwidth bound, without the GIL.
    const auto* p = reinterpret_cast<const uint8_t*>(address);
    uint64_t sum = 0;
    {
      py::gil_scoped_release release;
      uint64_t a = 0, b = 0, c = 0, d = 0;
      uint64_t i = 0;
      for (; i + 32 <= nbytes; i += 32) {
        uint64_t w[4];
        std::memcpy(w, p + i, 32);
        a += w[0];
        b += w[1];
        c += w[2];
        d += w[3];
      }
      for (; i + 8 <= nbytes; i += 8) {
        uint64_t w;
        std::memcpy(&w, p + i, 8);
        a += w;
      }
      if (i < nbytes) {
        uint64_t w = 0;
        std::memcpy(&w, p + i, nbytes - i);
        b += w;
      }
      sum = a + b + c + d;
    }
    return sum;
  }, py::arg("address"), py::arg("nbytes"), "Sum of a CPU buffer's 64-bit words (parameter fingerprints).");
  m.def("bench_memcpy", &BenchMemcpy, py::arg("buffers"), py::arg("threads") = 0,
        py::arg("repeats") = 1);

  if (PyModule_AddFunctions(m.ptr(), kProgressMethods) != 0) throw py::error_already_set();
  m.def("progress_checkpoint", [](bool active) {
    Cell()->checkpoint_ns.store(active ? ballast::MonotonicNowNs() : 0, std::memory_order_release);
  }, py::arg("active"), "Marks the start (True) or end (False) of a checkpoint save: the agent then "
                        "allows BALLAST_HANG_CHECKPOINT_GRACE_S instead of the hang timeout.");
  m.def("progress_exiting", [] {
    ballast::ProgressCell* c = Cell();
    if (c->exiting_ns.load(std::memory_order_relaxed) == 0)
      c->exiting_ns.store(ballast::MonotonicNowNs(), std::memory_order_release);
  }, "Marks that this worker began to exit (atexit): the agent then allows BALLAST_HANG_EXIT_GRACE_S "
     "instead of the hang timeout while the interpreter tears down.");
  m.def("progress_ckpt_stall", [](double seconds, int saves) {
    ballast::ProgressCell* c = Cell();
    const auto ns = static_cast<uint64_t>(std::max(0.0, seconds) * 1e9);
    c->ckpt_stall_ns.store(c->ckpt_stall_ns.load(std::memory_order_relaxed) + ns, std::memory_order_relaxed);
    c->ckpt_saves.store(c->ckpt_saves.load(std::memory_order_relaxed) + static_cast<uint64_t>(std::max(0, saves)),
                        std::memory_order_relaxed);
  }, py::arg("seconds"), py::arg("saves"), "Adds time training was blocked by checkpoint saves (and saves made) "
                                           "for the master's goodput accountant.");
  m.def("progress_health", [](int kind, uint64_t step, double value, double median, double z, uint64_t epoch,
                               uint64_t begin, uint64_t end) {
    ballast::ProgressCell* c = Cell();
    auto bits = [](double d) { return std::bit_cast<uint64_t>(d); };
    c->health_step.store(step, std::memory_order_relaxed);
    c->health_value.store(bits(value), std::memory_order_relaxed);
    c->health_median.store(bits(median), std::memory_order_relaxed);
    c->health_z.store(bits(z), std::memory_order_relaxed);
    c->health_epoch.store(epoch, std::memory_order_relaxed);
    c->health_begin.store(begin, std::memory_order_relaxed);
    c->health_end.store(end, std::memory_order_relaxed);
    c->health_kind.store(static_cast<uint64_t>(kind), std::memory_order_release);
    return c != &g_local_cell;
  }, py::arg("kind"), py::arg("step"), py::arg("value"), py::arg("median"), py::arg("z"), py::arg("epoch"),
     py::arg("begin"), py::arg("end"),
     "Records a bad loss in the progress cell (ballast.health); True when an agent reads the cell.");
  m.def("progress_fingerprint", [](uint64_t step, uint64_t value, uint64_t group) {
    ballast::ProgressCell* c = Cell();
    c->fp_step.store(0, std::memory_order_release);  // a reader that sees 0 before and after skips it
    c->fp_value.store(value, std::memory_order_relaxed);
    c->fp_group.store(group, std::memory_order_relaxed);
    c->fp_step.store(step, std::memory_order_release);
  }, py::arg("step"), py::arg("value"), py::arg("group"),
     "Publishes a parameter fingerprint in the progress cell (ballast.health); the agent sends it to the master.");
  m.def("progress_sdc_agreed", [] { return Cell()->sdc_agreed.load(std::memory_order_acquire); },
        "The newest step at which the master found every rank's parameter fingerprints equal, as the agent "
        "last heard it (0: none yet, or no agent).");
  m.def("progress_sdc_wait", [](uint64_t step) { Cell()->sdc_wait.store(step, std::memory_order_release); },
        py::arg("step"),
        "Tells the agent that this worker waits to hear whether `step`'s fingerprints agreed (0: no longer): it "
        "reports to the master at once.");
  m.def("progress_compute", [](uint64_t ns) { Cell()->compute_ns.store(ns, std::memory_order_relaxed); },
        py::arg("ns"),
        "Publishes this rank's compute time per forward pass (ns) in the progress cell (ballast.health): the "
        "master's runtime straggler check compares it across nodes.");
  m.def("progress_state", [] {
    ballast::ProgressCell* c = Cell();
    return py::dict(py::arg("step") = c->step.load(), py::arg("timestamp_ns") = c->timestamp_ns.load(),
                    py::arg("checkpoint_ns") = c->checkpoint_ns.load(), py::arg("reports") = c->reports.load(),
                    py::arg("ckpt_saves") = c->ckpt_saves.load(), py::arg("ckpt_stall_ns") = c->ckpt_stall_ns.load(),
                    py::arg("compute_ns") = c->compute_ns.load(),
                    py::arg("cell") = g_cell_source);
  }, "The worker's progress cell, as the agent sees it (for tests and debugging).");
}
