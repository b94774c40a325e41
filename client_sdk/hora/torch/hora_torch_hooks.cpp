// The DistributedOptimizer's per-parameter work of a fused step, in C++
// (hora/torch/_native.py builds and loads it; _gradient_hooks.py and
// _fused.py use it when it is built, and their Python otherwise).
//
// - Notes: the parameters (by index) whose gradients came this step, in order.
// - NotingHooks: a post-hook on each parameter's gradient accumulator that
//   notes its index. Python's hook on a parameter costs a call into the
//   interpreter per gradient per step (0.5-0.8 ms for 400 on section 2c of
//   bench/README.md); this one appends under a mutex.
// - FusedViews: whether every gradient is its view of the fused buffer and
//   every parameter's data and shape are as they were: three passes of Python
//   over the parameters at each zero_grad() and synchronize().
#include <torch/extension.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace {

using torch::autograd::variable_list;
// c10::intrusive_ptr<Node> in recent torch, std::shared_ptr<Node> before.
using NodePtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<at::Tensor>()));
// A tensor held weakly: a parameter held from C++ is one Python's garbage
// collector no longer frees (torch counts it as owned by C++), and the
// optimizer's hooks on it lead back here.
using WeakTensor = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

WeakTensor weak(const at::Tensor& t) { return WeakTensor(t.getIntrusivePtr()); }

// The tensor, or an undefined one when it is gone.
at::Tensor lock(const WeakTensor& w) {
  auto strong = w.lock();
  return strong ? at::Tensor(std::move(strong)) : at::Tensor();
}

class Notes {
 public:
  explicit Notes(int64_t size) : size_(size) {}

  void note(int64_t index) {
    std::lock_guard<std::mutex> guard(mutex_);
    order_.push_back(index);
  }
  bool contains(int64_t index) {
    std::lock_guard<std::mutex> guard(mutex_);
    for (auto i : order_) {
      if (i == index) return true;
    }
    return false;
  }
  std::vector<int64_t> order() {
    std::lock_guard<std::mutex> guard(mutex_);
    return order_;
  }
  // The k-th index noted (k < count()).
  int64_t at(int64_t k) {
    std::lock_guard<std::mutex> guard(mutex_);
    return order_.at(static_cast<size_t>(k));
  }
  int64_t count() {
    std::lock_guard<std::mutex> guard(mutex_);
    return static_cast<int64_t>(order_.size());
  }
  // The first index noted twice, or -1.
  int64_t repeated() {
    std::lock_guard<std::mutex> guard(mutex_);
    std::vector<char> seen(size_, 0);
    for (auto i : order_) {
      if (seen[i]) return i;
      seen[i] = 1;
    }
    return -1;
  }
  // Keeps the first note of each index.
  void dedupe() {
    std::lock_guard<std::mutex> guard(mutex_);
    std::vector<char> seen(size_, 0);
    std::vector<int64_t> kept;
    for (auto i : order_) {
      if (!seen[i]) kept.push_back(i);
      seen[i] = 1;
    }
    order_.swap(kept);
  }
  void clear() {
    std::lock_guard<std::mutex> guard(mutex_);
    order_.clear();
  }

 private:
  int64_t size_;
  std::mutex mutex_;
  std::vector<int64_t> order_;
};

class NoteHook : public torch::autograd::FunctionPostHook {
 public:
  NoteHook(std::shared_ptr<Notes> notes, int64_t index) : notes_(std::move(notes)), index_(index) {}
  variable_list operator()(const variable_list& outputs, const variable_list& /*inputs*/) override {
    notes_->note(index_);
    return outputs;
  }

 private:
  std::shared_ptr<Notes> notes_;
  int64_t index_;
};

// A hook on each given parameter's gradient accumulator. The accumulators are
// held: one nobody holds is freed after each backward pass, and the next pass
// would make a new one without the hook. (An accumulator holds its parameter:
// the optimizer's Python hooks must not lead back to this object, see
// _gradient_hooks.py.) A parameter that needs no gradient has no accumulator,
// and is hooked once it has one.
class NotingHooks {
 public:
  NotingHooks(std::shared_ptr<Notes> notes, const std::vector<at::Tensor>& params,
              const std::vector<int64_t>& indices)
      : notes_(std::move(notes)) {
    for (auto i : indices) {
      params_.push_back(weak(params.at(i)));
      indices_.push_back(i);
      accumulators_.emplace_back();
      keys_.push_back(0);
      attach(params_.size() - 1);
    }
  }
  ~NotingHooks() { remove(); }

  // Hooks again each parameter whose accumulator is no longer the one hooked,
  // or was made for another shape, dtype or device: torch makes a new one when
  // a parameter is given data of another dtype or device, and keeps the old
  // one when only the shape changes, which a held accumulator would then
  // check every gradient against. True when some parameter was hooked again.
  bool refresh() {
    bool changed = false;
    for (size_t k = 0; k < params_.size(); ++k) {
      const auto p = lock(params_[k]);
      const auto& held = accumulators_[k];
      if (!p.defined()) continue;
      if (held) {
        const auto& meta = held->input_metadata(0);
        if (torch::autograd::impl::try_get_grad_accumulator(p) == held &&
            meta.is_same_shape(p) && meta.options().dtype() == p.dtype() &&
            meta.device() == p.device()) {
          continue;
        }
      } else if (!p.requires_grad()) {
        continue;
      }
      detach(k);
      attach(k);
      changed = true;
    }
    return changed;
  }
  void remove() {
    for (size_t k = 0; k < accumulators_.size(); ++k) detach(k);
    accumulators_.clear();
    keys_.clear();
    params_.clear();
    indices_.clear();
  }

