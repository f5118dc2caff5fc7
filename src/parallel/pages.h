// Buffers whose memory goes back to the system between uses.
//
// A gradient buffer is refilled every step (accumulated from zero by backward, or overwritten
// by the reduce-scatters as they land), yet it stays resident from one step's update to the
// next one's backward, while the activations and the gathered units need the memory. Allocated
// here (on the CPU: a mapping of its own), clearing it hands its pages back to the system
// instead of writing zeros into them; they read as zeros and come back, zero, as backward
// writes them, so the buffer's memory follows what is live (FSDP2 frees its sharded gradients
// in zero_grad likewise). On a GPU the buffer is torch's, and clearing it writes zeros.
#pragma once

#include <ATen/core/Tensor.h>

namespace lockstep {

// `numel` zeros of `options`' dtype on its device: one flat buffer whose memory clear_pages()
// can hand back.
at::Tensor returnable_zeros(int64_t numel, const at::TensorOptions& options);

// Zeros every element of `buffer` (one returnable_zeros made): on the CPU by handing its pages
// back (nothing resident until written again), elsewhere by writing zeros.
void clear_pages(const at::Tensor& buffer);
// The same where the values are no longer needed (they are overwritten before they are read):
// on the CPU the pages go back, elsewhere nothing is done.
void release_pages(const at::Tensor& buffer);

}  // namespace lockstep
