// CPU kernels of the sharded lookup and update (see ../_cpu_kernels.py).
//
// Each is a linear pass over one device's layout or over the rows it owns,
// so its cost follows the ids of the batch, not the capacity of the buffers.
// Shapes follow embedding/_lookup.py: S slots (partitions) per device, G
// devices, N = G * S partitions, K minibatches, W = max(N, 8) row pointers
// per (slot, minibatch), C layout entries per slot, U distinct rows one slot
// may need from one device, R rows per partition, D the padded dim, P samples
// per slot.
//
// The library is compiled from this file alone, the parts included into it:
// as one translation unit the compiler can inline any helper into any
// kernel, the helpers stay private to the library (one anonymous namespace
// across the parts, so a name is defined in one part only), and the build
// is a single compiler run.

#include "route_gather.cc"
#include "pool.cc"
#include "update.cc"
#include "interaction.cc"
#include "bindings.cc"
