// Compressed wire formats: how a host's f32 data (its local ranks already reduced, in f32) travels
// when a group asks for fewer bytes on the wire, and how what arrives is accumulated — always in
// f32 — into the receiver's partial sums. The codec layer of the compressed collectives
// (docs/design.md, "Wire formats"); the schedules that use it are built on top.
//
//   exact  the data as it is (4 bytes per value).
//   bf16   bfloat16, round to nearest even: 2 bytes per value; |error| <= 2^-8 |x| for |x| >= 2^-126,
//          <= 2^-134 below (f32's subnormals) (NaN, infinities kept; as with any rounding to
//          fewer bits, |x| within 2^-9 of the largest float rounds to infinity, and within 2^-12
//          of it for fp16).
//   fp16   IEEE half of each block of 256 values scaled by a power of two so that the block's
//          largest magnitude lands in [2^14, 2^15] (nothing overflows, little underflows): a
//          4-byte scale and 2 bytes per value; |error| <= 2^-11 |x| + 2^-39 m, m the block's largest
//          magnitude (the second term: values that land below half's normal range). A block
//          holding a NaN or an infinity travels unscaled (those kept; its finite values then
//          within half's range as half rounds them, above 65504 infinite).
//   int8   each block of 256 values as q = round(x / s), s = m / 127, |q| <= 127: a 4-byte scale
//          and 1 byte per value; |error| <= m / 254 (1 + 2^-14) (the half step, and the f32
//          roundings of 127 / m and of q s). A block holding a NaN or an
//          infinity decodes as NaN (all of it: its scale is NaN); one whose values are all below
//          2^-100 as zeros.
// The fp16 and int8 bounds hold for blocks whose largest magnitude m is at least 2^-100 (below,
// the error is at most m).
//
// Error feedback: encode() may take a residual per value, added to the value before it is
// encoded and replaced by what the encoding lost of that sum, so that what a value loses in one
// step is sent in the next and the error does not grow over steps.
//
// A block of fp16 or int8 on the wire: its scale (an f32, the factor each decoded value is
// multiplied by), then its values. Blocks are counted from the first value of each call: a message cut into parts must cut it at
// multiples of kWireBlock for its blocks to match the sender's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include "proto/types.h"  // WireFormat

namespace ringd {

inline constexpr size_t kWireBlock = 256;  // values per block (fp16's and int8's scale)


// The bytes of `count` values in format f.
size_t wire_bytes(WireFormat f, size_t count);

// Writes `count` values of src (plus residual[i], where residual is given) in format f to `out`
// (wire_bytes(f, count) bytes, any alignment), which may be src itself where the encoding fits
// its values (wire_bytes(f, count) <= 4 count: every count but a single value of fp16 or int8,
// whose block's scale takes 4 bytes more): each block of values is read before it is written. With a residual, residual[i] becomes the value
// minus what the receiver decodes of it (0 for exact; a non-finite value's is 0).
void wire_encode(WireFormat f, const float *src, size_t count, void *out, float *residual = nullptr);

// acc[i] += the value i of `in` (count values in format f), in f32.
void wire_accumulate(WireFormat f, const void *in, size_t count, float *acc);

// out[i] = the value i of `in`.
void wire_decode(WireFormat f, const void *in, size_t count, float *out);

}  // namespace ringd
