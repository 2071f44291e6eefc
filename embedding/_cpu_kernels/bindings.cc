// The handler symbols _cpu_kernels.py registers: each kernel's operands,
// results and attributes as XLA passes them. Included last by kernels.cc,
// after the kernels it binds.

#include <cstdint>

#include "common.h"

XLA_FFI_DEFINE_HANDLER_SYMBOL(SfSegments, Segments,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("slots")
                                  .Attr<int64_t>("partitions")
                                  .Attr<int64_t>("minibatches")
                                  .Attr<int64_t>("width"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SfRoute, Route,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .RemainingRets()
                                  .Attr<int64_t>("slots")
                                  .Attr<int64_t>("minibatches")
                                  .Attr<int64_t>("width")
                                  .Attr<int64_t>("rows"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SfGatherRows, GatherRows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("slots"));

// Pool and its transpose start with entry index, samples and gains; then
// Pool takes the rows' pieces, its transpose the samples' gradients.
static auto PoolOperands() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::F32>>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SfPool, Pool,
                              PoolOperands().RemainingArgs().Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SfPoolTranspose, PoolTranspose,
                              PoolOperands()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingRets());

// Every update: the hyperparameters, the stack's table starts and dims and
// the table; then the rule's slots and the received rows' and gradients'
// pieces. The results are the table and the slots.
#define SF_UPDATE_HANDLER(name, rule)                                   \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, Update<rule>,                     \
                                ffi::Ffi::Bind()                        \
                                    .Ctx<ffi::ThreadPool>()             \
                                    .Arg<ffi::Buffer<ffi::F32>>()       \
                                    .Arg<ffi::Buffer<ffi::S32>>()       \
                                    .Arg<ffi::Buffer<ffi::S32>>()       \
                                    .Arg<ffi::Buffer<ffi::F32>>()       \
                                    .RemainingArgs()                    \
                                    .Ret<ffi::Buffer<ffi::F32>>()       \
                                    .RemainingRets()                    \
                                    .Attr<int64_t>("slots")             \
                                    .Attr<int64_t>("rows_per_partition") \
                                    .Attr<float>("epsilon"));

SF_UPDATE_HANDLER(SfUpdateSgd, Rule::kSgd)
SF_UPDATE_HANDLER(SfUpdateAdagrad, Rule::kAdagrad)
SF_UPDATE_HANDLER(SfUpdateRowWiseAdagrad, Rule::kRowWiseAdagrad)
SF_UPDATE_HANDLER(SfUpdateLaProp, Rule::kLaProp)
SF_UPDATE_HANDLER(SfUpdateAdagradMomentum, Rule::kAdagradMomentum)
SF_UPDATE_HANDLER(SfUpdateF2A, Rule::kF2A)
SF_UPDATE_HANDLER(SfUpdateRowWiseAdam, Rule::kRowWiseAdam)

XLA_FFI_DEFINE_HANDLER_SYMBOL(SfPairwiseDots, PairwiseDots,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SfPairwiseDotsTranspose, PairwiseDotsTranspose,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
