// The torch backend's synchronous all-reduce of a small CPU tensor, straight into the MPI library.
//
// torch calls a Python ProcessGroup for every dist.all_reduce; going on through Tensor.numpy() and mpcomm's Python
// costs more than the MPI call itself for small tensors. This extension takes the tensor as it is and runs the
// all-reduce that mpcomm's `native` algorithm runs (MPI_Iallreduce in place, then canonical NaNs), so only when the
// Communicator has planned `native` for this call: `plan()` asks the group's Python resolver once per (dtype, bytes,
// op) and keeps its answer until auto's choices change (a tuning table loaded). The Communicator still runs the call
// (Communicator._run: the unusable / second-thread refusals, validation, the deadline, the records); `allreduce()`
// is the plan's function there. A request that is not done after a few tests is handed back to the transport's
// wait (deadline, yields, point-to-point progress), as every collective's is.
#include <torch/extension.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <mpi.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace {

MPI_Datatype mpi_type(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return MPI_FLOAT;
    case at::kDouble: return MPI_DOUBLE;
    case at::kLong: return MPI_INT64_T;
    case at::kInt: return MPI_INT32_T;
    case at::kShort: return MPI_INT16_T;
    case at::kChar: return MPI_INT8_T;
    case at::kByte: return MPI_UINT8_T;
    default: return MPI_DATATYPE_NULL;
  }
}

// Whether this path runs torch's op on this dtype (the MPI op itself is the plan's). Floating MIN/MAX stay with
// mpcomm's Python path, which reduces them as ordered integer keys so that NaNs come out as numpy's everywhere.
bool runs(c10d::ReduceOp::RedOpType op, bool floating) {
  switch (op) {
    case c10d::ReduceOp::SUM:
    case c10d::ReduceOp::PRODUCT: return true;
    case c10d::ReduceOp::MIN:
    case c10d::ReduceOp::MAX: return !floating;
    default: return false;
  }
}

template <typename T>
void canonical_nans(T* data, int64_t count) {
  // numpy's nan (a positive quiet NaN) wherever a NaN is, so every rank holds the same bits.
  const T nan = std::numeric_limits<T>::quiet_NaN();
  for (int64_t i = 0; i < count; ++i) {
    if (std::isnan(data[i])) data[i] = nan;
  }
}

struct Cached {
  py::object plan;          // the plan to run this call with, or None: not the native all-reduce
  long long generation;     // the Communicator's _plans_generation when it was planned
};

class NativeAllreduce {
 public:
  // comm: the mpi4py communicator the plans run on (its Fortran handle); size: its ranks; communicator: the
  // mpcomm Communicator; resolve(tensor, opts) -> a plan or None; request_from_handle: MPI.Request.f2py;
  // mpi_exception: MPI.Exception; tests: MPI_Test calls before the transport's wait.
  NativeAllreduce(int64_t comm, int size, py::object communicator, py::object resolve,
                  py::object request_from_handle, py::object mpi_exception, int tests)
      : comm_(MPI_Comm_f2c(static_cast<MPI_Fint>(comm))), size_(size), communicator_(std::move(communicator)),
        resolve_(std::move(resolve)), request_from_handle_(std::move(request_from_handle)),
        mpi_exception_(std::move(mpi_exception)), tests_(tests) {}

  // The plan to run a synchronous all-reduce of `tensor` with, or None when this call takes the general path.
  py::object plan(const at::Tensor& tensor, const c10d::AllreduceOptions& opts) {
    if (closed_ || opts.asyncOp || !tensor.is_cpu() || tensor.layout() != at::kStrided || !tensor.is_contiguous() ||
        tensor.is_conj() || tensor.is_neg() || tensor.numel() > std::numeric_limits<int>::max()) {
      return py::none();
    }
    const at::ScalarType scalar = tensor.scalar_type();
    if (mpi_type(scalar) == MPI_DATATYPE_NULL || !runs(opts.reduceOp.op_, at::isFloatingType(scalar))) {
      return py::none();
    }
    const uint64_t id = (static_cast<uint64_t>(tensor.nbytes()) << 16) | (static_cast<uint64_t>(scalar) << 8) |
                        static_cast<uint64_t>(opts.reduceOp.op_);
    const long long generation = communicator_.attr(generation_name_).cast<long long>();
    auto found = cache_.find(id);
    if (found != cache_.end() && found->second.generation == generation) return found->second.plan;
    // Not seen since auto's choices last changed: the Communicator plans it.
    py::object planned = resolve_(tensor, opts);
    if (!planned.is_none()) {  // its ReduceOp's MPI op (mpi4py's), looked up by address in allreduce()
      py::object rop = planned.attr("rop");
      const auto handle = rop.attr("mpi").attr("py2f")().cast<MPI_Fint>();
      if (ops_.emplace(rop.ptr(), MPI_Op_f2c(handle)).second) rops_.push_back(rop);  // (kept alive: keyed by address)
    }
    if (cache_.size() > 4096) cache_.clear();  // a sweep over many sizes: kept small, as the plan cache is
    cache_[id] = Cached{planned, generation};
    return planned;
  }

  // Let go of everything (the group is shut down; its plans and resolver refer back to this object).
  void clear() {
    closed_ = true;
    cache_.clear();
    ops_.clear();
    rops_.clear();
    communicator_ = resolve_ = py::none();
  }

