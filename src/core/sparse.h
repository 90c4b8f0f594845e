// Sparse payload encoding (header flag kFlagSparse).
//
// A dense payload is n elements of a dtype (element size es = dtype_size(t),
// 1 for kBytes). An element is "zero" iff all its es bytes are zero, so -0.0
// is not zero and is transmitted. The sparse form lists the other elements as
// pairs, back to back, with strictly increasing indices:
//
//   +--------------------------+----------------------------------+
//   | index: u32, big-endian   | value: es bytes, little-endian    |
//   +--------------------------+----------------------------------+
//
// The decoder is fed bytes from the network and checks every bound: a length
// that is not a whole number of pairs, an index >= n, or an index that is not
// greater than the previous one makes the whole payload malformed.
//
// All functions are pure and reentrant.
#pragma once

#include <cstddef>
#include <span>

#include "netdam/types.h"

namespace netdam::core {

// Number of bytes the sparse encoding of `dense` (n elements of t) would take.
// Only whole elements count (dense.size() should be a multiple of the element
// size; a trailing partial element is ignored).
size_t sparse_encoded_size(DType t, std::span<const std::byte> dense);

// True when more than half of the elements are zero AND the sparse form is
// smaller than dense. False for an empty payload, for a dense size that is not
// a multiple of the element size, and when n > 2^32 (indices would not fit).
bool sparse_is_worth_it(DType t, std::span<const std::byte> dense);

// Encode; `out` must have sparse_encoded_size bytes; returns bytes written.
// Precondition: dense holds at most 2^32 elements. Never writes past
// out.size(): if `out` is too small, the pairs that fit are written and the
// return value is the number of bytes written (less than the encoded size).
size_t sparse_encode(DType t, std::span<const std::byte> dense, std::span<std::byte> out);

// Decode pairs into `dense` (dense.size() bytes = n elements; zero-filled
// first). Returns false (and the contents of dense are unspecified) if the
// encoding is malformed: size not a multiple of (4 + elem size), index >= n,
// indices not strictly increasing, dense.size() not a multiple of the element
// size (or t is not a valid DType).
bool sparse_decode(DType t, std::span<const std::byte> pairs, std::span<std::byte> dense);

}  // namespace netdam::core
