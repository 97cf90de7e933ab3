// The c10d::Backend that the mpcomm backend's Python class derives from, on every supported torch.
//
// torch binds a third-party backend to a device by registering a c10d::Backend with the ProcessGroup it builds
// (`_new_process_group_helper` -> `pg._register_backend(device, type, backend)`); only then do `_get_backend(cpu)`,
// `_device_types`, "cpu:mpcomm" strings and the dispatcher's CPU kernels reach it. A Python class can only be one
// through a trampoline: torch 2.13 has none for Backend, and 2.14's (PyBackend) hands the caller Works that
// answer neither `_source_rank()` (so `dist.recv` from any source fails) nor `is_completed()`, and recurses forever
// on `supports_coalescing` when the subclass does not define it. This one forwards each virtual to the Python method
// of torch 2.14's name (`all_gather_single` for `_allgather_base`, ...) and keeps each Python Work alive, and
// answering, while C++ holds it. The Python object itself is kept alive by the C++ one from `_keep_alive()` until
// `shutdown()` (torch holds only the C++ pointer).
#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace py = pybind11;

namespace {

using c10d::Work;

// A Python Work (a dist.Work subclass) as torch's C++ sees it: wait() and get_future() reach Python through
// torch's own Work trampoline; is_completed() and _source_rank(), which that trampoline does not forward, are
// asked of the Python object here.
class WorkHolder : public Work {
 public:
  explicit WorkHolder(py::object work) : work_(work.cast<c10::intrusive_ptr<Work>>()), py_work_(std::move(work)) {}

  ~WorkHolder() override {
    py::gil_scoped_acquire gil;
    py_work_ = py::object();
  }

  bool wait(std::chrono::milliseconds timeout) override {
    return work_->wait(timeout);
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    return work_->getFuture();
  }
  bool isCompleted() override {
    py::gil_scoped_acquire gil;
    return py_work_.attr("is_completed")().cast<bool>();
  }
  int sourceRank() const override {
    py::gil_scoped_acquire gil;
    return py_work_.attr("_source_rank")().cast<int>();
  }

 private:
  c10::intrusive_ptr<Work> work_;
  py::object py_work_;
};

class BackendBase : public c10d::Backend {
 public:
  BackendBase(int rank, int size) : c10d::Backend(rank, size) {}
};

// A Python method's Work, or the base class's behaviour (torch's "not supported" error) where Python has none.
#define MPCOMM_FORWARD(base_call, py_name, ...)                                      \
  do {                                                                               \
    py::gil_scoped_acquire gil;                                                      \
    py::function override = py::get_override(static_cast<const BackendBase*>(this), py_name); \
    if (override) {                                                                  \
      py::object work = override(__VA_ARGS__);                                       \
      if (work.is_none()) {                                                          \
        return c10::intrusive_ptr<Work>();                                           \
      }                                                                              \
      return c10::make_intrusive<WorkHolder>(std::move(work));                       \
    }                                                                                \
  } while (false);                                                                   \
  return base_call

class PyBackendBase : public BackendBase {
 public:
  using BackendBase::BackendBase;

  ~PyBackendBase() override {
    if (self_) {
      py::gil_scoped_acquire gil;
      self_ = py::object();
    }
  }

  void keep_alive(py::object self) { self_ = std::move(self); }

