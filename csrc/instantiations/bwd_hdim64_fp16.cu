// Backward kernel, head dim 64, fp16. One file per (direction, head dim, dtype) keeps builds parallel and selective.
#include "sm80/bwd_launch.h"

FLASH_ATTN2_INSTANTIATE_BWD(64, kFloat16)
