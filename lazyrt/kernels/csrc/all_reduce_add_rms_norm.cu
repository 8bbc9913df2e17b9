// A tensor-parallel all-reduce, residual add and RMSNorm in one kernel: FlashInfer's TensorRT-LLM
// fusion (flashinfer/comm/trtllm_allreduce_fusion.cuh), pattern kARResidualRMSNorm, built for that
// pattern alone. FlashInfer's own `trtllm_comm` module instantiates every pattern, dtype and rank count
// (with the MoE and custom all-reduce files): over 8 minutes of nvcc on the GPU machine, against a
// minute or so for these few instances (16-bit with fp32 sums, fp32; 2, 4 or 8 ranks).
// Workspace: lazyrt/runtime/worker/fused_all_reduce_norm.py builds it in torch's symmetric memory.
#include "flashinfer/comm/trtllm_allreduce_fusion.cuh"
#include "tvm_ffi_utils.h"

using namespace flashinfer::trtllm_allreduce_fusion;

namespace {

constexpr AllReduceFusionPattern kPattern = AllReduceFusionPattern::kARResidualRMSNorm;

template <typename T, int NRanks>
cudaError_t launch(AllReduceFusionParams<T> const& params) {
  // 16-bit inputs are summed in fp32 (fp32 inputs always are)
  return allreduce_fusion_kernel_launcher<kPattern, T, NRanks, !std::is_same_v<T, float>>(params, false);
}

template <typename T>
void run(TensorView partial, TensorView workspace, int64_t world_size, int64_t world_rank,
         TensorView residual_in, TensorView residual_out, TensorView norm_out, TensorView gamma,
         double eps) {
  AllReduceFusionParams<T> params;
  params.nranks = static_cast<int>(world_size);
  params.rank = static_cast<int>(world_rank);
  params.size = static_cast<int>(partial.size(0) * partial.size(1));
  params.hidden_dim = static_cast<int>(partial.size(1));
  params.workspace = reinterpret_cast<void**>(workspace.data_ptr());
  params.allreduce_in = partial.data_ptr();
  params.allreduce_out = nullptr;
  params.residual_in = residual_in.data_ptr();
  params.residual_out = residual_out.data_ptr();
  params.norm_out = norm_out.data_ptr();
  params.quant_out = nullptr;
  params.scale_out = nullptr;
  params.rms_gamma = gamma.data_ptr();
  params.rms_eps = static_cast<float>(eps);
  params.scale_factor = nullptr;
  params.use_oneshot = true;  // one-shot Lamport: the workspace holds up to its max_tokens rows
  params.pattern = kPattern;
  params.trigger_completion_at_end = true;
  params.stream = get_stream(partial.device());
  cudaError_t status;
  switch (world_size) {
    case 2: status = launch<T, 2>(params); break;
    case 4: status = launch<T, 4>(params); break;
    case 8: status = launch<T, 8>(params); break;
    default: TVM_FFI_LOG_AND_THROW(NotImplementedError) << "ranks must be 2, 4 or 8, not " << world_size;
  }
  TVM_FFI_ICHECK(status == cudaSuccess) << "all_reduce_add_rms_norm: " << cudaGetErrorString(status);
}

}  // namespace

void all_reduce_add_rms_norm(TensorView partial, TensorView workspace, int64_t world_size,
                             int64_t world_rank, TensorView residual_in, TensorView residual_out,
                             TensorView norm_out, TensorView gamma, double eps) {
  ffi::CUDADeviceGuard device_guard(partial.device().device_id);
  switch (encode_dlpack_dtype(partial.dtype())) {
    case bfloat16_code:
      return run<__nv_bfloat16>(partial, workspace, world_size, world_rank, residual_in, residual_out,
                                norm_out, gamma, eps);
    case float16_code:
      return run<half>(partial, workspace, world_size, world_rank, residual_in, residual_out, norm_out,
                       gamma, eps);
    case float32_code:
      return run<float>(partial, workspace, world_size, world_rank, residual_in, residual_out, norm_out,
                        gamma, eps);
    default:
      TVM_FFI_LOG_AND_THROW(NotImplementedError) << "dtype must be bf16, fp16 or fp32";
  }
}

TVM_FFI_DLL_EXPORT_TYPED_FUNC(all_reduce_add_rms_norm, all_reduce_add_rms_norm);
