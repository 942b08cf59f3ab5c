#include "proto/types.h"

namespace ringd {

std::string describe(const OpDesc &d) {
    std::string s = std::to_string(d.count) + " x " + std::string(dtype_name(d.dtype));
    if (collective_reduces(d.collective)) s += " " + std::string(reduce_op_name(d.op));
    if (d.wire != WireFormat::Exact) s += " over a " + std::string(wire_format_name(d.wire)) + " wire";
    if (d.collective == Collective::Allreduce) return s;
    if (d.collective == Collective::Barrier) return "barrier over " + std::to_string(d.ranks) + " ranks";
    if (d.collective == Collective::AllToAll && d.count == 0)
        return "all_to_all of " + std::string(dtype_name(d.dtype)) + " by split sizes over " + std::to_string(d.ranks) + " ranks";
    if (collective_is_rooted(d.collective))
        return std::string(collective_name(d.collective)) + " of " + s + (d.collective == Collective::Broadcast ? " from" : " to") +
               " rank " + std::to_string(d.root) + " over " + std::to_string(d.ranks) + " ranks";
    return std::string(collective_name(d.collective)) + " of " + s + " over " + std::to_string(d.ranks) + " ranks";
}

std::optional<WireFormat> parse_wire_format(std::string_view name) {
    for (uint32_t i = 0; i < kWireFormatCount; ++i)
        if (name == wire_format_name(static_cast<WireFormat>(i))) return static_cast<WireFormat>(i);
    return std::nullopt;
}

std::optional<DType> parse_dtype(std::string_view s) {
    struct Name { std::string_view a, b; DType t; };
    static constexpr Name names[] = {
        {"f32", "float", DType::F32},   {"f64", "double", DType::F64},
        {"f16", "half", DType::F16},    {"bf16", "bfloat16", DType::BF16},
        {"i32", "int32", DType::I32},   {"i64", "int64", DType::I64},
    };
    for (const auto &n : names)
        if (s == n.a || s == n.b) return n.t;
    return std::nullopt;
}

std::optional<ReduceOp> parse_reduce_op(std::string_view s) {
    for (uint32_t i = 0; i < kReduceOpCount; ++i)
        if (s == reduce_op_name(static_cast<ReduceOp>(i))) return static_cast<ReduceOp>(i);
    return std::nullopt;
}

std::optional<Collective> parse_collective(std::string_view s) {
    for (uint32_t i = 0; i < kCollectiveCount; ++i)
        if (s == collective_name(static_cast<Collective>(i))) return static_cast<Collective>(i);
    return std::nullopt;
}

}  // namespace ringd
