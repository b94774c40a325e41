// hora's TensorFlow graph op: one asynchronous kernel for every collective.
//
// A graph's collectives must not block TensorFlow's inter-op threads: two ranks
// whose pools start different subsets of blocking collectives wait for each
// other forever. HoraCollective is an AsyncOpKernel, as Horovod's ops are:
// ComputeAsync files a request (context, done callback) under an id and returns
// at once. A Python dispatcher thread (hora/tensorflow/_graph_ops.py) takes
// requests through the C functions below (ctypes, GIL released while it waits),
// starts the engine's asynchronous collective, and on its completion allocates
// the outputs, copies the results in, sets the status and calls done().
//
// Built on first use against the installed TensorFlow (see _build.py).

#include <condition_variable>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <unordered_map>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/common_shape_fns.h"

namespace hora_tf {

using tensorflow::AsyncOpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;

struct Request {
  OpKernelContext* ctx;
  AsyncOpKernel::DoneCallback done;
  int64_t call_id;
};

// Never destroyed: the dispatcher thread may still wait on them while the process exits.
std::mutex& mu = *new std::mutex;
std::condition_variable& ready = *new std::condition_variable;
std::deque<int64_t>& queue = *new std::deque<int64_t>;
std::unordered_map<int64_t, Request>& live = *new std::unordered_map<int64_t, Request>;
int64_t next_id = 1;

Request* find(int64_t id) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = live.find(id);
  return it == live.end() ? nullptr : &it->second;
}

class HoraCollectiveOp : public AsyncOpKernel {
 public:
  explicit HoraCollectiveOp(OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("call_id", &call_id_));
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    {
      std::lock_guard<std::mutex> lock(mu);
      int64_t id = next_id++;
      live.emplace(id, Request{ctx, std::move(done), call_id_});
      queue.push_back(id);
    }
    ready.notify_one();
  }

 private:
  int64_t call_id_ = 0;
};

}  // namespace hora_tf

REGISTER_OP("HoraCollective")
    .Attr("call_id: int")
    .Attr("T: list(type) >= 0")
    .Attr("Tout: list(type) >= 0")
    .Input("inputs: T")
    .Output("outputs: Tout")
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::UnknownShape);

REGISTER_KERNEL_BUILDER(Name("HoraCollective").Device(tensorflow::DEVICE_CPU),
                        hora_tf::HoraCollectiveOp);

extern "C" {

// The next request's id, waiting up to timeout_ms; 0 when none came.
int64_t hora_tf_next(int timeout_ms) {
  std::unique_lock<std::mutex> lock(hora_tf::mu);
  if (!hora_tf::ready.wait_for(lock, std::chrono::milliseconds(timeout_ms),
                               [] { return !hora_tf::queue.empty(); })) {
    return 0;
  }
  int64_t id = hora_tf::queue.front();
  hora_tf::queue.pop_front();
  return id;
}

// The call id (the Python registry's key) of a request; -1 when unknown.
int64_t hora_tf_call_id(int64_t id) {
  hora_tf::Request* r = hora_tf::find(id);
  return r == nullptr ? -1 : r->call_id;
}

int hora_tf_num_inputs(int64_t id) {
  hora_tf::Request* r = hora_tf::find(id);
  return r == nullptr ? -1 : r->ctx->num_inputs();
}

// Input i of a request: dtype (TF's enum), shape (up to max_dims), bytes and data.
int hora_tf_input(int64_t id, int i, int* dtype, int* ndims, int64_t* dims, int max_dims,
                  const void** data, int64_t* nbytes) {
  hora_tf::Request* r = hora_tf::find(id);
  if (r == nullptr || i < 0 || i >= r->ctx->num_inputs()) return -1;
  const hora_tf::Tensor& t = r->ctx->input(i);
  if (t.dims() > max_dims) return -2;
  *dtype = static_cast<int>(t.dtype());
  *ndims = t.dims();
  for (int d = 0; d < t.dims(); ++d) dims[d] = t.dim_size(d);
  auto bytes = t.tensor_data();
  *data = bytes.data();
  *nbytes = static_cast<int64_t>(bytes.size());
  return 0;
}

// Allocates output i with the given shape; its data, its size in *nbytes. NULL on
// failure (the request's status says why; finish it with code 0 to keep that status).
void* hora_tf_output(int64_t id, int i, int ndims, const int64_t* dims, int64_t* nbytes) {
  hora_tf::Request* r = hora_tf::find(id);
  if (r == nullptr) return nullptr;
  hora_tf::TensorShape shape;
  for (int d = 0; d < ndims; ++d) {
    auto status = shape.AddDimWithStatus(dims[d]);
    if (!status.ok()) {
      r->ctx->SetStatus(status);
      return nullptr;
    }
  }
  hora_tf::Tensor* out = nullptr;
  auto status = r->ctx->allocate_output(i, shape, &out);
  if (!status.ok()) {
    r->ctx->SetStatus(status);
    return nullptr;
  }
  auto bytes = out->tensor_data();
  *nbytes = static_cast<int64_t>(bytes.size());
  // Non-null even for an empty output, so that NULL means failure.
  return bytes.size() ? const_cast<char*>(bytes.data()) : reinterpret_cast<void*>(out);
}

// Completes a request: code 0 leaves the status as it is, another sets it (absl's codes).
int hora_tf_finish(int64_t id, int code, const char* message) {
  hora_tf::Request request;
  {
    std::lock_guard<std::mutex> lock(hora_tf::mu);
    auto it = hora_tf::live.find(id);
    if (it == hora_tf::live.end()) return -1;
    request = std::move(it->second);
    hora_tf::live.erase(it);
  }
  if (code != 0) {
    request.ctx->SetStatus(absl::Status(static_cast<absl::StatusCode>(code), message));
  }
  request.done();
  return 0;
}

}  // extern "C"