  c10::intrusive_ptr<Work> broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override {
    MPCOMM_FORWARD(Backend::broadcast(tensors, opts), "broadcast", tensors, opts);
  }
  c10::intrusive_ptr<Work> allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override {
    MPCOMM_FORWARD(Backend::allreduce(tensors, opts), "allreduce", tensors, opts);
  }
  c10::intrusive_ptr<Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
                                            const c10d::AllreduceOptions& opts) override {
    MPCOMM_FORWARD(Backend::allreduce_sparse(tensors, opts), "allreduce_sparse", tensors, opts);
  }
  c10::intrusive_ptr<Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                               const c10d::AllreduceCoalescedOptions& opts) override {
    MPCOMM_FORWARD(Backend::allreduce_coalesced(tensors, opts), "allreduce_coalesced", tensors, opts);
  }
  c10::intrusive_ptr<Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override {
    MPCOMM_FORWARD(Backend::reduce(tensors, opts), "reduce", tensors, opts);
  }
  c10::intrusive_ptr<Work> allgather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                     const c10d::AllgatherOptions& opts) override {
    MPCOMM_FORWARD(Backend::allgather(outputs, inputs, opts), "allgather", outputs, inputs, opts);
  }
  c10::intrusive_ptr<Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                           const c10d::AllgatherOptions& opts) override {
    MPCOMM_FORWARD(Backend::_allgather_base(output, input, opts), "all_gather_single", output, input, opts);
  }
  c10::intrusive_ptr<Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                               std::vector<at::Tensor>& inputs,
                                               const c10d::AllgatherOptions& opts) override {
    MPCOMM_FORWARD(Backend::allgather_coalesced(outputs, inputs, opts), "allgather_coalesced", outputs, inputs, opts);
  }
  c10::intrusive_ptr<Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                           std::vector<at::Tensor>& inputs,
                                                           const c10d::AllgatherOptions& opts) override {
    MPCOMM_FORWARD(Backend::allgather_into_tensor_coalesced(outputs, inputs, opts), "all_gather_single_coalesced",
                   outputs, inputs, opts);
  }
  c10::intrusive_ptr<Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                  const c10d::GatherOptions& opts) override {
    MPCOMM_FORWARD(Backend::gather(outputs, inputs, opts), "gather", outputs, inputs, opts);
  }
  c10::intrusive_ptr<Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                   const c10d::ScatterOptions& opts) override {
    MPCOMM_FORWARD(Backend::scatter(outputs, inputs, opts), "scatter", outputs, inputs, opts);
  }
  c10::intrusive_ptr<Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                          std::vector<std::vector<at::Tensor>>& inputs,
                                          const c10d::ReduceScatterOptions& opts) override {
    MPCOMM_FORWARD(Backend::reduce_scatter(outputs, inputs, opts), "reduce_scatter", outputs, inputs, opts);
  }
  c10::intrusive_ptr<Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                const c10d::ReduceScatterOptions& opts) override {
    MPCOMM_FORWARD(Backend::_reduce_scatter_base(output, input, opts), "reduce_scatter_single", output, input, opts);
  }
  c10::intrusive_ptr<Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                           std::vector<at::Tensor>& inputs,
                                                           const c10d::ReduceScatterOptions& opts) override {
    MPCOMM_FORWARD(Backend::reduce_scatter_tensor_coalesced(outputs, inputs, opts),
                   "reduce_scatter_single_coalesced", outputs, inputs, opts);
  }
  c10::intrusive_ptr<Work> alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_splits,
                                         std::vector<int64_t>& input_splits,
                                         const c10d::AllToAllOptions& opts) override {
    MPCOMM_FORWARD(Backend::alltoall_base(output, input, output_splits, input_splits, opts), "all_to_all_single",
                   output, input, output_splits, input_splits, opts);
  }
  c10::intrusive_ptr<Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                    const c10d::AllToAllOptions& opts) override {
    MPCOMM_FORWARD(Backend::alltoall(outputs, inputs, opts), "alltoall", outputs, inputs, opts);
  }
  c10::intrusive_ptr<Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    MPCOMM_FORWARD(Backend::send(tensors, dst, tag), "send", tensors, dst, tag);
  }
  c10::intrusive_ptr<Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    MPCOMM_FORWARD(Backend::recv(tensors, src, tag), "recv", tensors, src, tag);
  }
  c10::intrusive_ptr<Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
    MPCOMM_FORWARD(Backend::recvAnysource(tensors, tag), "recv_anysource", tensors, tag);
  }
  c10::intrusive_ptr<Work> barrier(const c10d::BarrierOptions& opts) override {
    MPCOMM_FORWARD(Backend::barrier(opts), "barrier", opts);
  }
  c10::intrusive_ptr<Work> endCoalescing() override {
    MPCOMM_FORWARD(Backend::endCoalescing(), "end_coalescing");
  }

  void startCoalescing() override {
    py::gil_scoped_acquire gil;
    if (py::function override = py::get_override(static_cast<const BackendBase*>(this), "start_coalescing")) {
      override();
      return;
    }
    Backend::startCoalescing();
  }
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override {
    py::gil_scoped_acquire gil;
    if (py::function override = py::get_override(static_cast<const BackendBase*>(this), "monitored_barrier")) {
      override(opts, wait_all_ranks);
      return;
    }
    Backend::monitoredBarrier(opts, wait_all_ranks);
  }
  void setSequenceNumberForGroup() override {
    py::gil_scoped_acquire gil;
    if (py::function override =
            py::get_override(static_cast<const BackendBase*>(this), "_set_sequence_number_for_group")) {
      override();
      return;
    }
    Backend::setSequenceNumberForGroup();
  }
  uint64_t getSequenceNumberForGroup() override {
    py::gil_scoped_acquire gil;
    if (py::function override =
            py::get_override(static_cast<const BackendBase*>(this), "_get_sequence_number_for_group")) {
      return override().cast<uint64_t>();
    }
    return Backend::getSequenceNumberForGroup();
  }
  const std::string getBackendName() const override {
    PYBIND11_OVERRIDE(std::string, BackendBase, getBackendName);
  }

  // dist.split_group (on a CPU group from torch 2.15): torch asks supports_splitting, then the options the child
  // starts from, then calls split on every rank of this group; the Python class's split() makes the child (None,
  // where this rank is not in `ranks`).
  bool supportsSplitting() const override {
    py::gil_scoped_acquire gil;
    return static_cast<bool>(py::get_override(static_cast<const BackendBase*>(this), "split"));
  }
  c10::intrusive_ptr<Options> getBackendOptions() override {
    py::gil_scoped_acquire gil;
    py::function override = py::get_override(static_cast<const BackendBase*>(this), "timeout_seconds");
    if (!override) {
      return Backend::getBackendOptions();
    }
    auto milliseconds = static_cast<int64_t>(override().cast<double>() * 1000.0);
    return c10::make_intrusive<Options>(getBackendName(), std::chrono::milliseconds(milliseconds));
  }
  c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
                                          const c10::intrusive_ptr<Options>& opts) override {
    py::gil_scoped_acquire gil;
    py::function override = py::get_override(static_cast<const BackendBase*>(this), "split");
    if (!override) {
      return Backend::split(store, ranks, opts);
    }
    py::object child = override(ranks, opts->timeout.count() / 1000.0, opts->group_name);
    if (child.is_none()) {
      return c10::intrusive_ptr<c10d::Backend>();
    }
    // (the child's Python object is kept alive by its C++ one, as every BackendBase is: keep_alive)
    return c10::intrusive_ptr<c10d::Backend>::unsafe_reclaim_from_nonowning(child.cast<BackendBase*>());
  }
  void abort() override {
    PYBIND11_OVERRIDE(void, BackendBase, abort);
  }
  void shutdown() override {
    py::gil_scoped_acquire gil;
    if (py::function override = py::get_override(static_cast<const BackendBase*>(this), "shutdown")) {
      override();
    }
    self_ = py::object();  // torch is done with it: the Python object may go
  }

 private:
  py::object self_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "The c10d::Backend that the mpcomm backend's Python class derives from";
  py::class_<BackendBase, c10d::Backend, PyBackendBase, c10::intrusive_ptr<BackendBase>>(m, "BackendBase")
      .def(py::init<int, int>(), py::arg("rank"), py::arg("size"))
      .def("_keep_alive", [](py::object self) {
        auto* backend = dynamic_cast<PyBackendBase*>(self.cast<BackendBase*>());
        if (backend == nullptr) {
          throw py::type_error("BackendBase._keep_alive: only for Python subclasses of BackendBase");
        }
        backend->keep_alive(self);
      });
}
