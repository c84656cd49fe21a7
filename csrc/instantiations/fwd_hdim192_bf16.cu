// Forward kernel, head dim 192, bf16. One file per (direction, head dim, dtype) keeps builds parallel and selective.
#include "sm80/fwd_launch.h"

FLASH_ATTN2_INSTANTIATE_FWD(192, kBFloat16)
