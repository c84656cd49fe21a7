// Forward kernel, head dim 256, bf16. One file per (direction, head dim, dtype) keeps builds parallel and selective.
#include "sm80/fwd_launch.h"

FLASH_ATTN2_INSTANTIATE_FWD(256, kBFloat16)