  // plan.fn of a plan `plan()` returned: all-reduce `tensor` in place over the communicator with `rop`.
  void allreduce(py::handle transport, const at::Tensor& tensor, py::handle rop) {
    auto op = ops_.find(rop.ptr());
    const MPI_Datatype type = mpi_type(tensor.scalar_type());
    if (op == ops_.end() || type == MPI_DATATYPE_NULL) {
      throw std::logic_error("mpcomm native all-reduce: called with a plan that plan() did not return");
    }
    MPI_Request request;
    check(MPI_Iallreduce(MPI_IN_PLACE, tensor.data_ptr(), static_cast<int>(tensor.numel()), type, op->second,
                         comm_, &request));
    int done = 0;
    for (int i = 0; i < tests_ && !done; ++i) check(MPI_Test(&request, &done, MPI_STATUS_IGNORE));
    if (!done) {  // the transport waits for it: its deadline, yields and point-to-point progress
      transport.attr("wait_one")(request_from_handle_(static_cast<int64_t>(MPI_Request_c2f(request))));
    }
    if (size_ > 1) {
      if (type == MPI_FLOAT) canonical_nans(tensor.data_ptr<float>(), tensor.numel());
      else if (type == MPI_DOUBLE) canonical_nans(tensor.data_ptr<double>(), tensor.numel());
    }
  }

 private:
  void check(int code) {
    if (code != MPI_SUCCESS) {  // mpi4py's MPI.Exception, which the Communicator turns into its own error
      PyErr_SetObject(mpi_exception_.ptr(), py::int_(code).ptr());
      throw py::error_already_set();
    }
  }

  MPI_Comm comm_;
  int size_;
  py::object communicator_, resolve_, request_from_handle_, mpi_exception_;
  py::str generation_name_{"_plans_generation"};
  int tests_;
  std::unordered_map<uint64_t, Cached> cache_;
  std::unordered_map<PyObject*, MPI_Op> ops_;  // the plans' ReduceOps -> the MPI op
  std::vector<py::object> rops_;
  bool closed_ = false;
};

// torch reaches plan() on every dist.all_reduce and allreduce() runs it: both are called as plain METH_FASTCALL
// functions bound to their object (a capsule as `self`), without pybind11's dispatch (its cost is per call).
const char* const kCapsule = "mpcomm.NativeAllreduce";

NativeAllreduce* native_of(PyObject* capsule) {
  return static_cast<NativeAllreduce*>(PyCapsule_GetPointer(capsule, kCapsule));
}

template <typename Body>
PyObject* guarded(Body body) {
  try {
    return body();
  } catch (py::error_already_set& error) {
    error.restore();
  } catch (const std::exception& error) {
    PyErr_SetString(PyExc_RuntimeError, error.what());
  }
  return nullptr;
}

PyObject* plan_call(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  return guarded([&]() -> PyObject* {
    if (nargs != 2 || !THPVariable_Check(args[0])) throw py::type_error("plan(tensor, opts)");
    const auto& opts = py::cast<const c10d::AllreduceOptions&>(py::handle(args[1]));
    return native_of(self)->plan(THPVariable_Unpack(args[0]), opts).release().ptr();
  });
}

PyObject* allreduce_call(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  return guarded([&]() -> PyObject* {
    if (nargs != 3 || !THPVariable_Check(args[1])) throw py::type_error("allreduce(transport, tensor, rop)");
    native_of(self)->allreduce(py::handle(args[0]), THPVariable_Unpack(args[1]), py::handle(args[2]));
    Py_RETURN_NONE;
  });
}

PyMethodDef kPlan = {"plan", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(plan_call)), METH_FASTCALL,
                     "plan(tensor, opts): the plan to run this synchronous all-reduce with, or None"};
PyMethodDef kAllreduce = {"allreduce", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(allreduce_call)),
                          METH_FASTCALL, "allreduce(transport, tensor, rop): a plan's function"};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "The torch backend's synchronous all-reduce of small CPU tensors, straight into the MPI library";
  m.def("library_version", [] {
    char version[MPI_MAX_LIBRARY_VERSION_STRING];
    int length = 0;
    MPI_Get_library_version(version, &length);
    return std::string(version, length);
  });
  py::class_<NativeAllreduce>(m, "NativeAllreduce")
      .def(py::init<int64_t, int, py::object, py::object, py::object, py::object, int>())
      .def("functions", [](py::object self) {
        // (plan, allreduce), bound to this object; they keep it alive (their capsule holds a reference).
        PyObject* capsule = PyCapsule_New(self.cast<NativeAllreduce*>(), kCapsule, [](PyObject* c) {
          Py_XDECREF(static_cast<PyObject*>(PyCapsule_GetContext(c)));
        });
        if (capsule == nullptr || PyCapsule_SetContext(capsule, self.inc_ref().ptr()) != 0) {
          throw py::error_already_set();
        }
        py::object owner = py::reinterpret_steal<py::object>(capsule);
        return py::make_tuple(py::reinterpret_steal<py::object>(PyCFunction_New(&kPlan, capsule)),
                              py::reinterpret_steal<py::object>(PyCFunction_New(&kAllreduce, capsule)));
      }, "(plan, allreduce): this object's two calls as plain C functions")
      .def("clear", &NativeAllreduce::clear);
}
