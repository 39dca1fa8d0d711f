/* A decoder layer's small ops in one call each, bfloat16 and float32, on the CPU
 * (kvserve/model/cpu_kernels).
 *
 * torch runs an RMSNorm as eight ops, the rotary embedding as four and the
 * gated activation as three, each a dispatch of a few microseconds over a few
 * thousand numbers in a decode step. These compute the same arithmetic, the
 * same roundings to bfloat16 in the same places (float32 in between), in one
 * call: RMSNorm as transformers computes it, with the residual add before it
 * fused in; the rotary embedding as x * cos + rotate_half(x) * sin; SiLU(gate)
 * rounded, then times up. Rows are split across threads only when there are
 * enough of them to pay for the fork. float32 computes the same ops without the
 * roundings (layer_ops.h is the body for both types).
 */
#include "bfloat16.h"

#define ELEM uint16_t
#define T(name) name##_bf16
#define TO_FLOAT(x) bf(x)
#define FROM_FLOAT(x) to_bf(x)
#define ROUND(x) round_bf(x)
#include "layer_ops.h"
#undef ELEM
#undef T
#undef TO_FLOAT
#undef FROM_FLOAT
#undef ROUND

#define ELEM float
#define T(name) name##_f32
#define TO_FLOAT(x) (x)
#define FROM_FLOAT(x) (x)
#define ROUND(x) (x)
#include "layer_ops.h"