 private:
  void attach(size_t k) {
    const auto p = lock(params_[k]);
    if (!p.defined() || !p.requires_grad()) return;
    auto accumulator = torch::autograd::impl::grad_accumulator(p);
    if (!accumulator) return;
    keys_[k] = accumulator->add_post_hook(std::make_unique<NoteHook>(notes_, indices_[k]));
    accumulators_[k] = std::move(accumulator);
  }
  void detach(size_t k) {
    if (accumulators_[k]) accumulators_[k]->del_post_hook(keys_[k]);
    accumulators_[k].reset();  // (then torch makes the parameter a new one)
  }

  std::shared_ptr<Notes> notes_;
  std::vector<WeakTensor> params_;
  std::vector<int64_t> indices_;
  std::vector<NodePtr> accumulators_;
  std::vector<uintptr_t> keys_;
};

// The parameters and views are held weakly (see WeakTensor); one that is gone
// fails every check.
class FusedViews {
 public:
  // ``shapes``: the parameters' shapes when the buffer was sized; ``view_data``:
  // where each view's data was when the views were made.
  FusedViews(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& views,
             std::vector<std::vector<int64_t>> shapes, std::vector<int64_t> view_data)
      : data_(params.size(), nullptr), shapes_(std::move(shapes)) {
    TORCH_CHECK(params.size() == views.size() && params.size() == shapes_.size() &&
                    params.size() == view_data.size(),
                "one view, shape and address per parameter");
    for (size_t i = 0; i < params.size(); ++i) {
      params_.push_back(weak(params[i]));
      views_.push_back(weak(views[i]));
      view_data_.push_back(reinterpret_cast<const void*>(view_data[i]));
    }
  }
  // Whether each view's data is where it was made (a conversion of the model,
  // ``Module._apply``, gives the gradients new storage and keeps them).
  bool views_in_place() const {
    for (size_t i = 0; i < views_.size(); ++i) {
      const auto v = lock(views_[i]);
      if (!v.defined() || v.data_ptr() != view_data_[i]) return false;
    }
    return true;
  }
  // Whether every gradient but those at ``loose`` (sorted) is its view.
  bool views_except(const std::vector<int64_t>& loose) const {
    size_t next = 0;
    for (size_t i = 0; i < params_.size(); ++i) {
      if (next < loose.size() && loose[next] == static_cast<int64_t>(i)) {
        ++next;
        continue;
      }
      const auto p = lock(params_[i]);
      if (!p.defined()) return false;
      const auto& grad = p.grad();
      if (!grad.defined() || grad.unsafeGetTensorImpl() != views_[i]._unsafe_get_target()) return false;
    }
    return true;
  }
  // Remembers where each parameter's data is now.
  void note_data() {
    for (size_t i = 0; i < params_.size(); ++i) {
      const auto p = lock(params_[i]);
      data_[i] = p.defined() ? p.data_ptr() : nullptr;
    }
    noted_ = true;
  }
  // Whether each parameter's data is where note_data() saw it (false before it).
  bool same_data() const {
    if (!noted_) return false;
    for (size_t i = 0; i < params_.size(); ++i) {
      const auto p = lock(params_[i]);
      if (!p.defined() || p.data_ptr() != data_[i]) return false;
    }
    return true;
  }
  // Whether each parameter has the shape it had when the buffer was sized.
  bool same_shapes() const {
    for (size_t i = 0; i < params_.size(); ++i) {
      const auto p = lock(params_[i]);
      if (!p.defined() || p.sizes() != c10::IntArrayRef(shapes_[i])) return false;
    }
    return true;
  }

 private:
  std::vector<WeakTensor> params_, views_;
  std::vector<const void*> data_, view_data_;
  std::vector<std::vector<int64_t>> shapes_;
  bool noted_ = false;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<Notes, std::shared_ptr<Notes>>(m, "Notes")
      .def(pybind11::init<int64_t>())
      .def("note", &Notes::note)
      .def("contains", &Notes::contains)
      .def("order", &Notes::order)
      .def("at", &Notes::at)
      .def("count", &Notes::count)
      .def("repeated", &Notes::repeated)
      .def("dedupe", &Notes::dedupe)
      .def("clear", &Notes::clear);
  pybind11::class_<NotingHooks>(m, "NotingHooks")
      .def(pybind11::init<std::shared_ptr<Notes>, const std::vector<at::Tensor>&,
                          const std::vector<int64_t>&>())
      .def("refresh", &NotingHooks::refresh)
      .def("remove", &NotingHooks::remove);
  pybind11::class_<FusedViews>(m, "FusedViews")
      .def(pybind11::init<const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                          std::vector<std::vector<int64_t>>, std::vector<int64_t>>())
      .def("views_except", &FusedViews::views_except)
      .def("views_in_place", &FusedViews::views_in_place)
      .def("note_data", &FusedViews::note_data)
      .def("same_data", &FusedViews::same_data)
      .def("same_shapes", &FusedViews::same_shapes);
}
